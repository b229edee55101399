"""bench/scale.py's jobs: examples/gpt widened to a model size, trained by two local clusters
(`nebula launch`, the local transport, every process on this machine and on loopback) through
the relays (a codec, the relays' own WAN emulation: a rate and a one-way delay) or without
`relay:` (the ranks' baseline); sampled while it runs (bench/_scale_sampler.py); what its
records say of each outer round once it has ended."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from _local import GPT_DIR, Cli, records
from _scale_sampler import ProcessPeak, Sampler


@dataclass(frozen=True)
class Model:
    """A GPT shape of examples/gpt/train.py (its --d-model, --n-layer, --n-head)."""

    label: str
    d_model: int
    n_layer: int
    n_head: int

    def args(self) -> str:
        return f"--d-model {self.d_model} --n-layer {self.n_layer} --n-head {self.n_head}"


@dataclass(frozen=True)
class Link:
    """The relays' WAN emulation (relay.shaping): rate each way and one-way delay."""

    label: str
    rate_mbit: float
    delay_ms: float

    @property
    def rtt_ms(self) -> float:
        return 2 * self.delay_ms


@dataclass(frozen=True)
class JobSpec:
    """One job of the bench: `codec` None is the job without `relay:`."""

    model: Model
    ranks: int
    steps: int
    inner_steps: int
    codec: str | None
    link: Link | None
    seed: int
    micro_batch: int

    @property
    def name(self) -> str:
        what = f"{self.codec}-{self.link.label}" if self.codec and self.link else "norelay"
        return f"scale-{self.model.label}-{what}".replace(".", "p").lower()


@dataclass(frozen=True)
class RoundTimes:
    """One outer round as the clusters' rank 0 logged it."""

    round: int
    seconds: float
    """From the last cluster's contribution (the latest start of the round on any rank 0) to
    the average applied on every cluster's rank 0 (the latest end)."""
    relay_s: float
    """The relays' own part (the largest of the clusters' relay_s)."""
    wan_bytes: int
    """The busiest relay's bytes of the round (the larger of sent and received)."""


@dataclass
class JobRun:
    """A job run to its end."""

    spec: JobSpec
    job_id: str
    state: str
    wall_s: float
    params: int
    peaks: dict[tuple[str, str, int | None], ProcessPeak]
    rounds: list[RoundTimes] = field(default_factory=list)
    finals: list[dict[str, Any]] = field(default_factory=list)
    samples: int = 0

    @property
    def identical(self) -> bool:
        """Every rank of every cluster ended with the same parameters."""
        want = 2 * self.spec.ranks
        return len(self.finals) == want and len({r["param_sha256"] for r in self.finals}) == 1

    @property
    def tokens_per_s(self) -> float | None:
        """Rank 0's tokens per second over its loop (summed over clusters)."""
        per = [r for r in self.finals if r.get("rank") == 0 and r.get("s_per_step")]
        if not per:
            return None
        tokens = self.spec.micro_batch * 128 * self.spec.ranks  # train.py's context 128
        return sum(tokens / r["s_per_step"] for r in per)


def write_spec(tmp: Path, job: JobSpec) -> Path:
    """The job's YAML (and its DeepSpeed config) under `tmp`; its path."""
    ds = json.loads((GPT_DIR / "ds_config.json").read_text())
    ds["train_micro_batch_size_per_gpu"] = job.micro_batch
    ds_path = tmp / f"{job.name}-ds.json"
    ds_path.write_text(json.dumps(ds))
    spec: dict[str, Any] = {
        "name": job.name, "workdir": str(GPT_DIR), "deepspeed": str(ds_path),
        "run": f"python -u train.py --steps {job.steps} --eval-every 1000000 --log-every 1 "
               f"--seed {job.seed} {job.model.args()}",
        "env": {"OMP_NUM_THREADS": "1"},
        "clusters": [{"name": c, "transport": "local",
                      "hosts": [{"host": f"{c[0]}{i + 1}"} for i in range(job.ranks)]}
                     for c in ("east", "west")]}
    if job.codec is not None:
        assert job.link is not None
        spec["relay"] = {"sync": {"mode": "diloco", "inner_steps": job.inner_steps,
                                  "outer_lr": 0.7, "outer_momentum": 0.9},
                         "compression": {"codec": job.codec, "error_feedback": True},
                         "timeout": 600,
                         "shaping": {"rate_mbit": job.link.rate_mbit,
                                     "delay_ms": job.link.delay_ms}}
    path = tmp / f"{job.name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def round_times(worker_records: list[dict[str, Any]],
                relay_records: list[dict[str, Any]]) -> list[RoundTimes]:
    """Each round every cluster's rank 0 applied: its time (RoundTimes.seconds: a record's
    `ts` is taken right after the round's step, its `round_s` is the rank's wait for the round
    from its contribution to the average applied), the relays' part and the busiest relay's
    bytes."""
    ends: dict[int, list[tuple[float, float, float]]] = {}
    for r in worker_records:
        if r.get("rank") == 0 and r.get("applied") and "outer_round" in r:
            ends.setdefault(int(r["outer_round"]), []).append(
                (float(r["ts"]), float(r["round_s"]), float(r.get("relay_s") or 0.0)))
    wan: dict[int, int] = {}
    for r in relay_records:
        if "round" in r and "bytes_sent" in r:
            n = int(r["round"])
            wan[n] = max(wan.get(n, 0), int(r["bytes_sent"]), int(r.get("bytes_received", 0)))
    out = []
    for n in sorted(ends):
        each = ends[n]
        if len(each) < 2:
            continue
        start = max(ts - s for ts, s, _ in each)
        out.append(RoundTimes(n, max(ts for ts, _, _ in each) - start,
                              max(r for _, _, r in each), wan.get(n, 0)))
    return out


def run(cli: Cli, tmp: Path, job: JobSpec, timeout: float) -> JobRun:
    """Launch `job`, sample it to its end, stop it (also on failure) and read its records."""
    spec = write_spec(tmp, job)
    t0 = time.monotonic()
    out = cli("launch", str(spec), "--detach", timeout=600)
    lines = out.stdout.strip().splitlines()
    if out.returncode or not lines:
        raise RuntimeError(f"{job.name}: launch failed: {out.stderr[-2000:]}")
    job_id = lines[-1].strip()
    sampler = Sampler(job_id, cli.home / "jobs" / job_id, job.inner_steps)
    sampler.start()
    state = "?"
    try:
        while time.monotonic() - t0 < timeout:
            state = cli.status(job_id).get("state") or "?"
            if state not in ("PENDING", "RUNNING", "?"):
                break
            time.sleep(2.0)
        else:
            state = f"TIMEOUT after {timeout:.0f} s"
    finally:
        sampler.stop()
        cli("stop", job_id, "--force", timeout=300)
    workers = records(cli.home, job_id)
    finals = [r for r in workers if r.get("final")]
    params = _params(cli.home / "jobs" / job_id)
    return JobRun(spec=job, job_id=job_id, state=state, wall_s=time.monotonic() - t0,
                  params=params, peaks=sampler.peaks(),
                  rounds=round_times(workers, records(cli.home, job_id, "relay")),
                  finals=finals, samples=sampler.samples)


def _params(job_dir: Path) -> int:
    """The parameter count rank 0 printed ("gpt: N parameters, ...")."""
    for log in sorted(job_dir.glob("*/*/worker/logs/rank0.log")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("gpt: ") and " parameters" in line:
                return int(line.split()[1].replace(",", ""))
    return 0
