"""Pipeline parallelism across the clusters: which global rank every device gets.

A job with ``parallelism: {pipeline_stages: K}`` is one DeepSpeed world over every slot of every
host of every cluster (N devices, N = K x D). DeepSpeed's ``PipeDataParallelTopology`` (axes
``pipe``, ``data``) gives rank ``j * D + r`` to stage j of replica r, so placing stage j of
replica r on a device means giving that device this rank.

A placement is what ``nebula plan placement --json`` prints: ``{"stages": [[device ids of stage
0, one per replica], ...]}``, in pipeline order and replica-aligned (``stages[j][r]`` sends its
activations to ``stages[j + 1][r]``). Without one, devices take ranks in the spec's order
(cluster, host, slot): each stage is a run of consecutive devices.

Pure data, no I/O except :func:`read_placement`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula_cli.config import specfile

DeviceId = str


class PlacementError(ValueError):
    """A placement that does not fit the job's devices or stages (message says how)."""


def device_id(cluster: str, host: str, slot: int) -> DeviceId:
    """The name of one slot of one host: ``<cluster>/<host>/<slot>`` (as the planner names it)."""
    return f"{cluster}/{host}/{slot}"


@dataclass(frozen=True)
class PipelineLayout:
    """Where every rank of the pipelined world is: ``stages[j][r]`` holds stage j of replica r."""

    stages: list[list[DeviceId]]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def replicas(self) -> int:
        return len(self.stages[0])

    @property
    def world_size(self) -> int:
        return self.num_stages * self.replicas

    def rank_of(self, device: DeviceId) -> int:
        """The global rank DeepSpeed's pipe/data topology maps to (stage, replica) of `device`."""
        stage, replica = self.position(device)
        return stage * self.replicas + replica

    def position(self, device: DeviceId) -> tuple[int, int]:
        """(stage, replica) of `device`."""
        for j, row in enumerate(self.stages):
            if device in row:
                return j, row.index(device)
        raise KeyError(device)

    def ranks(self) -> dict[DeviceId, int]:
        """Every device's global rank."""
        return {d: self.rank_of(d) for row in self.stages for d in row}


def default_layout(devices: Sequence[DeviceId], stages: int) -> PipelineLayout:
    """Ranks in the devices' order: stage j is devices[j*D:(j+1)*D]."""
    check_shape(len(devices), stages)
    d = len(devices) // stages
    return PipelineLayout([list(devices[j * d:(j + 1) * d]) for j in range(stages)])


def check_shape(devices: int, stages: int) -> None:
    if stages < 1:
        raise PlacementError(f"pipeline_stages must be at least 1, found {stages}")
    if devices % stages:
        raise PlacementError(
            f"{devices} devices (slots over all hosts) cannot form {stages} pipeline stages of "
            f"equal size; make the number of slots a multiple of {stages}")


def layout_from_placement(placement: Mapping[str, Any], devices: Sequence[DeviceId],
                          stages: int) -> PipelineLayout:
    """Check a placement against the job's devices and stage count and return its layout."""
    check_shape(len(devices), stages)
    rows = placement.get("stages")
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise PlacementError("expected 'stages': a list of lists of device ids (the JSON of "
                             "`nebula plan placement --json`)")
    if len(rows) != stages:
        raise PlacementError(f"the placement has {len(rows)} stages, the spec asks for "
                             f"pipeline_stages: {stages}")
    replicas = len(devices) // stages
    for j, row in enumerate(rows):
        if len(row) != replicas:
            raise PlacementError(f"stage {j} of the placement has {len(row)} devices; "
                                 f"{len(devices)} devices in {stages} stages need {replicas}")
        if bad := [d for d in row if not isinstance(d, str)]:
            raise PlacementError(f"stage {j}: device ids are strings, found {bad[0]!r}")
    placed = [d for row in rows for d in row]
    if twice := sorted(d for d, n in Counter(placed).items() if n > 1):
        raise PlacementError(f"device(s) placed more than once: {', '.join(twice)}")
    known, placed_set = set(devices), set(placed)
    if unknown := [d for d in placed if d not in known]:
        raise PlacementError(
            f"device(s) not in this job: {', '.join(unknown)} (devices are "
            f"<cluster>/<host>/<slot>, e.g. {devices[0]!r})")
    if missing := [d for d in devices if d not in placed_set]:
        raise PlacementError(f"device(s) of this job with no stage: {', '.join(missing)}")
    return PipelineLayout([list(r) for r in rows])


def read_placement(path: str | Path) -> dict[str, Any]:
    """Read a placement JSON file (``nebula plan placement --json`` output), bounded in size."""
    try:
        data = specfile.read_json(Path(path), "placement")
    except specfile.FileProblem as exc:
        raise PlacementError(f"{path}: {exc}") from exc
    if not isinstance(data, dict):
        raise PlacementError(f"placement {path}: expected a JSON object with 'stages'")
    return data
