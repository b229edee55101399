"""Plan parts built from a minimal spec, so that tests use the spec's defaults (defined once)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from nebula_cli.config import checkpoint_paths, relay_plan, sync_plan
from nebula_cli.config.codec_params import (
    AUTO_CODEC,
    CODEC_PARAMS,
    knob_owner,
    params_from_knobs,
)
from nebula_cli.config.parts import CheckpointSettings, SyncConfig
from nebula_cli.config.sections import CompressionSpec
from nebula_cli.config.spec import JobSpec, parse_spec

MINIMAL = """
name: minimal
run: python train.py
relay: {}
clusters:
  - {name: east, transport: local, hosts: [e1]}
  - {name: west, transport: local, hosts: [w1]}
"""


def minimal_spec() -> JobSpec:
    return parse_spec(MINIMAL, base_dir=Path(__file__).parent)


def default_sync_config(**overrides: Any) -> SyncConfig:
    """The sync.json a worker of the minimal spec gets, with `overrides` replaced."""
    spec = minimal_spec()
    cfg = sync_plan.sync_config(spec, "job-test", spec.clusters[0], "/nowhere",
                                relay_addr="127.0.0.1:1", checkpoint=None)
    return dataclasses.replace(cfg, **overrides)


def default_checkpoint(directory: str | Path, **overrides: Any) -> CheckpointSettings:
    """The checkpoint settings of the minimal spec with `checkpoint: {}` (the spec's
    defaults), kept in `directory`, with `overrides` replaced."""
    spec = parse_spec(MINIMAL + "checkpoint: {}\n", base_dir=Path(__file__).parent)
    cluster = spec.clusters[0]
    cfg = checkpoint_paths.checkpoint_settings(spec, "job-test", "/nowhere", cluster,
                                               cluster.hosts[0])
    assert cfg is not None
    return dataclasses.replace(cfg, dir=str(directory), **overrides)


def _decays(comp: CompressionSpec, settings: dict[str, Any]) -> dict[str, float]:
    """The plan's map of decays (`relay_plan.relay_config`) for the codec `settings` names."""
    codec = settings.get("codec", comp.codec)
    known = codec == AUTO_CODEC or codec in CODEC_PARAMS  # (a test may name an unknown one)
    return comp.model_copy(update={"codec": codec}).decays if known else {}


def relay_defaults(**settings: Any) -> dict[str, Any]:
    """The settings of relay.json that come from the spec, at the spec's defaults, with
    `settings` replaced; codec knobs given by name (``block_size=64``, ``density=0.02``) replace
    those of the codecs' params (`codec_params`)."""
    relay = minimal_spec().relay
    assert relay is not None
    owners = knob_owner()
    knobs = {k: settings.pop(k) for k in list(settings) if k in owners}
    spec_knobs = {k: getattr(relay.compression, k) for k in owners}
    return {"codec": relay.compression.codec,
            "error_feedback": relay.compression.error_feedback,
            "feedback_decay": _decays(relay.compression, settings),
            "codec_params": params_from_knobs({**spec_knobs, **knobs}),
            "round_timeout": relay.timeout,
            "heartbeat": relay.heartbeat, "dead_after": relay.dead_after,
            "shaping": {"rate_mbit": None, "delay_ms": 0.0},
            "auto_steps": relay_plan.auto_steps(minimal_spec()), **settings}
