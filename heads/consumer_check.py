"""``python -m heads.consumer_check install``: the command's name for users (see
layouts/consumer_check.py, where the consumers' own loaders are run)."""

if __name__ == "__main__":
    import sys

    from layouts.consumer_check import main

    sys.exit(main())
