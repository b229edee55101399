"""Every WAN codec as the plan knows it, by name: the closed catalog (:data:`CODEC_PARAMS`),
built from the codecs' packages (`nebula_cli/codecs/registry.py`, each package's
``params.PARAMS``) and checked at import, with the ways to read it: each knob's codec, every
codec's params from the spec's flat knobs, the plan's set of them (:class:`CodecParamSet`).
What one codec is to the plan (its knobs, cost, error bound, handshake, outer-step defaults) is
its params class, a `codec_knobs.CodecParams`.

Who uses it: the spec (`sections.CompressionSpec` has one field per knob, flat as users write
it: ``compression: {codec: topk, density: 0.125}``), the plan (`RelayConfig.codec_params`
carries every codec's params to the relay, whole), the relay (its codec classes,
`nebula_cli.relay.codecs`, are built from their params, and the HELLO compares
``handshake()``), and the planner's advisor (``bytes_per_element``, ``rel_error``). It lives in
``config`` because ``config`` may not import the relay (the layering test), and imports only
the standard library because host processes load the plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from nebula_cli.codecs import registry
from nebula_cli.config import strict
from nebula_cli.config.codec_knobs import CodecParams

__all__ = ["AUTO_CODEC", "AUTO_CODECS", "CODEC_PARAMS", "CodecParamSet", "CodecParams",
           "knob_owner", "params_from_knobs"]

AUTO_CODEC = "auto"
"""The spec's ``compression: auto``: the relays choose each round's codec among AUTO_CODECS."""


def _catalog(*classes: type[CodecParams]) -> Mapping[str, type[CodecParams]]:
    """The closed catalog: names unique, knob names unique across codecs (the spec is flat)."""
    catalog: dict[str, type[CodecParams]] = {}
    owner: dict[str, str] = {}
    for cls in classes:
        if cls.name in catalog or cls.name == AUTO_CODEC:
            raise RuntimeError(f"codec name {cls.name!r} registered twice (or reserved)")
        for f in cls.knobs():
            if f.name in owner or f.name in ("codec", "error_feedback"):
                raise RuntimeError(f"knob {f.name!r} of {cls.name} is taken")
            owner[f.name] = cls.name
        catalog[cls.name] = cls
    if sum(cls.auto for cls in catalog.values()) < 2:
        raise RuntimeError("compression: auto chooses among the codecs whose params say `auto`: "
                           "fewer than two are registered")
    return MappingProxyType(catalog)


CODEC_PARAMS: Mapping[str, type[CodecParams]] = _catalog(
    *(cls for module in registry.parts("params") for cls in module.PARAMS))
"""Every codec by name, in the spec's order (`nebula_cli/codecs/registry.py`'s): a new codec is
a package there, its ``params.PARAMS`` read here and its ``codec.CODECS`` by the relay."""
AUTO_CODECS: tuple[str, ...] = tuple(sorted(
    (name for name, cls in CODEC_PARAMS.items() if cls.auto),
    key=lambda name: CODEC_PARAMS[name].rel_error))
"""The codecs ``compression: auto`` chooses from (their params say ``auto``), the most faithful
first (the first rounds')."""


def knob_owner() -> dict[str, type[CodecParams]]:
    """Knob name -> the codec params class that declares it, for every knob."""
    return {f.name: cls for cls in CODEC_PARAMS.values() for f in cls.knobs()}


def params_from_knobs(knobs: Mapping[str, Any]) -> CodecParamSet:
    """Every codec's params from flat knob values (the spec's form; knobs not given take
    their defaults). TypeError for a name that is no codec's knob. Values are not checked."""
    owners = knob_owner()
    unknown = sorted(set(knobs) - set(owners))
    if unknown:
        raise TypeError(f"unknown codec knob(s) {', '.join(unknown)}; known: "
                        f"{', '.join(owners)}")
    return CodecParamSet({name: cls(**{f.name: knobs[f.name] for f in cls.knobs()
                                       if f.name in knobs})
                          for name, cls in CODEC_PARAMS.items()})


class CodecParamSet(dict[str, CodecParams]):
    """Every codec's params, by name: the plan's codec settings (`RelayConfig.codec_params`).
    In the plan file, ``{name: {knob: value}}`` with every codec and every knob."""

    @classmethod
    def from_plan(cls, data: Any, where: str) -> CodecParamSet:
        """Strictly, as every part of the plan: every codec once, every knob of its type, then
        each codec's own checks (`CodecParams.problems`); PlanFileError naming the field."""
        if not isinstance(data, Mapping):
            raise strict.PlanFileError(f"{where}: expected a mapping, found {data!r}")
        unknown = sorted(set(data) - set(CODEC_PARAMS))
        missing = [n for n in CODEC_PARAMS if n not in data]
        if unknown or missing:
            raise strict.PlanFileError(
                f"{where}: expected the params of every codec ({', '.join(CODEC_PARAMS)}); "
                + "; ".join(part for part in (unknown and f"unknown: {', '.join(unknown)}",
                                              missing and f"missing: {', '.join(missing)}")
                            if part))
        out = cls()
        for name, params in CODEC_PARAMS.items():
            value = data[name]
            loaded = (value if isinstance(value, params)
                      else strict.from_dict(params, value, f"{where}.{name}"))
            problems = loaded.problems()
            if problems:
                knob_name, why = problems[0]
                raise strict.PlanFileError(f"{where}.{name}.{knob_name}: {why}")
            out[name] = loaded
        return out

    def handshake(self) -> dict[str, Any]:
        """What two relays' HELLOs must agree on, of every codec, flat by knob name."""
        return {k: v for params in self.values() for k, v in params.handshake().items()}
