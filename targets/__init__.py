"""The frozen target: loading it (one process, or sharded over several), checking its identity,
and the hidden states drafts read from it."""
