"""The half codec package: the 16-bit float casts, fp16 and bf16. ``params`` (the plan's view,
standard library only), ``codec`` (the wire, torch)."""
