"""WAN codecs on the relay: the interface (``base``), the registry by name (``registry``, each
codec package's ``codec`` module: `nebula_cli/codecs/<name>/codec.py`), error feedback
(``feedback``), chunking (``chunks``), ``compression: auto``'s choice between codecs
(``choice``) and this cluster's contribution to a round (``contribution``). Each codec's knobs,
cost and handshake are its params class, its package's ``params`` module."""
