"""The int8 codec package: blockwise absmax int8. ``params`` (the plan's view, standard library
only), ``codec`` (the wire, torch)."""
