"""Soft labels across the WAN (the distillation issue's relay service): a teacher cluster's
label relay (`label_relay.LabelRelay`) answers the training clusters' requests (token ids in,
the teacher's sparse soft labels out) with the answers of its serving ranks
(`serve_link.ServeLink`); a student's `label_client.LabelClient` asks every teacher replica,
its asks spread over those alive and asked again of another when one goes. Messages:
`messages` (frozen dataclasses, one strict decoder each); the payload's encoding: `sparse`."""
