"""nebula: train one model on several GPU clusters joined by slow wide-area links."""

__version__ = "0.1.0"
