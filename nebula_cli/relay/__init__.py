"""The gradient relay: one process per cluster that exchanges compressed model updates with the
other clusters' relays over mutual TLS. This package knows nothing of SSH or the orchestrator.

- ``net/``: how relays and workers reach each other (frames, links, records, limits, shaping);
- ``codecs/``: fp32 tensors to compact payloads and back, and the choice between them;
- ``protocol/``: one round, from the worker's contribution to its outcome, across relays;
- ``process/``: the relay process itself, its worker port and status, and the workers' client.
"""
