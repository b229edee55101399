"""examples/gpt: the small GPT, the bundled corpus and its split, and a real DeepSpeed run."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml
from helpers.checkpoint_jobs import kill_rank, wait_ended
from helpers.jobs import CLI, REPO, job_processes, wait_for, wait_in_job
from helpers.quickstart import TINY_GPT, metric_records
from helpers.sshd_bed import free_port

from nebula_cli.agent.leftovers import remove_shm_buffers

GPT_DIR = REPO / "examples" / "gpt"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpt_model = _load("nebula_example_gpt_model", GPT_DIR / "model.py")
gpt_data = _load("nebula_example_gpt_data", GPT_DIR / "data.py")
make_corpus = _load("nebula_example_make_corpus", GPT_DIR / "data" / "make_corpus.py")
gpt_optim = _load("nebula_example_gpt_optim", GPT_DIR / "optim.py")


def test_default_model_size_and_shapes() -> None:
    torch.manual_seed(0)
    model = gpt_model.GPT()
    n = model.num_params()
    assert 1_000_000 <= n <= 3_000_000, n
    x, y = torch.randint(0, 256, (2, 2, 16))
    logits, loss = model(x, y)
    assert logits.shape == (2, 16, 256)
    assert abs(loss.item() - math.log(256)) < 0.3  # untrained: close to uniform over bytes
    assert model(x)[1] is None


def test_same_seed_same_weights_and_attention_is_causal() -> None:
    cfg = gpt_model.GPTConfig(d_model=64, n_layer=2, n_head=4, block_size=32)
    torch.manual_seed(5)
    a = gpt_model.GPT(cfg)
    torch.manual_seed(5)
    b = gpt_model.GPT(cfg)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    x = torch.randint(0, 256, (1, 32))
    y = x.clone()
    y[0, 20:] = (y[0, 20:] + 1) % 256  # change only the future
    with torch.no_grad():
        la, _ = a(x)
        lb, _ = a(y)
    assert torch.allclose(la[0, :20], lb[0, :20], atol=1e-6)
    assert not torch.allclose(la[0, 20:], lb[0, 20:])
    with pytest.raises(ValueError, match="block_size"):
        a(torch.zeros(1, 33, dtype=torch.long))


def test_corpus_is_real_ascii_text_of_the_right_size() -> None:
    data = gpt_data.load_corpus()
    assert 300_000 <= len(data) <= 500_000
    assert max(data) < 128
    text = data.decode("ascii")
    assert text.startswith("# ===== Lib/textwrap.py =====")
    assert "def " in text and '"""' in text
    notice = (GPT_DIR / "data" / "NOTICE.md").read_text()
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in notice
    assert hashlib.sha256(data).hexdigest() in notice


def test_make_corpus_reproduces_the_bundled_file() -> None:
    notice = (GPT_DIR / "data" / "NOTICE.md").read_text()
    version = ".".join(map(str, sys.version_info[:3]))
    if f"CPython {version}:" not in notice:
        pytest.skip(f"corpus was cut from another Python than {version}")
    text, used = make_corpus.build(Path(sysconfig.get_paths()["stdlib"]))
    assert text.encode("ascii") == gpt_data.load_corpus()
    assert used[0] == "textwrap.py" and len(used) <= len(make_corpus.SOURCES)


def test_split_is_deterministic_disjoint_and_95_5() -> None:
    data = gpt_data.load_corpus()
    a = gpt_data.split_corpus(data)
    b = gpt_data.split_corpus(data)
    assert torch.equal(a.train, b.train) and torch.equal(a.eval, b.eval)
    assert len(a.train) + len(a.eval) == len(data)
    assert 0.04 <= len(a.eval) / len(data) <= 0.06
    # Put the blocks back together: the two sides partition the corpus exactly.
    block, every = gpt_data.BLOCK_BYTES, gpt_data.EVAL_EVERY
    train, held = bytes(a.train.tolist()), bytes(a.eval.tolist())
    rebuilt, ti, ei = [], 0, 0
    for i in range(0, len(data), block):
        n = len(data[i : i + block])
        if (i // block) % every == every - 1:
            rebuilt.append(held[ei : ei + n])
            ei += n
        else:
            rebuilt.append(train[ti : ti + n])
            ti += n
    assert b"".join(rebuilt) == data and ti == len(train) and ei == len(held)


def test_sampler_seeded_per_seed_cluster_rank() -> None:
    split = gpt_data.split_corpus(gpt_data.load_corpus())

    def first(seed: int, rank: int, cluster: int = 0) -> torch.Tensor:
        s = gpt_data.BatchSampler(split.train, 4, 64, seed=seed, rank=rank, cluster=cluster)
        x, y = s.next()
        assert x.shape == y.shape == (4, 64)
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one byte
        return x

    assert torch.equal(first(1, 0), first(1, 0))
    assert not torch.equal(first(1, 0), first(1, 1))
    assert not torch.equal(first(1, 0), first(1, 0, cluster=1))
    assert not torch.equal(first(1, 0), first(2, 0))


def test_eval_batches_fixed_and_evaluate() -> None:
    split = gpt_data.split_corpus(gpt_data.load_corpus())
    a = gpt_data.eval_batches(split.eval, 3, 4, 32, seed=7)
    b = gpt_data.eval_batches(split.eval, 3, 4, 32, seed=7)
    assert len(a) == 3
    for (x1, y1), (x2, y2) in zip(a, b, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    torch.manual_seed(0)
    model = gpt_model.GPT(gpt_model.GPTConfig(d_model=32, n_layer=1, n_head=2, block_size=32))
    model.train()
    loss = gpt_data.evaluate(model, a)
    assert math.isfinite(loss) and abs(loss - math.log(256)) < 0.5
    assert model.training  # restored
    assert math.isnan(gpt_data.evaluate(model, []))


# --- Muon with AdamW (optim.py) ----------------------------------------------------------------


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest_in_one_optimizer() -> None:
    """The blocks' 2-D weights go to torch's Muon, embeddings, head, norms and biases to AdamW;
    stepping the one optimizer is stepping both parts alone, a scheduler's lr reaches both, and
    its state round-trips (DeepSpeed's checkpoint saves it)."""
    torch.manual_seed(0)
    model = gpt_model.GPT(gpt_model.GPTConfig(block_size=16, n_layer=2, d_model=32, n_head=2))
    matrices, rest = gpt_optim.muon_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim == 2 and names[id(p)].startswith("blocks.") for p in matrices)
    assert {names[id(p)] for p in rest} >= {"tok_emb.weight", "pos_emb.weight", "ln_f.weight"}
    assert len(matrices) == 2 * 4 and not any(p.ndim == 2 and names[id(p)].startswith("blocks.")
                                               for p in rest)
    twin = gpt_model.GPT(gpt_model.GPTConfig(block_size=16, n_layer=2, d_model=32, n_head=2))
    twin.load_state_dict(model.state_dict())
    settings = {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
    opt = gpt_optim.muon_adamw(model, settings)
    t_mat, t_rest = gpt_optim.muon_parameters(twin)
    alone = [torch.optim.Muon(t_mat, lr=1e-3, weight_decay=0.01, momentum=0.95,
                              adjust_lr_fn="match_rms_adamw"),
             torch.optim.AdamW(t_rest, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)]
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(4):
        for m, steppers in ((model, [opt]), (twin, alone)):
            _, loss = m(x, x)
            for o in steppers:
                o.zero_grad()
            loss.backward()
            for o in steppers:
                for group in o.param_groups:
                    group["lr"] = 1e-3  # as a scheduler sets it
                o.step()
            if m is model:
                losses.append(loss.item())
    assert {g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups} == {1e-3}
    for (_, a), (_, b) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(a, b)
    assert losses[-1] < losses[0]
    again = gpt_optim.muon_adamw(twin, settings)
    again.load_state_dict(opt.state_dict())
    assert set(opt.state_dict()) == {"muon", "adamw"}
    assert len(again.muon.state) == len(matrices) and len(again.adamw.state) == len(rest)


def test_muon_is_refused_under_zero_with_the_reason(tmp_path: Path) -> None:
    train = _load("nebula_example_gpt_train", GPT_DIR / "train.py")
    config = json.loads((GPT_DIR / "ds_config.json").read_text())
    config["zero_optimization"] = {"stage": 1}
    path = tmp_path / "zero1.json"
    path.write_text(json.dumps(config))
    model = gpt_model.GPT(gpt_model.GPTConfig(block_size=16, n_layer=1, d_model=32, n_head=2))
    args = train.parse_args(["--optimizer", "muon", "--ds-config", str(path)])
    with pytest.raises(SystemExit, match="needs ZeRO stage 0 \\(the config has 1\\)"):
        train.optimizer_args(args, model)
    plain = train.optimizer_args(train.parse_args(["--ds-config", str(path)]), model)
    assert "optimizer" not in plain and plain["config"]["optimizer"]["type"] == "AdamW"
    args = train.parse_args(["--optimizer", "muon"])
    muon = train.optimizer_args(args, model)
    assert type(muon["optimizer"]).__name__ == "MuonAdamW"  # (train.py's own import of it)
    assert "optimizer" not in muon["config"]  # DeepSpeed takes one
    assert muon["optimizer"].adamw.defaults["lr"] == 0.002
    assert muon["optimizer"].adamw.defaults["betas"] == (0.9, 0.95)  # the config's, not ours
    config["zero_optimization"] = {"stage": 0}
    config["optimizer"] = {"type": "Lamb", "params": {"lr": 0.01}}
    path.write_text(json.dumps(config))
    args = train.parse_args(["--optimizer", "muon", "--ds-config", str(path)])
    with pytest.raises(SystemExit, match="takes the AdamW settings .* the config has"):
        train.optimizer_args(args, model)


# --- a real 2-rank DeepSpeed run -------------------------------------------------------------


def _start_ranks(tmp_path: Path, *args: str) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NEBULA_", "OMP_"))}
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_SIZE="2",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            NEBULA_CLUSTER="local", NEBULA_HOST="h0",
            NEBULA_METRICS_FILE=str(tmp_path / f"metrics-{rank}.jsonl"),
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        )  # fmt: skip
        log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(
                [sys.executable, "-u", "train.py", *args],
                cwd=GPT_DIR,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        log.close()
    _PORTS[procs[0].pid] = port
    return procs


_PORTS: dict[int, int] = {}  # first rank's pid -> its world's MASTER_PORT


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """End the ranks, then what DeepSpeed's CPU comm op left in /dev/shm for their world."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(timeout=30)
    port = _PORTS.pop(procs[0].pid, None)
    if port is not None:
        remove_shm_buffers({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def _wait(procs: list[subprocess.Popen[bytes]], tmp_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2))
    assert [p.returncode for p in procs] == [0, 0], logs


def _records(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "metrics-0.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_rank_deepspeed_run_loss_falls(tmp_path: Path) -> None:
    procs = _start_ranks(tmp_path, "--steps", "20", "--log-every", "5", "--eval-every", "10",
                         *TINY_GPT.split())
    try:
        _wait(procs, tmp_path, timeout=500)  # includes a first-time JIT build (~80 s)
    finally:
        _stop(procs)
    recs = _records(tmp_path)
    # rank 1 logs only its final record: the checksum of its parameters, equal to rank 0's
    (other,) = [json.loads(x) for x in (tmp_path / "metrics-1.jsonl").read_text().splitlines()]
    assert other["final"] is True and other["rank"] == 1
    assert other["param_sha256"] == recs[-1]["param_sha256"]
    losses = [r["loss"] for r in recs if "loss" in r]
    assert [r["step"] for r in recs if "loss" in r] == [1, 5, 10, 15, 20]
    assert losses[0] > 4.5 and losses[-1] < losses[0] - 0.8, losses
    assert all(r["cluster"] == "local" and r["host"] == "h0" and r["rank"] == 0 for r in recs)
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 for r in recs if "loss" in r and r["step"] > 1)
    final = recs[-1]
    assert final["final"] is True and final["step"] == 20
    assert math.isfinite(final["eval_loss"]) and final["eval_loss"] < losses[0]
    assert len(final["param_sha256"]) == 64
    out = (tmp_path / "rank0.log").read_text()
    assert "[nebula-metrics] " in out and "gpt: final step=20" in out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_rank_deepspeed_run_with_muon(tmp_path: Path) -> None:
    """--optimizer muon in a real DeepSpeed world: the loss falls, both ranks end identical."""
    procs = _start_ranks(tmp_path, "--steps", "20", "--log-every", "5", "--eval-every", "20",
                         "--optimizer", "muon", *TINY_GPT.split())
    try:
        _wait(procs, tmp_path, timeout=500)
    finally:
        _stop(procs)
    recs = _records(tmp_path)
    (other,) = [json.loads(x) for x in (tmp_path / "metrics-1.jsonl").read_text().splitlines()]
    assert other["param_sha256"] == recs[-1]["param_sha256"]
    losses = [r["loss"] for r in recs if "loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_finishes_the_step_and_exits_zero(tmp_path: Path) -> None:
    procs = _start_ranks(tmp_path, "--steps", "100000", "--log-every", "2")
    try:
        metrics = tmp_path / "metrics-0.jsonl"
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline:
            if metrics.exists() and '"step":4,' in metrics.read_text():
                break
            assert all(p.poll() is None for p in procs), "a rank exited early"
            time.sleep(0.5)
        else:
            pytest.fail("no metrics within the deadline")
        for p in procs:
            p.send_signal(signal.SIGTERM)
        _wait(procs, tmp_path, timeout=120)
    finally:
        _stop(procs)
    final = _records(tmp_path)[-1]
    assert final["final"] is True and 4 <= final["step"] < 100000
    assert math.isfinite(final["eval_loss"]) and len(final["param_sha256"]) == 64
    assert "SIGTERM" in (tmp_path / "rank0.log").read_text()


# --- a worker killed after its last checkpoint, before its end -------------------------------


def launch_unshaped(cli: CLI, tmp_path: Path, spec: dict) -> str:
    """Launch ``spec`` detached, its relays' own link shaping off; the job's id."""
    spec["relay"].pop("shaping", None)
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return cli("launch", str(path), "--detach", check=True).stdout.strip()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_worker_killed_after_its_last_checkpoint_resumes_there_and_ends(
        cli: CLI, tmp_path: Path) -> None:
    """East checkpoints at its last step (20), then waits in the job's final round for west
    (20x slower); SIGKILLed there, its agent restarts it, it resumes at step 20 with no step
    left and must still take its part in the final round. Found by bench/soak.py: the example
    died at once (`stopping` never set), and every restart did the same."""
    spec = yaml.safe_load((REPO / "templates" / "quickstart.yaml").read_text())
    spec.update(name="lastckpt", workdir=str(GPT_DIR), max_restarts=1,
                run=f"python -u train.py --steps 20 --eval-every 20 --log-every 5 {TINY_GPT}",
                checkpoint={"every": 10, "keep": 2})
    spec["clusters"] = [
        {"name": "east", "transport": "local", "hosts": [{"host": "e1"}]},
        {"name": "west", "transport": "local", "hosts": [{"host": "w1"}],
         "env": {"GPT_SLOWDOWN": "20"}}]
    spec["relay"]["sync"]["inner_steps"] = 15  # a round at 15, the last one after step 20
    job_id = launch_unshaped(cli, tmp_path, spec)
    try:
        def east_waits() -> bool:
            recs = metric_records(cli.home, job_id)
            saved = any(r.get("cluster") == "east" and r.get("checkpoint_step") == 20
                        and not r.get("checkpoint_error") for r in recs)
            west_at = max((r["step"] for r in recs if r.get("cluster") == "west"), default=0)
            ended = any(r.get("final") for r in recs)
            return saved and west_at < 20 and not ended

        wait_for(east_waits, timeout=300, every=0.2)
        kill_rank(job_id, "east", "0")
        st = wait_ended(cli, job_id, timeout=300)
    finally:
        cli("stop", job_id, "--force")
    assert st["state"] == "SUCCEEDED", st
    (east,) = [h for h in st["hosts"] if h["role"] == "worker" and h["cluster"] == "east"]
    assert east["restarts"] == 1
    recs = metric_records(cli.home, job_id)
    assert [r["resumed_from_step"] for r in recs if r.get("cluster") == "east"
            and "resumed_from_step" in r and not r.get("final")] == [20]
    finals = [r for r in recs if r.get("final")]
    assert sorted(r["cluster"] for r in finals) == ["east", "west"]
    assert all(r["step"] == 20 for r in finals)
    assert len({r["param_sha256"] for r in finals}) == 1, finals  # the final round was had
    assert job_processes(job_id) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stop_while_a_cluster_waits_at_its_end_keeps_its_final_checkpoint(
        cli: CLI, tmp_path: Path) -> None:
    """East (two ranks) ends after 20 steps, long before west (60 steps, 40x slower), and
    waits for west to finish, to end on the state of the cluster that finished last. West's
    relay then hangs (SIGSTOP), so that nothing but the stop can end east's wait (a west that
    ended would end it). `nebula stop`: east's ranks leave the wait within a beat, write the
    final checkpoint (step 20: the last periodic one was at 15) and their final records
    before the grace. Before, rank 0 stayed blocked in its relay and the kill after
    the grace lost both."""
    spec = yaml.safe_load((REPO / "templates" / "quickstart.yaml").read_text())
    spec.update(name="stopwait", workdir=str(GPT_DIR), grace=30,
                run=f"python -u train.py --eval-every 10 --log-every 5 {TINY_GPT}",
                checkpoint={"every": 15, "keep": 2})
    spec["clusters"] = [
        {"name": "east", "transport": "local", "hosts": [{"host": "e1"}, {"host": "e2"}],
         "env": {"NEBULA_STEPS": "20"}},
        {"name": "west", "transport": "local", "hosts": [{"host": "w1"}],
         "env": {"NEBULA_STEPS": "60", "GPT_SLOWDOWN": "40"}}]
    spec["relay"]["sync"]["inner_steps"] = 10
    job_id = launch_unshaped(cli, tmp_path, spec)
    try:
        def east_waits() -> bool:
            recs = metric_records(cli.home, job_id)
            east_at = max((r["step"] for r in recs if r.get("cluster") == "east"), default=0)
            west_at = max((r["step"] for r in recs if r.get("cluster") == "west"), default=0)
            return east_at == 20 and 20 < west_at < 45 and not any(r.get("final") for r in recs)

        wait_in_job(cli, job_id, east_waits, 400, "east waiting at its end for west", every=0.2)
        st = json.loads(cli("status", job_id, "--json", check=True).stdout)
        (relay,) = [h for h in st["hosts"] if h["role"] == "relay" and h["cluster"] == "west"]
        os.kill(relay["pid"], signal.SIGSTOP)
        time.sleep(2.0)
        cli("stop", job_id, check=True)
    finally:
        cli("stop", job_id, "--force")
    recs = metric_records(cli.home, job_id)
    east = [r for r in recs if r.get("cluster") == "east"]
    assert sorted(r["rank"] for r in east if r.get("final")) == [0, 1]
    assert all(r["step"] == 20 for r in east if r.get("final"))
    assert any(r.get("checkpoint_step") == 20 and not r.get("checkpoint_error") for r in east)
    assert not any(r.get("final_state_round") for r in east)  # it kept its own parameters
    st = json.loads(cli("status", job_id, "--json", check=True).stdout)
    assert st["state"] == "STOPPED" and job_processes(job_id) == []
