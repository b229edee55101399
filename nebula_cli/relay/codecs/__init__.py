"""WAN codecs: the interface (``base``), the dense codecs (``dense``), the sparse one
(``topk``), ``compression: auto``'s choice between them (``choice``) and this cluster's
contribution to a round (``contribution``)."""
