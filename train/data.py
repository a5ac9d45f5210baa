"""``python -m draftsmith.train.data`` (``draftsmith data``): tokenise and inspect training rows, regenerate
their answers with the target, merge shards.

The command lives in train/regenerate.py; the rows it reads and tokenises in train/rows.py. This
module is only the command's name, so that nothing imports it and it imports no circle.
"""

if __name__ == "__main__":
    from draftsmith.train.regenerate import main

    raise SystemExit(main())
