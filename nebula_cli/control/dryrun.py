"""`nebula plan SPEC` without --step-time or --params: run the job briefly and measure.

The dry run launches the job's own script on its first cluster alone (all of that cluster's
hosts and slots, no relay, $NEBULA_DRY_RUN=1), follows its metrics until rank 0 has logged
``min_steps`` steps past the first, and stops it, leaving nothing running. It reads:

- the time of one inner step: between two metric records of rank 0, (ts_b - ts_a) /
  (step_b - step_a), from the first record (logged once step 1, with its start-up costs, is
  done) to the first one at least ``min_steps`` later;
- the trainable parameters: ``OuterSync`` logs ``trainable_params`` in a dry run (a script
  that wraps its engine in ``OuterSync`` when ``nebula_cli.runtime.sync.wanted()``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nebula_cli.config.spec import JobSpec
from nebula_cli.control.follow import finite
from nebula_cli.control.orchestrator import Orchestrator
from nebula_cli.errors import NebulaError
from nebula_cli.runtime.metrics import DRY_RUN_ENV

DEFAULT_MIN_STEPS = 10
DEFAULT_TIMEOUT = 600.0


class DryRunError(NebulaError):
    """The dry run could not measure what the advisor needs."""


@dataclass(frozen=True)
class DryRun:
    """What one dry run measured."""

    job_id: str
    cluster: str
    step_time_s: float
    steps: tuple[int, int]
    """The two steps the time is measured between."""
    params: int | None
    """Trainable parameters, when the script uses OuterSync (else None)."""


def dry_run_spec(spec: JobSpec) -> JobSpec:
    """The job reduced to its first cluster, without relay or pipeline, marked as a dry run."""
    first = spec.clusters[0]
    name = f"{spec.name[:24]}-dryrun"
    data = spec.model_dump()
    data.update(name=name, clusters=[first.model_dump()], relay=None, parallelism=None,
                placement=None, max_restarts=0, env={**spec.env, DRY_RUN_ENV: "1"})
    derived = JobSpec.model_validate(data, context={"base_dir": spec.workdir})
    derived._source = spec.source
    return derived


def step_time(records: list[dict[str, Any]], min_steps: int) -> tuple[float, int, int] | None:
    """(seconds per step, step a, step b) from rank 0's records, or None while too few."""
    timed = [r for r in records if r.get("rank") in (0, None) and isinstance(r.get("step"), int)
             and r["step"] >= 1 and finite(r.get("ts")) and not r.get("final")
             and not r.get("dry_run")]
    if not timed:
        return None
    first = min(timed, key=lambda r: (r["step"], r["ts"]))
    later = [r for r in timed if r["step"] >= first["step"] + min_steps]
    if not later:
        return None
    last = min(later, key=lambda r: r["step"])
    seconds = (last["ts"] - first["ts"]) / (last["step"] - first["step"])
    return seconds, first["step"], last["step"]


def measure(orch: Orchestrator, spec: JobSpec, *, min_steps: int = DEFAULT_MIN_STEPS,
            timeout: float = DEFAULT_TIMEOUT,
            progress: Callable[[str], None] = lambda message: None) -> DryRun:
    """Launch the dry run, wait for the figures, stop it (also on failure or Ctrl-C)."""
    derived = dry_run_spec(spec)
    cluster = derived.clusters[0].name
    progress(f"dry run: the job's script on cluster {cluster} alone, until {min_steps} steps "
             "are timed")
    job = orch.launch(derived, progress)
    try:
        follower = orch.jobs.follow_metrics(job.id)
        deadline = time.monotonic() + timeout
        params: int | None = None
        while True:
            follower.poll()
            history = follower.history.get(cluster, [])
            params = next((int(r["trainable_params"]) for r in history
                           if isinstance(r.get("trainable_params"), int)), params)
            found = step_time(history, min_steps)
            if found is not None:
                seconds, a, b = found
                progress(f"dry run: {seconds:.3f} s per step (steps {a}..{b})"
                         + (f", {params:,} trainable parameters" if params else ""))
                return DryRun(job.id, cluster, seconds, (a, b), params)
            if follower.finals or (orch.jobs.refresh(job.id).job.state
                                   not in ("STARTING", "RUNNING")):
                raise DryRunError(
                    f"the dry run ({job.id}) ended before {min_steps} steps were timed; "
                    f"see `nebula logs {job.id}`, or give --step-time (and --params)")
            if time.monotonic() > deadline:
                raise DryRunError(f"the dry run ({job.id}) timed no {min_steps} steps within "
                                  f"{timeout:.0f} s; give --step-time (and --params)")
            time.sleep(1.0)
    finally:
        orch.jobs.stop(job.id, grace=5.0)
