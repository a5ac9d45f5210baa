"""``python -m heads.export``: the command's name for users; the layouts floor does the work.

The serving layouts live a floor above the heads (layouts/: each method's writers and readers
side by side, and ``layouts.export``, the one module that dispatches over them). This entry point
keeps the name the README and the design card give; it imports nothing from heads itself, only
the command it stands for (the one upward import the layering test allows).
"""

if __name__ == "__main__":
    import sys

    from layouts.export import main

    sys.exit(main())
