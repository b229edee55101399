"""Job spec cross-field checks (names, hosts, gateways, ports, files, min_clusters, restarts), each
with the exact file:line:col and field path. Helpers: helpers/specs.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.specs import BASE, one, problems, where, write

from nebula_cli.config.spec import ClusterSpec, JobSpec, load_spec, parse_spec
from nebula_cli.errors import SpecError

# ---- cross-field checks ---------------------------------------------------------------------


def test_duplicate_cluster_names(tmp_path: Path) -> None:
    p = one(tmp_path, BASE + "  - name: east\n    hosts: [w1]\n")
    assert where(p) == (9, 11, "clusters[1].name")
    assert p.message == "duplicate cluster name 'east' (also clusters[0])"


def test_duplicate_hosts_in_a_cluster(tmp_path: Path) -> None:
    found = problems(tmp_path, """\
        name: demo
        run: echo hi
        clusters:
          - name: east
            hosts:
              - a
              - {host: a, port: 22}
              - "u@a:22"
              - a
        """)
    assert [(where(p), p.message) for p in found] == [
        ((8, 9, "clusters[0].hosts[2]"), "duplicate host 'a' port 22 (already hosts[1])"),
        ((9, 9, "clusters[0].hosts[3]"), "duplicate host 'a' (already hosts[0])"),
    ]


def test_same_ssh_host_in_two_clusters(tmp_path: Path) -> None:
    p = one(tmp_path, BASE + "  - name: west\n    hosts: [w1, e2]\n")
    assert where(p) == (10, 17, "clusters[1].hosts[1]")
    assert p.message == ("host 'e2' is also in cluster 'east' (clusters[0].hosts[1]); "
                         "a host belongs to one cluster")
    # the same name as a local label, or under another user/port, is a different host
    load_spec(write(tmp_path, BASE + "  - name: west\n    transport: local\n    hosts: [e1]\n"))
    load_spec(write(tmp_path, BASE + "  - name: west\n    hosts: [bob@e1, 'e2:2222']\n"))


def test_gateway_not_among_hosts(tmp_path: Path) -> None:
    p = one(tmp_path, BASE + "    gateway: e3\n")
    assert where(p) == (9, 14, "clusters[0].gateway")
    assert p.message == "gateway 'e3' is not one of this cluster's hosts: e1, e2"


def test_dead_after_must_allow_two_heartbeats(tmp_path: Path) -> None:
    p = one(tmp_path, BASE + "relay:\n  heartbeat: 3\n  dead_after: 5\n")
    assert where(p)[2] == "relay.dead_after"
    assert p.message == "dead_after (5 s) must allow at least two heartbeats (6 s)"


def test_relay_ports_must_differ(tmp_path: Path) -> None:
    p = one(tmp_path, BASE + "relay:\n  port: 7000\n  worker_port: 7000\n")
    assert where(p) == (11, 16, "relay.worker_port")
    assert p.message == "worker_port must differ from port (both are 7000)"


def test_workdir_must_exist(tmp_path: Path) -> None:
    p = one(tmp_path, BASE + "workdir: nope\n")
    assert where(p) == (9, 10, "workdir")
    assert p.message.startswith("workdir 'nope' is not an existing directory")
    # defaulted workdir that does not exist: the problem points at the top of the file
    with pytest.raises(SpecError) as info:
        parse_spec(BASE, file="x.yaml", base_dir=tmp_path / "gone")
    assert where(info.value.problems[0]) == (1, 1, "workdir")


def test_deepspeed_config_must_exist_and_be_json(tmp_path: Path) -> None:
    p = one(tmp_path, BASE + "deepspeed: missing.json\n")
    assert where(p) == (9, 12, "deepspeed")
    assert p.message.startswith("cannot read the DeepSpeed config")
    (tmp_path / "bad.json").write_text("{not json")
    p = one(tmp_path, BASE + "deepspeed: bad.json\n")
    assert where(p) == (9, 12, "deepspeed") and "is not valid JSON" in p.message
    p = one(tmp_path, BASE + "deepspeed: {1: 2}\n")
    assert (where(p), p.message) == (
        (9, 12, "deepspeed"), "expected string keys in the DeepSpeed mapping, found 1")
    p = one(tmp_path, BASE + "relay: {1: 2}\n")
    assert (where(p), p.message) == ((9, 9, "relay[1]"), "expected a string key, found 1")
    p = one(tmp_path, BASE + "deepspeed: 5\n")
    assert p.message == ("expected a path to a DeepSpeed config JSON or an inline mapping, "
                         "found 5")


def test_env_keys_must_be_variable_names(tmp_path: Path) -> None:
    found = problems(tmp_path, BASE + "env:\n  GOOD: 1\n  1BAD: x\n  'with space': y\n")
    assert [where(p) for p in found] == [(11, 3, "env['1BAD']"), (12, 3, "env['with space']")]
    assert found[0].message.startswith("expected an environment variable name")
    p = one(tmp_path, BASE + "  - name: west\n    hosts: [w]\n    env: {A-B: 1}\n")
    assert where(p) == (11, 11, "clusters[1].env['A-B']")


def test_cluster_model_used_directly_reports_problems() -> None:
    with pytest.raises(ValueError, match="is not one of this cluster's hosts"):
        ClusterSpec.model_validate({"name": "c", "hosts": ["a"], "gateway": "b"})
    with pytest.raises(ValueError, match="at least one cluster"):
        JobSpec.model_validate({"name": "j", "run": "x", "clusters": []})


@pytest.mark.parametrize("name", ["lib", "work", "pki"])
def test_cluster_names_a_job_directory_uses_are_reserved(tmp_path: Path, name: str) -> None:
    p = one(tmp_path, BASE.replace("name: east", f"name: {name}"))
    assert p.field == "clusters[0].name" and "reserved" in p.message


def test_min_clusters_is_at_most_the_clusters_and_not_for_pipelines(tmp_path: Path) -> None:
    two = BASE + "  - name: west\n    hosts: [w1]\nrelay: {}\n"
    assert load_spec(write(tmp_path, two + "min_clusters: 1\n")).min_clusters == 1
    assert load_spec(write(tmp_path, two)).min_clusters is None  # all of them
    p = one(tmp_path, two + "min_clusters: 3\n")
    assert p.field == "min_clusters" and "more than the job's 2 clusters" in p.message
    p = one(tmp_path, two + "min_clusters: 0\n")
    assert p.field == "min_clusters"


def test_a_cluster_may_have_its_own_max_restarts(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, BASE + "    max_restarts: 5\n  - name: west\n"
                           "    hosts: [w1]\nmax_restarts: 1\n"))
    assert [c.max_restarts for c in spec.clusters] == [5, None] and spec.max_restarts == 1
