"""The optional metrics sinks: TensorBoard event files and Weights & Biases runs.

`open_sinks(path)` reads the process's part of the plan (`metrics.json`, a `MetricsConfig`:
only the first rank of each cluster has one) and opens what it asks for. Each sink gets every
record the process emits and keeps its numbers (``scalars``: finite ints and floats, not the
record's tags) at the record's step and wall time: one TensorBoard run, and one W&B run, per
cluster.

Neither may stop training: a sink whose library is missing says so once in the worker's log
and which extra installs it (`pip install 'nebula-cli[tb]'`, `[wandb]`); a sink that fails
later is named once and dropped. Both libraries are imported only here, only when asked for.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from nebula_cli.config.parts import MetricsConfig, WandbSettings
from nebula_cli.runtime.metrics import RESERVED_KEYS, Sink

TB_EXTRA = "pip install 'nebula-cli[tb]'"
WANDB_EXTRA = "pip install 'nebula-cli[wandb]'"


def say(message: str) -> None:
    """One line in the worker's log, marked as nebula's."""
    print(f"nebula: {message}", file=sys.stderr, flush=True)


def scalars(rec: Mapping[str, Any]) -> dict[str, float]:
    """The record's numbers worth plotting: finite ints and floats (not bools), tags left out."""
    return {k: float(v) for k, v in rec.items()
            if k not in RESERVED_KEYS and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardSink:
    """One event file per process in the cluster's run directory (a restarted worker adds a
    file; TensorBoard reads them all), one event per record, flushed at once. Written with
    tensorboard's own event writer and protobufs (what torch's SummaryWriter writes with; no
    torch import: a script that only logs stays light)."""

    def __init__(self, directory: str) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self.writer: Any = EventFileWriter(directory)

    def write(self, rec: Mapping[str, Any]) -> None:
        values = scalars(rec)
        if not values:
            return
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v)
                                       for k, v in values.items()])
        self.writer.add_event(self._event(wall_time=float(rec["ts"]), step=int(rec["step"]),
                                          summary=summary))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """The cluster's W&B run: named after the cluster, grouped by the job id; the record's
    step is W&B's step. A restarted worker starts a new run of the same name in the group.
    Offline, W&B's error reports are off too (unless $WANDB_ERROR_REPORTING says otherwise)."""

    def __init__(self, settings: WandbSettings, config: Mapping[str, Any]) -> None:
        import wandb

        if settings.mode == "offline":  # nothing leaves the host: no error reports either
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")

        self.run: Any = wandb.init(
            project=settings.project, entity=settings.entity, name=settings.name,
            group=settings.group, mode=settings.mode, dir=settings.dir, config=dict(config),
            settings=wandb.Settings(console="off"))  # the worker's log is already kept
        self.step = -1

    def write(self, rec: Mapping[str, Any]) -> None:
        values = scalars(rec)
        step = int(rec["step"])
        if not values or step < self.step:  # W&B's steps only go forward
            return
        self.step = step
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Guarded:
    """A sink whose failure is said once and ends it, never the training."""

    def __init__(self, name: str, sink: Sink) -> None:
        self.name = name
        self.sink: Sink | None = sink

    def write(self, rec: Mapping[str, Any]) -> None:
        self._call(lambda s: s.write(rec), "writing")

    def close(self) -> None:
        self._call(lambda s: s.close(), "closing")
        self.sink = None

    def _call(self, what: Callable[[Sink], None], doing: str) -> None:
        if self.sink is None:
            return
        try:
            what(self.sink)
        except Exception as exc:  # a sink never stops training
            self.sink = None
            say(f"metrics: {self.name} failed {doing} ({exc!r}); no more records go there")


def _open(name: str, extra: str, make: Callable[[], Sink]) -> Sink | None:
    try:
        return Guarded(name, make())
    except ImportError as exc:
        missing = exc.name or str(exc)
        say(f"metrics: the spec asks for {name}, but {missing} is not installed on this host "
            f"({extra} in the workers' environment); training goes on without it")
    except Exception as exc:  # a sink never stops training
        say(f"metrics: {name} cannot start ({exc!r}); training goes on without it")
    return None


def open_sinks(path: str) -> list[Sink]:
    """The sinks `metrics.json` at `path` asks for, each opened (or said why not) once."""
    try:
        config = MetricsConfig.load(path)
    except Exception as exc:  # a sink never stops training
        say(f"metrics: cannot read the metrics sinks' settings: {exc}")
        return []
    opened: list[Sink | None] = []
    if config.tensorboard_dir is not None:
        directory = config.tensorboard_dir
        opened.append(_open("TensorBoard", TB_EXTRA, lambda: TensorBoardSink(directory)))
    if config.wandb is not None:
        settings = config.wandb
        about = {"nebula_job": config.job_id, "nebula_cluster": config.cluster}
        opened.append(_open("W&B", WANDB_EXTRA, lambda: WandbSink(settings, about)))
    return [s for s in opened if s is not None]
