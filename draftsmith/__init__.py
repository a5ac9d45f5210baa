"""draftsmith: train speculative-decoding drafts from a frozen target and measure them exactly.

The ``draftsmith`` command (:mod:`draftsmith.cli`) is the front door; the floors it dispatches to
are the top-level packages heads, distill, layouts, eval and train (docs/design.md).
"""
