"""The none codec package: fp32 as is. ``params`` (the plan's view, standard library only),
``codec`` (the wire, torch)."""
