"""Every WAN codec nebula knows, registered once: a package each, named in `PACKAGES`.

A codec's package holds one module per layer it serves, found by its name (nothing else lists
them): `params` (`PARAMS`: its `config.codec_knobs.CodecParams` classes, what the plan knows of
each codec: name, knobs, cost, handshake, outer-step defaults; standard library only) and
`codec` (`CODECS`: its `relay.codecs.base.Codec` classes, in `PARAMS`' order, each built on its
params class: the wire). The plan's catalog (`config/codec_params.py`: the spec's
`compression:` names, `compression: auto`'s candidates) and the relay's registry
(`relay/codecs/registry.py`) take their part of every package from here. A package may hold
several codecs where they are one idea (`half`: fp16 and bf16). Standard library only, and
nothing is imported until a layer asks for its part.
"""

from __future__ import annotations

import importlib
from types import ModuleType

PACKAGES = ["nebula_cli.codecs.none", "nebula_cli.codecs.half", "nebula_cli.codecs.int8",
            "nebula_cli.codecs.topk"]
"""The codecs' packages, in the order the spec lists their names."""


def parts(module: str) -> list[ModuleType]:
    """Every registered codec package's module `module` (`params`, `codec`), in `PACKAGES`'
    order; each package must have both."""
    return [importlib.import_module(f"{package}.{module}") for package in PACKAGES]
