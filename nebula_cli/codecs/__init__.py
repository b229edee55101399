"""The WAN codecs, one package each, registered once in ``registry.py``."""
