"""WAN codecs: the interface (``base``), the dense codecs (``dense``), the sparse one
(``topk``), the registry by name (``registry``), error feedback (``feedback``), chunking
(``chunks``), ``compression: auto``'s choice between codecs (``choice``) and this cluster's
contribution to a round (``contribution``). Each codec's knobs, cost and handshake are its
params class in :mod:`nebula_cli.config.codec_params`."""
