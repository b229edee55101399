"""`HostFacts.ports`: the ports a job's services listen on, as the hosts' transports give them:
a teacher cluster's label relay gets its own, free where hosts share this machine (the local
transport; SSH hosts get the spec's preferred port, as the relays do)."""

from __future__ import annotations

import socket
from pathlib import Path

from nebula_cli.config.distill_plan import labels_port
from nebula_cli.config.spec import JobSpec, parse_spec
from nebula_cli.control.planning import HostFacts
from nebula_cli.control.session import Session
from nebula_cli.control.state import StateStore

SPEC = """\
name: d
run: python train.py
relay: {}
distill: {topk: 4}
clusters:
  - {name: lab, transport: TRANSPORT, hosts: [t1], role: teacher, teacher: {model: m}}
  - {name: cloud, transport: TRANSPORT, hosts: [s1]}
"""


def spec_of(transport: str) -> JobSpec:
    return parse_spec(SPEC.replace("TRANSPORT", transport), base_dir=Path(__file__).parent)



def test_a_local_teachers_label_relay_gets_a_free_port(tmp_path: Path) -> None:
    spec = spec_of("local")
    with StateStore(tmp_path) as store, Session(store) as session:
        facts = HostFacts(session)
        ports = facts.ports(spec, facts.sites(spec))
    assert set(ports.labels) == {"lab"}  # the teacher's only: a student serves no labels
    port = ports.labels["lab"]
    assert port != labels_port(spec)  # not the fixed relay.port + 2 another job may hold
    assert port not in {p for pair in ports.relays.values() for p in pair}
    with socket.socket() as s:  # free when planned
        s.bind(("127.0.0.1", port))

