"""The typed plan: one pure function from the spec, consumers load their parts with the same
models, every default defined once (in the spec's model), and no transport branch in the
control plane."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers.jobs import REPO
from helpers.plan_defaults import MINIMAL, minimal_spec

from nebula_cli.config import jobplan, plan_model, strict, worlds
from nebula_cli.config.parts import (
    METRICS_FILE_ENV,
    SYNC_CONFIG_ENV,
    AgentConfig,
    CheckpointSettings,
    SyncConfig,
    helper_env,
)
from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.config.spec import (
    CheckpointSpec,
    CompressionSpec,
    JobSpec,
    RelaySpec,
    SyncSpec,
    parse_spec,
)
from nebula_cli.transport.ssh.conn import SshConn

PACKAGE = REPO / "nebula_cli"


def _plan(spec: JobSpec) -> plan_model.JobPlan:
    sites = {worlds.site_key(c, h): plan_model.Site(
        conn=SshConn(name=h.host, python="python3"), home=f"/home/u/.nebula-{c.name}",
        address=f"{h.host}.example", bind="0.0.0.0", python="/opt/py/bin/python3",
        shares_files=False) for c in spec.clusters for h in c.hosts}
    ports = plan_model.Ports(masters={c.name: 29500 + i for i, c in enumerate(spec.clusters)},
                          relays={c.name: (29400, 29401) for c in spec.clusters})
    certs = plan_model.Certs(
        ca=b"CA", relays={c.name: (b"cert", b"key") for c in spec.clusters},
        workers={worlds.site_key(c, h): (b"cert", b"key")
                 for c in spec.clusters for h in c.hosts})
    return jobplan.build_plan(spec, "job-1", sites=sites, ports=ports, certs=certs)


def _written(agent: plan_model.AgentPlan, tmp_path: Path) -> Path:
    """The agent's files as the launch writes them on its host, under tmp_path."""
    root = tmp_path / agent.key
    for rel, data in agent.files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    strict.write(agent.config, root / "agent.json")
    return root


def test_every_consumer_loads_the_spec_defaults(tmp_path: Path) -> None:
    spec = minimal_spec()
    plan = _plan(spec)
    relay_d, comp_d = RelaySpec(), CompressionSpec()
    sync_d = relay_d.sync  # outer lr and momentum: the default codec's
    assert SyncSpec().outer_lr is None and sync_d.outer_lr is not None
    relays, workers = plan.role(plan_model.RELAY), plan.role(plan_model.WORKER)
    assert [a.cluster for a in relays] == ["east", "west"] and len(workers) == 2
    for agent in plan.agents:
        root = _written(agent, tmp_path)
        config = AgentConfig.load(root / "agent.json")  # what the agent loads
        assert config == agent.config
        assert (root / "agent.json").stat().st_mode & 0o777 == 0o600
        if agent.role == plan_model.WORKER:
            assert config.grace == JobSpec.model_fields["grace"].default
            assert config.max_restarts == JobSpec.model_fields["max_restarts"].default
            (proc,) = config.processes
            assert proc.env[SYNC_CONFIG_ENV].endswith("/worker/sync.json")
            assert SYNC_CONFIG_ENV in proc.env and "NEBULA_ROUND_TIMEOUT" not in proc.env
            sync = SyncConfig.load(root / "sync.json")  # what the runtime loads
            assert (sync.inner_steps, sync.outer_lr, sync.outer_momentum, sync.nesterov,
                    sync.overlap, sync.overlap_steps, sync.mode) == (
                sync_d.inner_steps, sync_d.outer_lr, sync_d.outer_momentum, sync_d.nesterov,
                sync_d.overlap, sync_d.overlap_steps, sync_d.mode)
            assert (sync.codec, sync.error_feedback) == (comp_d.codec, comp_d.error_feedback)
            assert sync.round_timeout == relay_d.timeout
            assert sync.relay_addr == f"{agent.cluster[0]}1.example:29401"
            assert sync.checkpoint is None  # no `checkpoint:` in the spec
        else:
            relay = RelayConfig.load(root / "relay.json")  # what the relay loads
            assert (relay.codec, relay.error_feedback, relay.block_size) == (
                comp_d.codec, comp_d.error_feedback, comp_d.block_size)
            assert relay.feedback_decay == {c: comp_d.decay_for(c) for c in comp_d.codecs}
            assert (relay.round_timeout, relay.heartbeat) == (relay_d.timeout,
                                                              relay_d.heartbeat)
            assert relay.worker_listen == "0.0.0.0:29401"
            assert config.max_restarts == plan_model.RELAY_RESTARTS


def test_the_plan_is_frozen_and_built_purely() -> None:
    spec = minimal_spec()
    first, second = _plan(spec), _plan(spec)
    assert [a.config for a in first.agents] == [a.config for a in second.agents]
    assert [a.files for a in first.agents] == [a.files for a in second.agents]
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.agents[0].config.grace = 0.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.agents[0].host = "elsewhere"  # type: ignore[misc]


def test_remote_hosts_get_uploads_and_lib_path_local_ones_use_files_in_place() -> None:
    spec = minimal_spec()
    remote = _plan(spec).role(plan_model.WORKER)[0]
    assert remote.uploads == {spec.workdir: f"{remote.job_root}/work"}
    assert remote.config.cwd == f"{remote.job_root}/work"
    # nebula_cli from the uploaded lib (after the runtime hook's directory, when it is on)
    assert remote.config.processes[0].env["PYTHONPATH"].split(":")[-1] == f"{remote.job_root}/lib"
    assert remote.conn.pythonpath == f"{remote.job_root}/lib"


@pytest.mark.parametrize("change, match", [
    ({"grace": "10"}, "grace: expected a number"),
    ({"max_restarts": True}, "max_restarts: expected an integer"),
    ({"surprise": 1}, "unknown key"),
    ({"processes": [{"name": "0"}]}, "missing key"),
])
def test_plan_parts_are_loaded_strictly(tmp_path: Path, change: dict, match: str) -> None:
    agent = _plan(minimal_spec()).agents[0]
    data = {**strict.to_dict(agent.config), **change}
    (tmp_path / "agent.json").write_text(json.dumps(data))
    with pytest.raises(strict.PlanFileError, match=match):
        AgentConfig.load(tmp_path / "agent.json")


def test_plan_parts_have_no_defaults_of_their_own() -> None:
    spec_backed = {"codec", "error_feedback", "codec_params", "block_size", "round_timeout",
                   "heartbeat", "dead_after", "shaping"}
    for part in (AgentConfig, SyncConfig, RelayConfig, CheckpointSettings):
        defaulted = {f.name for f in dataclasses.fields(part)
                     if f.default is not dataclasses.MISSING
                     or f.default_factory is not dataclasses.MISSING}
        assert not defaulted & (spec_backed | {f.name for f in dataclasses.fields(SyncConfig)}
                                | {f.name for f in dataclasses.fields(AgentConfig)}), (
            part.__name__, defaulted)


def test_the_setup_command_runs_without_the_runtime_hook() -> None:
    spec = minimal_spec()
    worker = _plan(spec).role(plan_model.WORKER)[0]
    env = worker.config.processes[0].env
    assert "autohook" in env["PYTHONPATH"]  # training processes get the hook
    assert env[METRICS_FILE_ENV].endswith("/metrics/rank0.jsonl")  # the rank's records
    setup = helper_env(env)
    assert "autohook" not in setup["PYTHONPATH"]
    assert setup["PYTHONPATH"] == f"{worker.job_root}/lib"  # nebula_cli still importable
    assert METRICS_FILE_ENV not in setup  # a helper never writes into a rank's records


def test_checkpoint_settings_come_from_the_spec_one_directory_per_host(tmp_path: Path) -> None:
    base = tmp_path / "spec"
    base.mkdir()
    defaults = CheckpointSpec()
    for section, want_dir, every in (
            ("checkpoint: {}", None, defaults.every),
            ("checkpoint: {dir: ck, every: 7, keep: 3}", "ck", 7),
            ("checkpoint: {dir: /scratch/ck}", "/scratch/ck", defaults.every)):
        spec = parse_spec(MINIMAL + section + "\n", base_dir=base)
        seen = set()
        for agent in _plan(spec).role(plan_model.WORKER):
            sync = SyncConfig.load(_written(agent, tmp_path / section) / "sync.json")
            ck = sync.checkpoint
            assert ck is not None and ck.every == every
            assert ck.keep == (3 if "keep" in section else defaults.keep)
            if want_dir is None:
                want = f"{agent.job_root}/{defaults.dir}/{agent.cluster}/{agent.host}"
            elif want_dir.startswith("/"):  # absolute: the job id keeps jobs apart
                want = f"{want_dir}/job-1/{agent.cluster}/{agent.host}"
            else:
                want = f"{agent.job_root}/{want_dir}/{agent.cluster}/{agent.host}"
            assert ck.dir == want
            seen.add(ck.dir)
        assert len(seen) == 2  # east's host and west's host never share a directory


def test_hosts_of_multi_host_worlds_are_asked_for_the_interface_to_a_peer() -> None:
    """A world of two hosts or more, with no `interface:` in the spec: each host routes to the
    master (the master to the next host), and its ranks get what it found."""
    spec = parse_spec("""
name: routes
run: python train.py
relay: {}
clusters:
  - {name: east, transport: ssh, hosts: [e1, e2, e3]}
  - {name: west, transport: ssh, hosts: [w1]}
  - {name: north, transport: ssh, interface: eth7, hosts: [n1, n2]}
  - {name: south, transport: ssh, hosts: [s1, {host: s2, interface: eth9}]}
""", base_dir=Path(__file__).parent)
    plan = _plan(spec)
    sites = {worlds.site_key(c, h): plan_model.Site(
        conn=SshConn(name=h.host, python="python3"), home="/h", address=f"{h.host}.example",
        bind="0.0.0.0", python="python3",
        shares_files=False) for c in spec.clusters for h in c.hosts}
    assert worlds.route_targets(spec, sites) == {
        "east/e1": "e2.example", "east/e2": "e1.example", "east/e3": "e1.example",
        "south/s1": "s2.example"}
    routed = {k: dataclasses.replace(s, interface="ens5") if k.startswith("east/") else s
              for k, s in sites.items()}
    ports = plan_model.Ports(masters={c.name: 29500 for c in spec.clusters},
                          relays={c.name: (29400, 29401) for c in spec.clusters})
    certs = plan_model.Certs(ca=b"CA", relays={c.name: (b"c", b"k") for c in spec.clusters},
                          workers={k: (b"c", b"k") for k in sites})
    env = {f"{a.cluster}/{a.host}": a.config.processes[0].env for a in jobplan.build_plan(
        spec, "job-1", sites=routed, ports=ports, certs=certs).role(plan_model.WORKER)}
    unrouted = {f"{a.cluster}/{a.host}": a.config.processes[0].env
                for a in plan.role(plan_model.WORKER)}
    for key, ifname in (("east/e1", "ens5"), ("east/e3", "ens5"), ("north/n2", "eth7"),
                        ("south/s2", "eth9")):
        assert env[key]["GLOO_SOCKET_IFNAME"] == env[key]["NCCL_SOCKET_IFNAME"] == ifname
    assert "GLOO_SOCKET_IFNAME" not in env["west/w1"]  # one host: loopback does
    assert "GLOO_SOCKET_IFNAME" not in unrouted["east/e1"]


def test_a_clusters_max_restarts_reaches_its_hosts_agents() -> None:
    spec = parse_spec(MINIMAL.replace("hosts: [e1]}", "hosts: [e1], max_restarts: 4}")
                      + "max_restarts: 1\n", base_dir=Path(__file__).parent)
    got = {a.cluster: a.config.max_restarts for a in _plan(spec).role(plan_model.WORKER)}
    assert got == {"east": 4, "west": 1}


def test_rank_0_on_the_relays_host_gets_the_relays_socket(tmp_path: Path) -> None:
    """The Unix socket travels in the plan: the relay's relay.json names it, sync.json names
    it on the relay's host (where rank 0 runs when the gateway is the first host), and only
    there; workers on the other hosts reach the relay with TLS."""
    two_hosts = MINIMAL.replace("hosts: [e1]", "hosts: [e1, e2]")
    for text, gateway in ((two_hosts, "e1"),
                          (two_hosts.replace("hosts: [e1, e2]", "hosts: [e1, e2], gateway: e2"),
                           "e2")):
        plan = _plan(parse_spec(text, base_dir=tmp_path))
        relays = {a.cluster: a for a in plan.role(plan_model.RELAY)}
        assert (relays["east"].host, relays["west"].host) == (gateway, "w1")
        sockets = {c: RelayConfig.load(_written(a, tmp_path) / "relay.json").worker_socket
                   for c, a in relays.items()}
        assert sockets == {c: f"{a.agent_dir}/worker.sock" for c, a in relays.items()}
        for agent in plan.role(plan_model.WORKER):
            sync = SyncConfig.load(_written(agent, tmp_path) / "sync.json")
            if agent.host == relays[agent.cluster].host:
                assert sync.relay_socket == sockets[agent.cluster]
            else:
                assert sync.relay_socket is None, agent.key
        assert [a.host for a in plan.role(plan_model.WORKER) if a.node_rank == 0] == ["e1", "w1"]


def test_a_users_pythonpath_follows_nebulas_own_on_hosts_that_get_an_upload() -> None:
    """Over SSH nebula_cli is uploaded and its folder goes first on PYTHONPATH; the spec's and
    the cluster's PYTHONPATH come after it (they were dropped: a worker could not import the
    user's modules), and the user's own PYTHONUNBUFFERED wins over nebula's."""
    spec = parse_spec(MINIMAL.replace("hosts: [e1]}", "hosts: [e1], env: {PYTHONPATH: /c}}")
                      + "env: {PYTHONPATH: /s, PYTHONUNBUFFERED: '0'}\n",
                      base_dir=Path(__file__).parent)
    env = {a.cluster: a.config.processes[0].env for a in _plan(spec).role(plan_model.WORKER)}
    lib = "/home/u/.nebula-{}/jobs/job-1/lib"
    assert env["east"]["PYTHONPATH"].split(":")[-2:] == [lib.format("east"), "/c"]
    assert env["west"]["PYTHONPATH"].split(":")[-2:] == [lib.format("west"), "/s"]
    assert env["west"]["PYTHONUNBUFFERED"] == "0"
