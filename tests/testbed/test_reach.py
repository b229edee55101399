"""Relays that cannot be dialled: `relay_reach: outbound` makes a cluster's relay dial every
other cluster; a firewall (nftables in a test-bed host's namespace) proves it trains."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from helpers.jobs import CLI, REMOTE_JOBS, REPO, job_processes, wait_for
from helpers.quickstart import TINY_GPT
from helpers.specs import one, write
from helpers.ssh_jobs import records, ssh_spec

from nebula_cli.config import jobplan, plan_model, strict, worlds
from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.config.spec import JobSpec, load_spec
from nebula_cli.config.tunnel_config import TunnelConfig
from nebula_cli.transport.ssh.conn import SshConn
from testbed import TestBed

T = TypeVar("T")

TWO = """\
name: reach
run: python train.py
clusters:
  - name: cloud
    relay_reach: outbound
    hosts: [a1]
  - name: lab
    hosts: [b1]
  - name: hpc
    hosts: [c1]
relay: {}
"""


def test_outbound_clusters_dial_the_others(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, TWO))
    assert spec.dial_order == ["lab", "hpc", "cloud"]  # each dials those before it
    assert load_spec(write(tmp_path, TWO.replace("relay_reach: outbound", "relay_reach: "
                                                 "inbound"))).dial_order == ["cloud", "lab",
                                                                             "hpc"]


def test_two_outbound_clusters_meet_through_a_tunnel(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, TWO.replace("  - name: hpc\n",
                                                  "  - name: hpc\n    relay_reach: outbound\n")))
    assert spec.dial_order == ["lab", "cloud", "hpc"]
    assert [str(link) for link in spec.links()] == [
        "cloud dials lab", "hpc dials lab", "hpc dials cloud through an SSH tunnel"]


SSH_ONLY = """\
name: reach
run: python train.py
clusters:
  - name: lab
    hosts: [b1]
  - name: fort                 # only port 22 open, nothing out
    relay_reach: ssh
    hosts: [f1]
  - name: cloud
    relay_reach: outbound
    hosts: [a1]
relay: {}
"""


def test_an_ssh_only_cluster_is_dialled_through_tunnels(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, SSH_ONLY))
    assert spec.dial_order == ["fort", "lab", "cloud"]
    assert [str(link) for link in spec.links()] == [
        "lab dials fort through an SSH tunnel", "cloud dials fort through an SSH tunnel",
        "cloud dials lab"]


@pytest.mark.parametrize("change, field, words", [
    (("relay_reach: outbound", "relay_reach: ssh"), "clusters[2].relay_reach",
     "fort and cloud both have relay_reach: ssh: neither relay can dial out"),
    (("    hosts: [f1]", "    transport: local\n    hosts: [f1]"), "clusters[1].relay_reach",
     "relay_reach: ssh needs transport: ssh"),
    (("    hosts: [f1]", "    jump: bastion.example\n    hosts: [f1]"), "clusters[1].relay_reach",
     "only through the jump host bastion.example; give relay_address"),
    (("    hosts: [b1]\n", "    relay_reach: outbound\n    transport: local\n    hosts: [b1]\n"
                         "  - name: lab2\n    relay_reach: outbound\n    transport: local\n"
                         "    hosts: [x]\n"), "clusters[0].relay_reach",
     "lab and lab2 both have relay_reach: outbound, so lab2's relay must reach lab's through "
     "an SSH tunnel to its host, but lab runs on this machine"),
    (("    relay_reach: ssh\n", "    relay_on: login\n"), "clusters[1].relay_on",
     "relay_on: login is for Slurm clusters"),
])
def test_reach_that_leaves_a_pair_unconnected_is_refused(
        tmp_path: Path, cli: CLI, change: tuple[str, str], field: str, words: str) -> None:
    path = write(tmp_path, SSH_ONLY.replace(*change))
    problem = one(tmp_path, SSH_ONLY.replace(*change))
    assert problem.field == field and words in str(problem), str(problem)
    proc = cli("validate", str(path))
    assert proc.returncode == 2 and field in proc.stderr and words.split(":")[0] in proc.stderr


def test_unknown_reach_is_refused(tmp_path: Path) -> None:
    problem = one(tmp_path, TWO.replace("relay_reach: outbound", "relay_reach: tunnel"))
    assert problem.field == "clusters[0].relay_reach" and "outbound" in str(problem)


@contextlib.contextmanager
def firewall(bed: TestBed, host: str, *, outbound: bool = False) -> Iterator[None]:
    """nftables in the host's namespace: every new inbound TCP connection on its interface is
    dropped but SSH; with `outbound`, also everything it would send but replies (only port 22
    open, nothing out)."""
    if shutil.which("nft") is None:
        pytest.skip("nft not found (apt-get install nftables)")
    rules = ("table inet nebula_fw {\n chain input {\n"
             "  type filter hook input priority 0; policy accept;\n"
             '  iifname "eth0" tcp dport != 22 ct state new drop\n }\n')
    if outbound:
        rules += (" chain output {\n  type filter hook output priority 0; policy accept;\n"
                  '  oifname "eth0" ct state established,related accept\n'
                  '  oifname "eth0" drop\n }\n')
    bed.run(host, ["nft", "-f", "-"], input=rules + "}\n", check=True)
    try:
        yield
    finally:
        bed.run(host, ["nft", "delete", "table", "inet", "nebula_fw"])


def reaches(bed: TestBed, src: str, dst: str, port: int) -> bool:
    """Whether a TCP connection from host src to host dst's port gets an answer (a listener or
    a refusal) within 3 s, rather than being dropped."""
    addr = bed.hosts[dst].address
    return bed.run(src, ["timeout", "3", "bash", "-c", f"</dev/tcp/{addr}/{port}"]
                   ).returncode != 124  # refused (1) or accepted (0): not dropped


@pytest.mark.testbed
@pytest.mark.slow
def test_cluster_behind_a_firewall_dials_out_and_trains(ssh_cli: CLI, bed_clean: TestBed,
                                                        tmp_path: Path) -> None:
    # west is listed first: without relay_reach, east would dial it and be dropped
    spec_path = quick_spec(tmp_path, bed_clean, {"west": ["w1"], "east": ["e1"]},
                           west={"relay_reach": "outbound"})
    with firewall(bed_clean, "w1"):
        assert not reaches(bed_clean, "e1", "w1", 29400)  # nothing reaches west's relay port
        proc = ssh_cli("launch", str(spec_path), timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (job_id,) = ssh_cli.job_ids()
    assert "all 2 workers hold identical parameters" in proc.stdout
    rounds = [r for r in records(job_id) if r.get("outer_round") is not None]
    assert rounds and all(r["clusters_present"] == 2 for r in rounds)
    st = json.loads(ssh_cli("status", job_id, "--json", check=True).stdout)
    assert st["state"] == "SUCCEEDED"
    wait_for(lambda: job_processes(job_id) == [], timeout=30)


def quick_spec(tmp_path: Path, bed: TestBed, clusters: dict[str, list[str]],
               name: str = "sshjob", **changes: dict[str, Any]) -> Path:
    """The quickstart model over the bed's SSH hosts, 20 steps, a sync every 10; `changes`
    are set on the named clusters."""
    quick = yaml.safe_load((REPO / "templates" / "quickstart.yaml").read_text())
    relay = {**quick["relay"], "shaping": {"rate_mbit": None, "delay_ms": 10}}
    relay["sync"]["inner_steps"] = 10
    path = ssh_spec(tmp_path, bed, clusters=clusters, relay=relay, name=name,
                    run=f"python -u train.py --steps 20 --eval-every 10 --log-every 5 {TINY_GPT}",
                    workdir=REPO / "examples" / "gpt", deepspeed="ds_config.json")
    spec = yaml.safe_load(path.read_text())
    for c in spec["clusters"]:
        c.update(changes.get(c["name"], {}))
    path.write_text(yaml.safe_dump(spec))
    return path


def _ssh_clients(bed: TestBed, host: str, mark: str) -> list[str]:
    """The tunnel ssh clients on ``host`` whose command line names ``mark`` (the job's id or
    the netbench run's: their keys live under it), as another test's bed may run its own."""
    out = bed.run(host, ["pgrep", "-a", "-x", "ssh"]).stdout
    return [line for line in out.splitlines()
            if line.endswith(" 127.0.0.1:29400") and mark in line]


@pytest.mark.testbed
@pytest.mark.slow
def test_a_cluster_reached_only_by_ssh_trains_through_a_tunnel(
        ssh_cli: CLI, bed_clean: TestBed, tmp_path: Path) -> None:
    bed = bed_clean
    keys = bed.authorized_keys("w1")  # what w1's sshd reads besides the bed's own key
    spec_path = quick_spec(tmp_path, bed, {"west": ["w1"], "east": ["e1"]},
                           west={"relay_reach": "ssh", "authorized_keys": str(keys)})
    out = ssh_cli("validate", str(spec_path), check=True).stdout
    assert "relays: east dials west through an SSH tunnel to w1" in " ".join(out.split())
    with firewall(bed, "w1", outbound=True):
        assert not reaches(bed, "e1", "w1", 29400) and not reaches(bed, "w1", "e1", 29400)
        assert reaches(bed, "e1", "w1", 22) and not reaches(bed, "w1", "e1", 22)
        proc = ssh_cli("launch", str(spec_path), "--detach", timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        (job_id,) = ssh_cli.job_ids()
        # `launch` has returned: the tunnel is east's relay host's own ssh (one per connection:
        # the relays' link), the key on w1, its forced command joining it to the relay's port
        (client,) = wait_for(lambda: _ssh_clients(bed, "e1", job_id), timeout=60)
        assert f"-- {bed.hosts['w1'].address} 127.0.0.1:29400" in client and " -L " not in client
        # once its first session came, the key is refused from anywhere but e1 (as w1 sees it)
        pinned = f'from="{bed.hosts["e1"].address}"'
        (line,) = wait_for(lambda: [x for x in keys.read_text().splitlines()
                                    if "nebula-tunnel:" in x and pinned in x], timeout=60)
        assert line.startswith('restrict,command="env PYTHONPATH=') and "forwarding" not in line
        seen = REMOTE_JOBS / job_id / "west" / "w1" / "relay" / "tunnels" / "east.from"
        assert f"-m nebula_cli.agent.bridge --seen {seen} 127.0.0.1:29400" in line
        assert line.endswith(f"nebula-tunnel:{job_id}:east>west")
        state = wait_for(lambda: _ended(ssh_cli, job_id), timeout=600, every=5)
    assert state == "SUCCEEDED"
    finals = [r for r in records(job_id) if r.get("final")]
    assert {r["cluster"] for r in finals} == {"east", "west"}
    assert len({r["param_sha256"] for r in finals}) == 1  # identical parameters
    rounds = [r for r in records(job_id) if r.get("outer_round") is not None]
    assert rounds and all(r["clusters_present"] == 2 for r in rounds)
    relay_dir = REMOTE_JOBS / job_id / "east" / "e1" / "relay"
    # the tunnel's local end: a socket file in the relay's folder, not a port on loopback
    assert f"tunnel to west up: {relay_dir / 'tunnels' / 'west.sock'} -> 127.0.0.1:29400" \
        in (relay_dir / "logs" / "relay.log").read_text()
    # the relays ended with the job: no tunnel, no key line, no process left
    wait_for(lambda: not _ssh_clients(bed, "e1", job_id)
             and "nebula-tunnel" not in keys.read_text(),
             timeout=60)
    wait_for(lambda: job_processes(job_id) == [], timeout=30)


@pytest.mark.testbed
def test_validate_hosts_says_which_way_each_pair_connects(
        ssh_cli: CLI, bed_clean: TestBed, tmp_path: Path) -> None:
    bed = bed_clean
    clusters = {"west": ["w1"], "east": ["e1"], "north": ["n1"]}
    plain = quick_spec(tmp_path, bed, clusters)  # east dials west directly: the firewall drops it
    fixed = quick_spec(tmp_path, bed, clusters, "fixed", west={
        "relay_reach": "ssh", "authorized_keys": str(bed.authorized_keys("w1"))})
    with firewall(bed, "w1", outbound=True):
        refused = ssh_cli("validate", "--hosts", str(plain), timeout=300)
        accepted = ssh_cli("validate", "--hosts", str(fixed), timeout=300)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    rows = _rows(refused.stdout)
    assert rows["west - east"][:4] == ["✗ no answer in 5 s", "✗ no answer in 5 s",
                                       "✗ no answer in 5 s", "✓ sshd OpenSSH_9.2p1"]
    assert rows["west - east"][4] == "east dials west: fails"
    assert rows["east - north"][:2] == ["✓ connected", "✓ connected"]
    err = " ".join(refused.stderr.split())
    assert ("east cannot reach west to west's relay port: no answer in 5 s" in err
            and "every pair would connect with west: relay_reach: ssh" in err), err
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert _rows(accepted.stdout)["west - east"][4] == \
        "east dials west through an SSH tunnel: works"
    assert "all 3 hosts ready, every pair of relays can connect" in accepted.stdout
    assert not bed.authorized_keys("w1").exists()  # nothing granted by a check


def _rows(table: str) -> dict[str, list[str]]:
    """The reach table's rows: pair -> its cells."""
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) == 6 and " - " in cells[0]:
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.testbed
@pytest.mark.slow
def test_bench_network_measures_through_the_tunnel(
        ssh_cli: CLI, bed_clean: TestBed, tmp_path: Path) -> None:
    bed = bed_clean
    keys = bed.authorized_keys("w1")
    spec_path = quick_spec(tmp_path, bed, {"west": ["w1"], "east": ["e1"]},
                           west={"relay_reach": "ssh", "authorized_keys": str(keys)})
    out = tmp_path / "net.json"
    with firewall(bed, "w1", outbound=True):
        proc = ssh_cli("bench-network", str(spec_path), "--duration", "1", "--streams", "2",
                       "--output", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert [(p["a"], p["b"]) for p in report["pairs"]] == [("west", "east"), ("east", "west")]
    for pair in report["pairs"]:  # both ways over connections east opens, through the tunnel
        assert "error" not in pair and pair["dialer"] == "east", pair
        assert pair["path"] == "ssh tunnel" and pair["throughput_mbit"] > 1, pair
        assert pair["plain_throughput_mbit"] > 1 and 0 < pair["rtt_ms"] < 50, pair
    assert "dialled by east, through an SSH tunnel" in proc.stdout
    assert "w1: the run's tunnel keys let in" in proc.stderr
    assert not keys.read_text().strip() and not _ssh_clients(bed, "e1", report["run"])
    assert not (REMOTE_JOBS.parent / "netbench" / report["run"]).exists()


def _ended(cli: CLI, job_id: str) -> str | None:
    state = json.loads(cli("status", job_id, "--json", check=True).stdout)["state"]
    return state if state not in ("PENDING", "QUEUED", "RUNNING") else None


def test_validate_says_which_relay_dials_which(tmp_path: Path, cli: CLI) -> None:
    out = cli("validate", str(write(tmp_path, TWO)), check=True).stdout
    assert "relays: hpc dials lab, cloud dials lab, cloud dials hpc" in out
    out = " ".join(cli("validate", str(write(tmp_path, SSH_ONLY)), check=True).stdout.split())
    assert ("relays: lab dials fort through an SSH tunnel to f1, cloud dials fort through an SSH "
            "tunnel to f1, cloud dials lab") in out
    # how they sync, with the defaults that follow the codec resolved
    topk = TWO.replace("relay: {}", "relay: {compression: topk, sync: {inner_steps: 10}}")
    out = " ".join(cli("validate", str(write(tmp_path, topk)), check=True).stdout.split())
    assert ("sync: diloco every 10 steps, outer lr 2.5 / no momentum, topk (density 0.0625, "
            "2 bits) with error feedback") in out


def _tunnel_plan(spec: JobSpec) -> dict[str, plan_model.AgentPlan]:
    sites = {worlds.site_key(c, h): plan_model.Site(
        conn=SshConn(name=h.host, python="python3"), home="/home/u/.nebula",
        address=f"{h.host}.example", bind="0.0.0.0", python="/usr/bin/python3",
        shares_files=False, ssh=plan_model.SshLogin("u", 2222, f"ssh-ed25519 AAAA{h.host}"))
        for c in spec.clusters for h in c.hosts}
    ports = plan_model.Ports(masters={c.name: 29500 for c in spec.clusters},
                          relays={c.name: (29400, 29401) for c in spec.clusters})
    certs = plan_model.Certs(
        ca=b"CA", relays={c.name: (b"cert", b"key") for c in spec.clusters},
        workers={worlds.site_key(c, h): (b"c", b"k") for c in spec.clusters for h in c.hosts},
        tunnel_keys={"lab>fort": (b"PRIVATE-lab", "ssh-ed25519 AAAApublab"),
                     "cloud>fort": (b"PRIVATE-cloud", "ssh-ed25519 AAAApubcloud")},
        expires=dt.datetime(2027, 1, 2, 3, 4, 59, tzinfo=dt.UTC))
    plan = jobplan.build_plan(spec, "job-1", sites=sites, ports=ports, certs=certs)
    return {a.cluster: a for a in plan.role(plan_model.RELAY)}


def _part(agent: plan_model.AgentPlan, cls: type[T], name: str) -> T:
    return strict.from_dict(cls, json.loads(agent.files[name]))


def test_the_plan_carries_the_tunnels_to_the_relays(tmp_path: Path) -> None:
    relays = _tunnel_plan(load_spec(write(tmp_path, SSH_ONLY)))
    fort, lab, cloud = relays["fort"], relays["lab"], relays["cloud"]
    # fort: its relay port only on loopback; a key line per tunnel, nothing to dial
    assert _part(fort, RelayConfig, "relay.json").peer_listen == "127.0.0.1:29400"
    tunnels = _part(fort, TunnelConfig, "tunnels.json")
    assert tunnels.dial == [] and [g.peer for g in tunnels.grant] == ["lab", "cloud"]
    assert tunnels.grant[0].authorized_keys == "~/.ssh/authorized_keys"
    g = tunnels.grant[0]
    assert (g.public_key, g.targets, g.tag) == (
        "ssh-ed25519 AAAApublab", ["127.0.0.1:29400"], "nebula-tunnel:job-1:lab>fort")
    assert g.expires == int(dt.datetime(2027, 1, 2, 3, 4, 59, tzinfo=dt.UTC).timestamp())
    assert tunnels.grant_ttl == 900
    argv = fort.config.processes[0].argv
    assert argv[1:6] == ["-m", "nebula_cli.agent.tunnel", "run", "--config",
                         f"{fort.agent_dir}/tunnels.json"]
    assert argv[6:] == ["--", "/usr/bin/python3", "-m", "nebula_cli.relay", "--config",
                        f"{fort.agent_dir}/relay.json"]
    # lab: dials fort through its tunnel's local end (a Unix socket file in its agent folder,
    # not a loopback port every user of the host could reach), is dialled by cloud directly
    relay = _part(lab, RelayConfig, "relay.json")
    local_end = f"{lab.agent_dir}/tunnels/fort.sock"
    assert relay.peers["fort"] == local_end and relay.peer_listen == "0.0.0.0:29400"
    (dial,) = _part(lab, TunnelConfig, "tunnels.json").dial
    assert (dial.peer, dial.listen, dial.target, dial.host, dial.port, dial.user) == (
        "fort", local_end, "127.0.0.1:29400", "f1.example", 2222, "u")
    assert dial.key == f"{lab.agent_dir}/tunnels/fort.key"
    assert lab.files["tunnels/fort.key"] == b"PRIVATE-lab"
    assert lab.files["tunnels/known_hosts"] == b"nebula-job-1-fort ssh-ed25519 AAAAf1\n"
    assert dial.alias == "nebula-job-1-fort"
    # cloud: fort through a tunnel, lab directly; no relay without a tunnel is wrapped
    relay = _part(cloud, RelayConfig, "relay.json")
    assert relay.peers == {"fort": f"{cloud.agent_dir}/tunnels/fort.sock",
                           "lab": "b1.example:29400"}
    assert relay.clusters == ["fort", "lab", "cloud"]
    plain = _tunnel_plan(load_spec(write(tmp_path, TWO)))
    assert all("tunnels.json" not in a.files for a in plain.values())
    assert all(a.config.processes[0].argv[2] == "nebula_cli.relay" for a in plain.values())
