"""The gradient relay: one process per cluster that exchanges compressed model updates with the
other clusters' relays over mutual TLS. ``wire`` frames bytes on a connection, ``codecs`` turns
fp32 tensors into compact payloads and back. This package knows nothing of SSH or the
orchestrator."""
