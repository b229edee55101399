"""Key material on a real local launch: the job's CA key stays in the launching machine's state
(<home>/jobs/<id>/pki), no host's job directory holds it; `nebula status` warns a week before the
job's certificates expire. The world secret is in the workers' agent.json and their ranks'
environment only."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from helpers.jobs import CLI, job_processes, wait_for, write_spec

from nebula_cli import pki
from nebula_cli.config.parts import WORLD_SECRET_ENV
from nebula_cli.config.spec import JobSpec

SPEC = """
name: secret
workdir: .
run: echo "hello from $NEBULA_CLUSTER/$NEBULA_HOST"; sleep 60
env: {API_TOKEN: s3cret}
relay: {}
clusters:
  - {name: east, transport: local, hosts: [e1, e2]}
  - {name: west, transport: local, hosts: [w1]}
"""


def key_forms(pem: bytes) -> dict[str, bytes]:
    """Every form in which the CA key could be copied: PEM, DER, the bare private scalar."""
    key = serialization.load_pem_private_key(pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    body = b"".join(pem.strip().splitlines()[1:-1])
    return {"pem": pem.strip(), "pem body": body, "der": der,
            "scalar": key.private_numbers().private_value.to_bytes(32, "big")}


def test_the_ca_key_never_reaches_a_host_and_status_warns_before_expiry(
        tmp_path: Path, cli: CLI) -> None:
    proc = cli("launch", str(write_spec(tmp_path, SPEC)), "--detach", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (job_id,) = cli.job_ids()
    job_dir = cli.home / "jobs" / job_id
    pki_dir = job_dir / "pki"
    forms = key_forms((pki_dir / "ca.key").read_bytes())
    host_files = [p for p in job_dir.rglob("*") if p.is_file() and pki_dir not in p.parents]
    names = {p.name for p in host_files}
    assert {"relay.key", "worker.key", "ca.pem"} <= names, names  # the hosts got their keys
    agent_dirs = {p.parent for p in host_files if p.name == "agent.json"}
    assert {d.relative_to(job_dir).parts[:2] for d in agent_dirs} >= {
        ("east", "e1"), ("east", "e2"), ("west", "w1")}
    for path in host_files:
        data = path.read_bytes()
        for form, needle in forms.items():
            assert needle not in data, f"{path} holds the CA key ({form})"

    status = cli("status", job_id, timeout=60)
    assert status.returncode == 0 and "expire" not in status.stderr  # 90 days ahead
    ends = pki.expiry(pki_dir)
    days = JobSpec.model_fields["lifetime_days"].default
    assert ends - dt.datetime.now(dt.UTC) > dt.timedelta(days=days - 1)

    pki.renew_job_pki(pki_dir, valid_for=dt.timedelta(days=3))  # as if 87 days had passed
    status = cli("status", job_id, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "warning:" in status.stderr and "expire on" in status.stderr, status.stderr
    assert "lifetime_days" in status.stderr


def test_the_world_secret_is_drawn_per_job_and_only_in_agent_json_and_the_ranks_env(
        tmp_path: Path, cli: CLI) -> None:
    """The secret an abort in a world's store must carry (runtime/worldwatch.py): every worker
    agent of the job holds the same one in its agent.json (0600), a relay none; the agents hand
    it to their ranks in the environment; it is on no command line and in no other file of
    the job (logs, events, records, the launching machine's state)."""
    proc = cli("launch", str(write_spec(tmp_path, SPEC)), "--detach", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (job_id,) = cli.job_ids()
    job_dir = cli.home / "jobs" / job_id
    configs = {p.parent.relative_to(job_dir).parts: json.loads(p.read_text())
               for p in job_dir.rglob("agent.json")}
    secrets = {parts: c["world_secret"] for parts, c in configs.items()}
    workers = {s for parts, s in secrets.items() if parts[-1] == "worker"}
    (secret,) = workers  # one for the job's workers
    assert len(secret) == 64 and int(secret, 16)
    assert {s for parts, s in secrets.items() if parts[-1] == "relay"} == {""}
    for parts, c in configs.items():
        assert all(secret not in json.dumps(p) for p in c["processes"]), parts
    wait_for(lambda: len(_ranks(job_id)) >= 3, timeout=60)  # each rank's shell, its sleep
    for pid, (cmdline, environ) in _ranks(job_id).items():
        assert secret.encode() not in cmdline, pid
        assert f"{WORLD_SECRET_ENV}={secret}".encode() in environ.split(b"\0"), pid
    others = [p for p in cli.home.rglob("*") if p.is_file() and p.name != "agent.json"]
    assert [p for p in others if secret.encode() in p.read_bytes()] == []


def _ranks(job_id: str) -> dict[int, tuple[bytes, bytes]]:
    """pid -> (command line, environment) of the job's rank processes (RANK set)."""
    out = {}
    for pid in job_processes(job_id):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if any(v.startswith(b"RANK=") for v in environ.split(b"\0")):
            out[pid] = (cmdline, environ)
    return out
