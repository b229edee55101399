"""The spec's Slurm clusters: what is accepted, what is refused (exit 2, the field and the
reason, nothing submitted), and the batch script rendered from schedulers/slurm/slurm.sbatch."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.jobs import CLI
from helpers.specs import one, write

from nebula_cli.config import jobplan, plan_model
from nebula_cli.config.spec import HostSpec, JobSpec, load_spec
from nebula_cli.control.allocations import ended_state
from nebula_cli.control.planning import site_entries
from nebula_cli.errors import UsageError
from nebula_cli.scheduler.allocation_state import AllocationState
from nebula_cli.schedulers.slurm import batch
from nebula_cli.schedulers.slurm.allocator import allocation_state, template_of
from nebula_cli.schedulers.slurm.node_conn import SlurmNodeConn
from nebula_cli.schedulers.slurm.scheduler import slurm_request
from nebula_cli.schedulers.slurm.slurm_cli import QueueState
from nebula_cli.transport.ssh.conn import SshConn

SLURM = """\
name: demo
run: python train.py
clusters:
  - name: hpc
    hosts: [login.hpc.example.edu]
    scheduler: slurm
    slurm:
      partition: gpu
      nodes: 2
      ntasks_per_node: 4
      gpus_per_node: 4
      cpus_per_task: 8
      time: "2-00:00:00"
      account: proj123
      sbatch_args: ["--exclusive"]
"""


def test_slurm_cluster_is_accepted_and_asks_slurm_for_what_it_says(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, SLURM))
    request = slurm_request(spec.clusters[0])
    assert request is not None
    assert request.sbatch_options() == [
        "--nodes=2", "--ntasks-per-node=4", "--partition=gpu", "--time=2-00:00:00",
        "--account=proj123", "--cpus-per-task=8", "--gpus-per-node=4",
        "--signal=TERM@120", "--exclusive"]


def test_slurm_section_defaults(tmp_path: Path) -> None:
    text = SLURM.split("    slurm:")[0]
    request = slurm_request(load_spec(write(tmp_path, text)).clusters[0])
    assert request is not None and request.nodes == 1 and request.ntasks_per_node == 1
    assert request.sbatch_options() == ["--nodes=1", "--ntasks-per-node=1",
                                        "--signal=TERM@120"]


def test_own_signal_replaces_nebulas(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, SLURM.replace('["--exclusive"]', '["--signal=B:USR1@60"]')))
    opts = slurm_request(spec.clusters[0]).sbatch_options()
    assert [o for o in opts if o.startswith("--signal")] == ["--signal=B:USR1@60"]


@pytest.mark.parametrize(("change", "field", "says"), [
    (("hosts: [login.hpc.example.edu]", "hosts: [login1, login2]"), "clusters[0].hosts",
     "one host, its login node"),
    (("nodes: 2", "nodes: 0"), "clusters[0].slurm.nodes", ">= 1"),
    (('time: "2-00:00:00"', 'time: "two days"'), "clusters[0].slurm.time",
     "Slurm time limit"),
    (('time: "2-00:00:00"', 'time: "0"'), "clusters[0].slurm.time", "Slurm time limit"),
    (('["--exclusive"]', '["exclusive"]'), "clusters[0].slurm.sbatch_args", "starting with '-'"),
    (("partition: gpu", "partition: 'gpu; rm -rf /'"), "clusters[0].slurm.partition",
     "Slurm name"),
    (("account: proj123", "account: 'proj 123'"), "clusters[0].slurm.account", "Slurm name"),
    (("account: proj123", 'constraint: "a100\\n#SBATCH --qos=high"'),
     "clusters[0].slurm.constraint", "node features"),
    (("account: proj123", "constraint: 'a100 && ib'"), "clusters[0].slurm.constraint",
     "no spaces"),
    # a trailing newline, which a pattern's `$` lets through
    (("partition: gpu", 'partition: "gpu\\n"'), "clusters[0].slurm.partition", "Slurm name"),
    (('time: "2-00:00:00"', 'time: "2-00:00:00\\n"'), "clusters[0].slurm.time",
     "Slurm time limit"),
    (("account: proj123", 'constraint: "a100\\n"'), "clusters[0].slurm.constraint",
     "node features"),
    (('["--exclusive"]', '["--comment=\\"x\\"\\rtouch /tmp/p"]'),
     "clusters[0].slurm.sbatch_args", "control characters"),
    (("    scheduler: slurm\n", ""), "clusters[0].slurm", "needs `scheduler: slurm`"),
    (("    scheduler: slurm\n", "    scheduler: pbs\n"), "clusters[0].scheduler", "slurm"),
])
def test_bad_slurm_specs_name_the_field(tmp_path: Path, change: tuple[str, str], field: str,
                                        says: str) -> None:
    assert change[0] in SLURM
    problem = one(tmp_path, SLURM.replace(*change))
    assert problem.field == field and says in str(problem), str(problem)
    assert problem.line is not None


def test_bad_slurm_spec_exits_2_before_anything_happens(tmp_path: Path, cli: CLI) -> None:
    path = write(tmp_path, SLURM.replace("nodes: 2", "nodes: 0"))
    out = cli("launch", "--detach", str(path))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "clusters[0].slurm.nodes" in out.stderr + out.stdout
    assert cli.job_ids() == []


def test_batch_script_renders_every_placeholder(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, SLURM))
    cluster = spec.clusters[0]
    script = batch.render(template_of(spec, cluster), batch.values(
        slurm_request(cluster), job_name="nebula-j-hpc", output="/r/slurm/hpc-%j.out",
        job_root="/r", pythonpath="/r/lib", python="python3"))
    assert "{{" not in script
    assert "#SBATCH --nodes=2\n" in script and "#SBATCH --gpus-per-node=4\n" in script
    assert "#SBATCH --output=/r/slurm/hpc-%j.out" in script
    assert 'gpu_option="--gpus-per-node=$gpus"' in script  # the job's GPUs on the node
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.mark.parametrize(("signal", "wait"), [
    (None, 120 + batch.NOTICE_SLACK), ("--signal=TERM@900", 900 + batch.NOTICE_SLACK),
    ("--signal=R:TERM", 60 + batch.NOTICE_SLACK), ("--signal=B:USR1@30", 30 + batch.NOTICE_SLACK)])
def test_the_keepers_wait_after_the_notice_outlasts_its_lead(tmp_path: Path, signal: str | None,
                                                             wait: int) -> None:
    """A keeper that left before Slurm ended the job after its notice would make the job
    COMPLETED, not TIMEOUT: its bounded wait covers the spec's --signal lead."""
    args = f'sbatch_args: ["--exclusive", "{signal}"]' if signal else 'sbatch_args: ["--exclusive"]'
    spec = load_spec(write(tmp_path, SLURM.replace('sbatch_args: ["--exclusive"]', args)))
    cluster = spec.clusters[0]
    script = batch.render(template_of(spec, cluster), batch.values(
        slurm_request(cluster), job_name="nebula-j-hpc", output="/r/slurm/hpc-%j.out",
        job_root="/r", pythonpath="/r/lib", python="python3"))
    assert f"--end-file \"$ended\" \\\n  --notice-wait {wait} &\n" in script, script


def test_own_template_with_unknown_placeholder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "my.sbatch").write_text("#!/bin/bash\n#SBATCH {{sbatch_options}}\n{{nodez}}\n")
    spec = load_spec(write(tmp_path, SLURM.replace(
        'sbatch_args: ["--exclusive"]', "template: my.sbatch")))
    cluster = spec.clusters[0]
    with pytest.raises(UsageError, match="unknown placeholders: nodez"):
        batch.render(template_of(spec, cluster), batch.values(
            slurm_request(cluster), job_name="j", output="o", job_root="/r",
            pythonpath="/r/lib", python="python3"))


def test_sbatch_missing_on_the_login_node_is_one_line_naming_it(tmp_path: Path,
                                                                cli: CLI) -> None:
    # the login node is this machine (transport local) with a PATH that has no Slurm
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "env", "cat", "uname"):
        (bin_dir / tool).symlink_to(shutil.which(tool) or f"/bin/{tool}")
    spec = write(tmp_path, SLURM.replace("    hosts: [login.hpc.example.edu]\n",
                                         "    transport: local\n    hosts: [login]\n"))
    cli.env["PATH"] = str(bin_dir)
    out = cli("launch", "--detach", str(spec))
    assert out.returncode == 1, out.stdout + out.stderr
    said = [line for line in out.stderr.splitlines() if "not found on the PATH" in line]
    assert said and "login: sbatch, squeue, scancel, scontrol, srun not found" in said[0], \
        out.stderr
    assert "submitted" not in out.stderr
    checked = cli("validate", "--hosts", str(spec))  # validate --hosts finds it first
    assert checked.returncode == 1 and "sbatch, squeue" in checked.stderr, checked.stderr


def test_only_an_ended_slurm_allocation_counts_as_ended() -> None:
    def said(state: str, reason: str = "", nodes: str = "") -> AllocationState:
        """What `status` gets of Slurm job 12 in `state` (squeue's words)."""
        return allocation_state("12", QueueState(state, reason, nodes))

    assert ended_state(said("TIMEOUT", nodes="c[1-2]"))
    assert str(said("TIMEOUT", nodes="c[1-2]")) == "Slurm job 12 TIMEOUT on c[1-2]"
    assert ended_state(said("CANCELLED"))
    assert not ended_state(said("RUNNING", nodes="c[1-2]"))
    assert not ended_state(said("PENDING", "BeginTime"))
    assert str(said("PENDING", "BeginTime")) == "Slurm job 12 PENDING (BeginTime)"
    assert not ended_state(said("COMPLETING", "TimeLimit", "c1"))
    assert not ended_state(None)  # no allocation: not ended


def _login(host: str) -> SshConn:
    return SshConn(name=host, python="python3")


def _node(node: str) -> SlurmNodeConn:
    """Node `node` of Slurm job 7, through the login node."""
    return SlurmNodeConn(name=node, login=_login("login.hpc.example.edu"), job="7", node=node,
                         address=f"10.1.0.{node[1:]}", keeper="7", python="python3")


def _planned(spec: JobSpec) -> plan_model.JobPlan:
    """The plan of `spec` once hpc's allocation runs on nodes n1 and n2."""
    hpc = spec.clusters[0]
    nodes = [HostSpec(host=n, address=f"10.1.0.{i}", slots=4) for i, n in
             enumerate(("n1", "n2"), start=1)]
    expanded = spec.model_copy(update={"clusters": [hpc.with_nodes(nodes),
                                                    *spec.clusters[1:]]})
    sites = {key: plan_model.Site(
        conn=_node(h.host) if h.host.startswith("n") else _login(h.host),
        home="/home/u/.nebula", address=h.address or f"{h.host}.example", bind="0.0.0.0",
        python="python3", shares_files=False)
        for key, (c, h) in site_entries(expanded).items()}
    ports = plan_model.Ports(masters={c.name: 29500 for c in spec.clusters},
                          relays={c.name: (29400, 29401) for c in spec.clusters})
    certs = plan_model.Certs(ca=b"CA", relays={c.name: (b"c", b"k") for c in spec.clusters},
                          workers={k: (b"c", b"k") for k in sites})
    return jobplan.build_plan(expanded, "job-1", sites=sites, ports=ports, certs=certs)


def test_relay_on_login_runs_the_relay_on_the_login_node(tmp_path: Path, cli: CLI) -> None:
    text = SLURM + "relay: {}\n"
    on_node = {a.cluster: a for a in _planned(load_spec(write(tmp_path, text))).role("relay")}
    assert on_node["hpc"].host == "n1" and on_node["hpc"].conn.kind == "slurm-node"
    spec = load_spec(write(tmp_path, text.replace("    scheduler: slurm\n",
                                                  "    scheduler: slurm\n    relay_on: login\n")))
    plan = _planned(spec)
    (relay,) = plan.role("relay")
    assert (relay.host, relay.node_rank, relay.conn.kind) == (
        "login.hpc.example.edu", -1, "ssh")
    assert relay.agent_dir == "/home/u/.nebula/jobs/job-1/hpc/login.hpc.example.edu/relay"
    assert [w.host for w in plan.hosts] == ["n1", "n2"]  # the workers stay on the nodes
    for worker in plan.hosts:  # and reach their relay on the login node
        sync = json.loads(worker.files["sync.json"])
        assert sync["relay_addr"] == "login.hpc.example.edu.example:29401"
    out = " ".join(cli("validate", str(write(tmp_path, text.replace(
        "    scheduler: slurm\n", "    scheduler: slurm\n    relay_on: login\n"))),
        check=True).stdout.split())
    assert "hpc: one Slurm job through login.hpc.example.edu: 2 node(s) x 4 rank(s), relay on " \
        "the login node" in out


def test_a_tunnel_to_a_slurm_cluster_ends_at_its_login_node(tmp_path: Path) -> None:
    text = SLURM.replace("    scheduler: slurm\n", "    scheduler: slurm\n    relay_reach: ssh\n") \
        + "  - name: lab\n    hosts: [lab1]\nrelay: {}\n"
    spec = load_spec(write(tmp_path, text))
    assert [str(link) for link in spec.links()] == [
        "lab dials hpc through an SSH tunnel"]
    hpc = spec.clusters[0]
    nodes = [HostSpec(host="n1", address="10.1.0.1", slots=4)]
    expanded = spec.model_copy(update={"clusters": [hpc.with_nodes(nodes), spec.clusters[1]]})
    sites = {key: plan_model.Site(
        conn=_login(h.host), home="/home/u/.nebula",
        address=h.address or f"{h.host}.example", bind="0.0.0.0", python="python3",
        shares_files=False, ssh=plan_model.SshLogin("jdoe", 22, "ssh-ed25519 AAAAlogin"))
        for key, (c, h) in site_entries(expanded).items()}
    ports = plan_model.Ports(masters={"hpc": 29500, "lab": 29500},
                          relays={"hpc": (29400, 29401), "lab": (29400, 29401)})
    certs = plan_model.Certs(ca=b"CA", relays={"hpc": (b"c", b"k"), "lab": (b"c", b"k")},
                          workers={k: (b"c", b"k") for k in sites},
                          tunnel_keys={"lab>hpc": (b"PRIVATE", "ssh-ed25519 AAAApub")})
    plan = jobplan.build_plan(expanded, "job-1", sites=sites, ports=ports, certs=certs)
    relays = {a.cluster: a for a in plan.role("relay")}
    # lab's ssh goes to the login node and forwards to the relay on the allocation's node
    (dial,) = json.loads(relays["lab"].files["tunnels.json"])["dial"]
    assert (dial["host"], dial["target"]) == ("login.hpc.example.edu.example", "10.1.0.1:29400")
    assert relays["hpc"].host == "n1"
    (grant,) = json.loads(relays["hpc"].files["tunnels.json"])["grant"]
    assert grant["targets"] == ["10.1.0.1:29400"]  # the login node may reach only that
    relay = json.loads(relays["hpc"].files["relay.json"])
    assert relay["peer_listen"] == "0.0.0.0:29400"  # the login node reaches it over the network


def test_feature_expressions_reach_the_batch_script_as_one_directive(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, SLURM.replace(
        "account: proj123", 'constraint: "[rack1|rack2]&a100*2"')))
    cluster = spec.clusters[0]
    script = batch.render(template_of(spec, cluster), batch.values(
        slurm_request(cluster), job_name="nebula-j-hpc", output="/r/slurm/hpc-%j.out",
        job_root="/r", pythonpath="/r/lib", python="python3"))
    assert "\n#SBATCH --constraint=[rack1|rack2]&a100*2\n" in script


def test_each_rank_is_a_task_of_its_slurm_step_in_its_environment(tmp_path: Path) -> None:
    """REALWORLD training scripts: a script (or Lightning, submitit) that takes its rank from
    SLURM_PROCID sees nebula's rank, not its node's keeper task."""
    plan = _planned(load_spec(write(tmp_path, SLURM)))
    seen = [(w.host, p.env["RANK"], p.env["SLURM_PROCID"], p.env["LOCAL_RANK"],
             p.env["SLURM_LOCALID"], p.env["SLURM_NTASKS"], p.env["SLURM_NTASKS_PER_NODE"])
            for w in plan.hosts for p in w.config.processes]
    assert seen == [(node, str(rank), str(rank), str(rank % 4), str(rank % 4), "8", "4")
                    for rank, node in enumerate(["n1"] * 4 + ["n2"] * 4)]
    assert plan.hosts[0].config.processes[0].env["SLURM_TASKS_PER_NODE"] == "4(x2)"


@pytest.mark.parametrize("args,want", [
    ([], None),
    (["--exclusive"], None),
    (["--mem=64G"], (64 << 30, "--mem=64G")),
    (["--mem=2048"], (2048 << 20, "--mem=2048")),  # sbatch's unit: MB
    (["--mem=0"], None),  # all of the node's memory: unknown before launch
    (["--mem-per-cpu=2G"], (4 * 8 * (2 << 30), "--mem-per-cpu=2G")),  # 4 tasks x 8 CPUs
    (["--mem-per-cpu=2G", "-c2"], (4 * 2 * (2 << 30), "--mem-per-cpu=2G")),  # sbatch's -c
    (["-c3", "--mem-per-cpu=1G"], (4 * 3 * (1 << 30), "--mem-per-cpu=1G")),
    (["--cpus-per-task=5", "--mem-per-cpu=1G"], (4 * 5 * (1 << 30), "--mem-per-cpu=1G")),
    (["--exclusive", "--mem-per-cpu=2G"], None),  # all of the node's CPUs: unknown
    (["--exclusive=user", "--mem-per-cpu=1G", "-c 2"], (4 * 2 * (1 << 30), "--mem-per-cpu=1G")),
    (["--cpus-per-task 6", "--mem-per-cpu=1G"], (4 * 6 * (1 << 30), "--mem-per-cpu=1G")),
    (["--mem-per-gpu=10G"], (4 * (10 << 30), "--mem-per-gpu=10G")),
    (["--mem=8G", "--mem-bind=local", "--mem=16G"], (16 << 30, "--mem=16G")),  # the last
])
def test_the_memory_a_slurm_node_grants_is_read_from_sbatch_args(
        tmp_path: Path, args: list[str], want: tuple[int, str] | None) -> None:
    spec = load_spec(write(tmp_path, SLURM.replace('["--exclusive"]', json.dumps(args))))
    cluster = spec.clusters[0]
    assert cluster.scheduling.node_memory(cluster) == want
