"""Output directories and atomic writes, the file formats draftsmith reads and writes, and the
command line's one error tail: the floor every other one stands on."""
