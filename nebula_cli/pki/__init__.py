"""Per-job certificate authority and the mutual-TLS contexts built on it.

Every job gets its own CA. Each cluster relay and each worker host gets a certificate
signed by it whose SAN URI ``nebula://<job_id>/<role>/<cluster>/<name>`` says who it is
(``name`` is ``relay`` for relays, the host name for workers).

- `certs`: issuing, reopening, renewing and dating a job's certificates (files 0600/0700;
  ``ca.key`` never leaves the launching machine).
- `sshkeys`: the SSH keys of the relays' tunnels (one per tunnel and attempt).
- `tls`: TLS 1.3 contexts with mutual authentication, and the peer checks after a handshake.
"""

from nebula_cli.pki.certs import (
    CLOCK_SKEW,
    ROLES,
    WARN_BEFORE,
    CertPair,
    Identity,
    JobPKI,
    PeerRejected,
    _issue_leaf,
    _write_pair,
    expiry,
    expiry_warning,
    extend_job_pki,
    identity_of,
    issue_job_pki,
    load_pki,
    needs_renewal_warning,
    renew_job_pki,
    renewal_due,
)
from nebula_cli.pki.sshkeys import ssh_keypair
from nebula_cli.pki.tls import (
    HANDSHAKE_TIMEOUT,
    admission_name,
    check_peer,
    client_context,
    peer_identity,
    server_context,
    wrap_client,
    wrap_server,
)

__all__ = [
    "CLOCK_SKEW",
    "HANDSHAKE_TIMEOUT",
    "ROLES",
    "WARN_BEFORE",
    "CertPair",
    "Identity",
    "JobPKI",
    "PeerRejected",
    "_issue_leaf",
    "_write_pair",
    "admission_name",
    "check_peer",
    "client_context",
    "expiry",
    "expiry_warning",
    "identity_of",
    "issue_job_pki",
    "load_pki",
    "needs_renewal_warning",
    "peer_identity",
    "renew_job_pki",
    "renewal_due",
    "extend_job_pki",
    "server_context",
    "ssh_keypair",
    "wrap_client",
    "wrap_server",
]
