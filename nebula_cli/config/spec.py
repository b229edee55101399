"""The job spec: a YAML file validated into typed models, with errors that say where and why.

`load_spec(path)` / `parse_spec(text)` return a `JobSpec` or raise one `SpecError` whose
`.problems` lists every problem found, each with file, line, column, field path and a message
that says what was expected and what was found.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from nebula_cli.config import pipeline, reach, specfile
from nebula_cli.config import yaml_positions as yp
from nebula_cli.config.cluster import ClusterSpec
from nebula_cli.config.distill_spec import DistillSpec, TeacherSpec
from nebula_cli.config.fields import (
    EnvDict,
    Name,
    redact_env,
)
from nebula_cli.config.hosts import MAX_SLOTS, HostSpec
from nebula_cli.config.run_command import own_launcher
from nebula_cli.config.sections import (
    CheckpointSpec,
    CompressionSpec,
    LogsSpec,
    MetricsSpec,
    ParallelismSpec,
    RelaySpec,
    ShapingSpec,
    SpecModel,
    SyncSpec,
)
from nebula_cli.config.yaml_positions import PathKey, describe, problems_error
from nebula_cli.errors import SpecError
from nebula_cli.schedulers.slurm.spec import SlurmSpec

__all__ = [
    "MAX_PROCESSES", "MAX_SLOTS", "CheckpointSpec", "ClusterSpec", "CompressionSpec", "DistillSpec",
    "HostSpec", "JobSpec", "LogsSpec", "MetricsSpec", "ParallelismSpec", "RelaySpec",
    "RuntimeSpec", "ShapingSpec", "SlurmSpec", "SpecModel", "SyncSpec", "TeacherSpec",
    "load_spec", "parse_spec", "redact_env",
]

MAX_PROCESSES = 65536
"""Most processes (slots) of one job."""


class RuntimeSpec(SpecModel):
    """How the training script meets nebula's runtime on the workers."""

    auto: bool = True
    """Start every worker process with the automatic hook (wraps ``deepspeed.initialize``: an
    unmodified DeepSpeed script syncs and records metrics). A script that builds its own
    ``OuterSync`` keeps it (the hook stands aside); false leaves the script entirely alone."""


def _read_ds_config(path: Path) -> dict[str, Any]:
    data = specfile.read_json(path, f"DeepSpeed config {path}")
    if not isinstance(data, dict):
        raise ValueError(f"DeepSpeed config {path}: expected a JSON object, "
                         f"found {describe(data)}")
    return data


class JobSpec(SpecModel):
    """One training job: what to run, where, and how the clusters are joined."""

    name: Name
    """Job name: 1-32 of a-z, 0-9, '-', '_', starting with a letter or digit."""
    workdir: str = Field(".", validate_default=True)
    """Code directory, relative to the spec file; stored as an absolute path. Must exist."""
    setup: str | None = None
    """Shell run once per host before start (e.g. pip install). Default: none."""
    run: str = Field(min_length=1)
    """Shell command every process (one per slot) runs, in the workdir."""
    run_launcher: bool = False
    """`run` starts a launcher of its own (torchrun, deepspeed, accelerate launch) on purpose:
    run it as written in every slot. Default: such a `run` is refused with what to write
    instead (nebula already starts one process per slot with the world's variables set)."""
    env: EnvDict = Field(default_factory=dict, repr=False)
    """Environment for every process; numbers and booleans become strings."""
    deepspeed: str | dict[str, Any] | None = None
    """DeepSpeed config: a JSON path relative to workdir, or an inline mapping. Default: none."""
    clusters: list[ClusterSpec]
    """The clusters; at least one."""
    relay: RelaySpec | None = None
    """Relay settings. Default: none (clusters train independently)."""
    checkpoint: CheckpointSpec | None = None
    """Checkpoint settings. Default: none."""
    distill: DistillSpec | None = None
    """Distillation from the job's teacher clusters (`role: teacher`). Default: none."""
    parallelism: ParallelismSpec | None = None
    """Pipeline parallelism across the clusters. Default: none (data parallel, per cluster)."""
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    """The worker runtime: the automatic hook for unmodified scripts (on by default)."""
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    """Metrics sinks besides metrics.jsonl: TensorBoard, Weights & Biases. Default: none."""
    logs: LogsSpec = Field(default_factory=LogsSpec)
    """Rotation of the logs and metrics records on the hosts. Default: 64 MiB, 3 kept."""
    placement: str | None = None
    """Which device holds which stage: the JSON of `nebula plan placement --json`, relative to
    the spec file; stored as an absolute path. Default: ranks in the spec's host order."""
    lifetime_days: int = Field(90, ge=1, le=3650)
    """How long the job's certificates are valid, in days (renewed on resume)."""
    max_restarts: int = Field(0, ge=0)
    """How often a host agent restarts its processes after a failure."""
    min_clusters: int | None = Field(None, ge=1)
    """Clusters that must still train for the job to go on: a cluster whose worker failed for
    good is then stopped alone and the others train on. Default: all of them (any such
    failure ends the job)."""
    grace: float = Field(10.0, ge=0.0)
    """Seconds `stop` waits before SIGKILL."""
    exclude: list[str] = Field(
        default_factory=lambda: [".git", ".venv", "__pycache__", "*.pyc", ".nebula"])
    """Patterns in workdir not uploaded."""

    _source: str | None = PrivateAttr(None)
    _layout: pipeline.PipelineLayout | None = PrivateAttr(None)

    @field_validator("workdir")
    @classmethod
    def _resolve_workdir(cls, value: str, info: ValidationInfo) -> str:
        resolved = _resolve(value, info)
        if not resolved.is_dir():
            raise ValueError(f"workdir {value!r} is not an existing directory "
                             f"(looked for {resolved})")
        return str(resolved)

    @field_validator("placement")
    @classmethod
    def _resolve_placement(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else str(_resolve(value, info))

    @field_validator("deepspeed", mode="before")
    @classmethod
    def _deepspeed_shape(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, (str, dict)):
            raise ValueError("expected a path to a DeepSpeed config JSON or an inline mapping, "
                             f"found {describe(value)}")
        if isinstance(value, dict) and (bad := [k for k in value if not isinstance(k, str)]):
            raise ValueError(f"expected string keys in the DeepSpeed mapping, found {bad[0]!r}")
        return value

    @field_validator("clusters")
    @classmethod
    def _some_clusters(cls, clusters: list[ClusterSpec]) -> list[ClusterSpec]:
        if not clusters:
            raise ValueError("a job needs at least one cluster")
        return clusters

    @model_validator(mode="after")
    def _cross_checks(self) -> JobSpec:
        problems: list[tuple[PathKey, str]] = []
        names: dict[str, int] = {}
        owners: dict[tuple[str, int | None, str | None], tuple[int, int]] = {}
        for ci, cluster in enumerate(self.clusters):
            first = names.setdefault(cluster.name, ci)
            if first != ci:
                problems.append((("clusters", ci, "name"), (
                    f"duplicate cluster name {cluster.name!r} (also clusters[{first}])")))
            for hi, host in enumerate(cluster.hosts if cluster.over_ssh else []):
                oc, oh = owners.setdefault((host.host, host.port, host.user), (ci, hi))
                if oc != ci:
                    problems.append((("clusters", ci, "hosts", hi), (
                        f"host {host.host!r} is also in cluster {self.clusters[oc].name!r} "
                        f"(clusters[{oc}].hosts[{oh}]); a host belongs to one cluster")))
        if not self.run_launcher and (found := own_launcher(self.run)) is not None:
            problems.append((("run",), found.advice()))
        for ci, cluster in enumerate(self.clusters):
            if (cluster.run and not self.run_launcher
                    and (found := own_launcher(cluster.run)) is not None):
                problems.append((("clusters", ci, "run"), found.advice()))
        if isinstance(self.deepspeed, str):
            try:
                _read_ds_config(Path(self.workdir) / self.deepspeed)
            except ValueError as exc:
                problems.append((("deepspeed",), str(exc)))
        if (slots := sum(c.process_count for c in self.clusters)) > MAX_PROCESSES:
            problems.append((("clusters",), f"{slots} processes in all; a job may have at most "
                                            f"{MAX_PROCESSES}"))
        else:
            problems += self._check_pipeline()
        if self.min_clusters is not None:
            problems += self._check_min_clusters()
        if self.relay is not None and len(self.clusters) > 1:
            problems += reach.problems(self.clusters)
        problems += self._check_distill()
        if problems:
            raise problems_error(problems)
        return self

    def _check_distill(self) -> list[tuple[PathKey, str]]:
        """Teachers and `distill:` come together, with a relay and at least one student."""
        teachers = [i for i, c in enumerate(self.clusters) if c.kind.serves_labels]
        if not teachers:
            return [] if self.distill is None else [(("distill",), (
                "`distill:` needs a cluster with `role: teacher` (the one serving soft "
                "labels)"))]
        first = ("clusters", teachers[0], "role")
        if self.distill is None:
            return [(first, "a teacher cluster needs the job's `distill:` section "
                            f"(`distill: {{}}` takes the defaults: {DistillSpec().summary()})")]
        if self.relay is None:
            return [(first, "soft labels travel through the relays: add `relay: {}`")]
        if len(teachers) == len(self.clusters):
            return [(first, "every cluster is a teacher; distillation needs at least one "
                            "training cluster (role: train, the default)")]
        if self.parallelism is not None:
            return [(("parallelism",), "a pipeline cannot be combined with a teacher cluster")]
        return [(("clusters", i, "relay_reach"), (
            f"the students dial teacher {self.clusters[i].name}'s label relay directly, and "
            f"relay_reach: {self.clusters[i].relay_reach} says nothing can reach it; soft "
            "labels do not ride SSH tunnels yet: open the teacher's label port "
            "(distill.port, default the relay's port + 2) to the students and leave "
            "relay_reach at inbound"))
            for i in teachers if self.clusters[i].relay_reach != "inbound"]

    def _check_min_clusters(self) -> list[tuple[PathKey, str]]:
        n = len(self.clusters)
        if self.min_clusters is not None and self.min_clusters > n:
            return [(("min_clusters",), f"{self.min_clusters} is more than the job's {n} "
                                        "clusters")]
        if self.min_clusters is not None and self.min_clusters < n and self.parallelism:
            return [(("min_clusters",), "a pipelined job cannot train on without a cluster: "
                                        "its stages span every cluster")]
        return []

    def _check_pipeline(self) -> list[tuple[PathKey, str]]:
        """Pipeline parallelism: no relay, stages that divide the devices, a placement that
        names every device once. Sets the layout the launcher follows."""
        stages = self.pipeline_stages
        if stages == 1:
            if self.placement is not None:
                return [(("placement",), "a placement needs parallelism: {pipeline_stages: K} "
                                         "with K >= 2")]
            return []
        if (late := next((c for c in self.clusters if c.scheduling.allocates), None)):
            return [(("parallelism",), f"pipeline parallelism cannot use a "
                     f"{late.scheduling.title} cluster yet (its devices are known only once the "
                     "allocation starts); use the relay")]
        if self.relay is not None:
            return [(("relay",), "pipeline parallelism runs one DeepSpeed world across the "
                                 "clusters and does not use the relay; remove 'relay:'")]
        if len(self.clusters) > 1 and not (self.parallelism and self.parallelism.cleartext_wan):
            return [(("parallelism",), f"a pipeline across clusters ({self._cluster_list()}) "
                     "sends activations and gradients between them over the WAN unencrypted "
                     "and unauthenticated (the relay's TLS does not carry them); to accept "
                     "that, e.g. on a VPN, set parallelism: {cleartext_wan: true}")]
        devices = self.device_ids()
        try:
            pipeline.check_shape(len(devices), stages)
        except pipeline.PlacementError as exc:
            return [(("parallelism", "pipeline_stages"), str(exc))]
        if self.placement is None:
            self._layout = pipeline.default_layout(devices, stages)
            return []
        try:
            data = specfile.read_json(Path(self.placement), f"placement {self.placement}")
            if not isinstance(data, dict):
                raise pipeline.PlacementError(
                    f"placement {self.placement}: expected a JSON object with 'stages'")
            self._layout = pipeline.layout_from_placement(data, devices, stages)
        except ValueError as exc:  # PlacementError, specfile.FileProblem
            return [(("placement",), str(exc))]
        return []

    def _cluster_list(self) -> str:
        return ", ".join(c.name for c in self.clusters)

    def cleartext_warning(self) -> str | None:
        """What `launch` prints before a pipeline that crosses the WAN in clear text (allowed
        by ``parallelism.cleartext_wan``); None when the job sends nothing unencrypted."""
        if self.pipeline_stages == 1 or len(self.clusters) == 1:
            return None
        return (f"warning: this pipeline spans clusters {self._cluster_list()}: activations, "
                "gradients and the DeepSpeed rendezvous cross the WAN unencrypted and "
                "unauthenticated (parallelism.cleartext_wan: true). Anyone on the path can read "
                "or alter them; run it only over a private network or VPN.")

    @property
    def pipeline_stages(self) -> int:
        """K of ``parallelism.pipeline_stages`` (1 without pipeline parallelism)."""
        return self.parallelism.pipeline_stages if self.parallelism else 1

    def device_ids(self) -> list[str]:
        """Every slot of every host, ``<cluster>/<host>/<slot>``, in the spec's order."""
        return [pipeline.device_id(c.name, h.host, s)
                for c in self.clusters for h in c.hosts for s in range(h.slots)]

    def pipeline_layout(self) -> pipeline.PipelineLayout | None:
        """Which device holds which stage of which replica; None without a pipeline."""
        return self._layout

    @property
    def dial_order(self) -> list[str]:
        """The clusters as their relays connect: each dials those before it (`reach`)."""
        return reach.dial_order(self.clusters)

    def links(self) -> list[reach.Link]:
        """Which relay dials which, and whether through an SSH tunnel (`reach.links`)."""
        return reach.links(self.clusters) if self.relay is not None else []

    def problem_at(self, path: tuple[str | int, ...], message: str) -> SpecError:
        """A SpecError at `path` of the spec file (where it was written, when the file is
        still there), for what is found wrong only later (e.g. by Slurm)."""
        at: tuple[int | None, int | None] = (None, None)
        if self.source:
            with contextlib.suppress(OSError, SpecError, yaml.YAMLError):
                at = yp.load_located(Path(self.source).read_text()).position(path)
        return SpecError(message, file=self.source, line=at[0], col=at[1],
                         field=yp.format_path(path))

    @property
    def source(self) -> str | None:
        """The spec file this was loaded from, if any."""
        return self._source

    def deepspeed_config(self) -> dict[str, Any] | None:
        """The DeepSpeed config as a dict (read from the file, or the inline mapping)."""
        if self.deepspeed is None or isinstance(self.deepspeed, dict):
            return copy.deepcopy(self.deepspeed)
        try:
            return _read_ds_config(Path(self.workdir) / self.deepspeed)
        except ValueError as exc:
            raise SpecError(str(exc), file=self.source, field="deepspeed") from exc

    def redacted_env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """`env` (default: the job's) with secret-looking values shown as ``***``."""
        return redact_env(self.env if env is None else env)


def _resolve(value: str, info: ValidationInfo) -> Path:
    """A path written in the spec, anchored at the spec's directory (context 'base_dir')."""
    base = Path((info.context or {}).get("base_dir") or Path.cwd())
    try:
        return (base / Path(value).expanduser()).resolve()
    except (OSError, RuntimeError) as exc:  # ~unknown-user, a symlink loop, a name too long
        raise ValueError(f"cannot use the path {describe(value)}: {exc}") from exc


def parse_spec(text: str, file: str = "<spec>", base_dir: Path | None = None) -> JobSpec:
    """Validate spec text; `base_dir` anchors a relative workdir (default: the file's dir).

    Any text gives a JobSpec or one SpecError, within the bounds of `specfile.MAX_SPEC_BYTES`,
    `yaml_positions.MAX_DEPTH` and `yaml_positions.MAX_VALUES`."""
    if base_dir is None:
        base_dir = Path(file).parent if file != "<spec>" else Path.cwd()
    if len(text) > specfile.MAX_SPEC_BYTES:
        message = (f"the spec has {len(text)} characters; nebula reads no spec larger than "
                   f"{specfile.MAX_SPEC_BYTES // 1024} KiB")
        raise yp.collect([yp.problem(file, (1, 1), (), message)], file)
    try:
        located = yp.load_located(text)
    except yaml.YAMLError as exc:
        raise yp.collect([yp.yaml_problem(exc, file, text)], file) from exc
    data = located.data
    if not isinstance(data, dict):
        message = (
            "the spec is empty; expected a mapping with at least 'name', 'run' and 'clusters'"
            if data is None else f"expected a mapping (name:, run:, clusters:, ...) at the top "
            f"level, found {describe(data)}")
        raise yp.collect([yp.problem(file, located.position(()), (), message)], file)
    problems = [yp.problem(file, d.at, d.path, f"duplicate key {describe(d.path[-1])} "
                                               f"(first at line {d.first[0]})")
                for d in located.duplicates]
    problems += [yp.problem(file, located.position(path, key=on_key), path,
                            f"control character U+{ord(ch):04X} in a "
                            f"{'key' if on_key else 'value'}; a spec may hold tabs and "
                            "newlines, no other control characters")
                 for path, on_key, ch in yp.control_characters(located)]
    if problems:  # nothing with a control character goes further, not even into a path
        raise yp.collect(problems, file)
    try:
        spec = JobSpec.model_validate(data, context={"base_dir": Path(base_dir)})
    except ValidationError as exc:
        problems += yp.validation_problems(exc, located, file, JobSpec)
    if problems:
        raise yp.collect(problems, file)
    spec._source = None if file == "<spec>" else file
    return spec


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a job spec file (at most `specfile.MAX_SPEC_BYTES`, UTF-8)."""
    file = str(path)
    try:
        resolved = Path(path).expanduser()
        text = specfile.decode_utf8(specfile.read_bounded(resolved, specfile.MAX_SPEC_BYTES,
                                                          "spec"), "spec")
        base_dir = resolved.resolve().parent
    except specfile.FileProblem as exc:
        raise yp.collect([SpecError(str(exc), file=file, line=exc.line, col=exc.col)],
                         file) from exc
    except (OSError, RuntimeError, ValueError) as exc:
        raise yp.collect([SpecError(f"cannot read the spec: {exc}", file=file)], file) from exc
    return parse_spec(text, file=file, base_dir=base_dir)


def spec_of_record(data: dict[str, Any], source: str | None) -> JobSpec:
    """A job's spec as the state store recorded it at launch (validated again: a nebula
    upgrade in between may have tightened a rule)."""
    base_dir = Path(source).expanduser().resolve().parent if source else Path.cwd()
    try:
        spec = JobSpec.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as exc:
        raise SpecError(f"the spec recorded for this job no longer validates: {exc}",
                        file=source) from exc
    spec._source = source
    return spec
