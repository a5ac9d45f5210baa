"""``python -m draftsmith``: the ``draftsmith`` command without its console script."""

from draftsmith.cli import entry

entry()
