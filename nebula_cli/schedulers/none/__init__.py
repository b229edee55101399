"""`scheduler: none` (the default): the spec's hosts run the workers as written."""
