"""SSH keys for the relays' tunnels: one Ed25519 key per tunnel and attempt of a job.

The private key goes (0600) to the dialling relay's host only; the public key into the
dialled host's authorized_keys, limited to that one forwarding (`config.relay_plan`).
"""

from __future__ import annotations

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519


def ssh_keypair() -> tuple[bytes, str]:
    """(OpenSSH private key, "ssh-ed25519 <base64>") of a new key."""
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH)
    return private, public.decode()
