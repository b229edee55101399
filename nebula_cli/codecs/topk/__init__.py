"""The topk codec package: top-k per span with low-bit values. ``params`` (the plan's view,
standard library only), ``codec`` (the wire, torch)."""
