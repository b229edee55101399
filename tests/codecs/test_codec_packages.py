"""One registry of codecs: a codec is its package plus one line in `PACKAGES`, and the spec's
`compression:` names and knobs, the plan's catalog and the relay's codecs follow from it. Shown
with the skeleton `dummy` codec (tests/helpers/dummy_codec/), registered in a fresh interpreter
(the spec's model is built from the registry when `nebula_cli.config` loads)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from helpers.jobs import REPO

from nebula_cli.codecs import registry
from nebula_cli.config.codec_params import AUTO_CODECS, CODEC_PARAMS
from nebula_cli.config.spec import parse_spec
from nebula_cli.errors import SpecError
from nebula_cli.relay.codecs.registry import CODECS

SPEC = "name: j\nrun: x\nclusters:\n  - {name: a, transport: local, hosts: [a1]}\n" \
       "  - {name: b, transport: local, hosts: [b1]}\nrelay:\n  compression: %s\n"

PROBE = textwrap.dedent("""
    import json, sys
    from nebula_cli.codecs import registry
    registry.PACKAGES.append("helpers.dummy_codec")  # the registration line

    import torch
    from nebula_cli.config.codec_params import AUTO_CODECS, CODEC_PARAMS, params_from_knobs
    from nebula_cli.config.spec import parse_spec
    from nebula_cli.errors import SpecError
    from nebula_cli.relay.codecs.registry import CODECS, codec_for, decode

    def problems(compression):
        try:
            parse_spec(SPEC % compression)
        except SpecError as exc:
            return {p.field: p.message for p in exc.problems}
        return {}

    comp = parse_spec(SPEC % "{codec: dummy, dummy_copies: 3}").relay.compression
    codec = codec_for(params_from_knobs({"dummy_copies": 3})["dummy"])
    x = torch.arange(5, dtype=torch.float32)
    print(json.dumps({
        "names": list(CODEC_PARAMS), "relay": list(CODECS), "auto": list(AUTO_CODECS),
        "codec": comp.codec, "copies": comp.dummy_copies, "built": codec.copies,
        "round_trip": decode(codec.encode(x)).tolist(),
        "too_many": problems("{codec: dummy, dummy_copies: 9}"),
        "on_int8": problems("{codec: int8, dummy_copies: 2}")}))
""").replace("SPEC % ", f"{SPEC!r} % ")


def test_a_codec_is_its_package_and_one_registry_line() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         cwd=REPO / "tests", timeout=120)
    assert out.returncode == 0, out.stderr
    said = json.loads(out.stdout)
    assert said["names"] == ["none", "fp16", "bf16", "int8", "topk", "dummy"]
    assert said["relay"] == said["names"]
    assert said["auto"] == ["int8", "topk"]  # it does not say `auto`
    assert (said["codec"], said["copies"], said["built"]) == ("dummy", 3, 3)
    assert said["round_trip"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert list(said["too_many"]) == ["relay.compression.dummy_copies"]
    assert list(said["on_int8"]) == ["relay.compression"]
    assert "dummy_copies" in said["on_int8"]["relay.compression"]


def test_without_its_line_the_spec_knows_no_such_codec() -> None:
    assert list(CODEC_PARAMS) == list(CODECS) == ["none", "fp16", "bf16", "int8", "topk"]
    assert AUTO_CODECS == ("int8", "topk")
    with pytest.raises(SpecError) as info:
        parse_spec(SPEC % "{codec: dummy}")
    assert "relay.compression.codec" in {p.field for p in info.value.problems}


def test_every_package_has_both_parts_in_its_order() -> None:
    params, codecs = registry.parts("params"), registry.parts("codec")
    assert [m.__name__ for m in params] == [f"{p}.params" for p in registry.PACKAGES]
    assert [c.Params for m in codecs for c in m.CODECS] == [p for m in params for p in m.PARAMS]
