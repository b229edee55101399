"""config/codec_params.py: each codec's knobs (defaults defined once, bounds, checks worded as
the spec words them), its cost, its handshake, the closed catalog, the plan's CodecParamSet, and
the spec's compression section built from them (located errors)."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from nebula_cli.codecs import registry
from nebula_cli.codecs.half.params import Bf16Params, Fp16Params
from nebula_cli.codecs.int8.params import Int8Params
from nebula_cli.codecs.none.params import NoneParams
from nebula_cli.codecs.topk.params import TopKParams
from nebula_cli.config import codec_knobs
from nebula_cli.config import codec_params as cp
from nebula_cli.config.codec_knobs import knob
from nebula_cli.config.codec_params import (
    AUTO_CODECS,
    CODEC_PARAMS,
    CodecParams,
    CodecParamSet,
    knob_owner,
    params_from_knobs,
)
from nebula_cli.config.sections import CompressionSpec, RelaySpec
from nebula_cli.config.spec import parse_spec
from nebula_cli.config.strict import PlanFileError
from nebula_cli.errors import SpecError

SPEC = """\
name: demo
run: x
clusters:
  - {name: east, transport: local, hosts: [e1]}
  - {name: west, transport: local, hosts: [w1]}
relay:
  compression: %s
"""


def spec_problems(compression: str) -> list[tuple[int | None, int | None, str | None, str]]:
    with pytest.raises(SpecError) as info:
        parse_spec(SPEC % compression, base_dir=Path("."))
    return [(p.line, p.col, p.field, p.message) for p in info.value.problems]


# ---------------------------------------------------------------------------- the catalog


def test_the_catalog_names_every_codec_once_with_its_own_knobs() -> None:
    assert tuple(CODEC_PARAMS) == ("none", "fp16", "bf16", "int8", "topk")
    assert all(CODEC_PARAMS[name].name == name for name in CODEC_PARAMS)
    assert set(AUTO_CODECS) <= set(CODEC_PARAMS)
    assert {k: v.name for k, v in knob_owner().items()} == {
        "block_size": "int8", "density": "topk", "bits": "topk", "span": "topk"}
    with pytest.raises(TypeError):
        CODEC_PARAMS["zstd"] = NoneParams  # type: ignore[index]  # closed


def test_the_catalog_refuses_clashing_names_and_knobs() -> None:
    @dataclass(frozen=True)
    class Again(NoneParams):
        name: ClassVar[str] = "fp16"

    @dataclass(frozen=True)
    class Clash(NoneParams):
        name: ClassVar[str] = "clash"
        density: float = knob(0.5, gt=0.0)

    @dataclass(frozen=True)
    class Auto(NoneParams):
        name: ClassVar[str] = "auto"

    for classes, what in (((Fp16Params, Again), "registered twice"),
                          ((TopKParams, Clash), "knob 'density' of clash is taken"),
                          ((Auto,), "reserved"),
                          ((NoneParams,), "compression: auto chooses among")):
        with pytest.raises(RuntimeError, match=what):
            cp._catalog(*classes)
    with pytest.raises(TypeError, match="unknown limit"):
        knob(1, above=0)


def test_the_catalog_imports_only_the_standard_library() -> None:
    """Host processes load the plan (relay.json's codec_params) without pydantic or torch: the
    catalog, the params base, the codecs' registry and every package's `params` module."""
    files = [Path(cp.__file__), Path(codec_knobs.__file__), Path(registry.__file__),
             *(Path(m.__file__) for m in registry.parts("params") if m.__file__)]
    ours = {"nebula_cli.config", "nebula_cli.config.codec_knobs", "nebula_cli.codecs"}
    for path in files:
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        outside = {n for n in names if n.split(".")[0] not in sys.stdlib_module_names
                   and n != "__future__"}
        assert outside <= ours, (path, outside)  # strict, itself standard library only
    loaded = subprocess.run([sys.executable, "-c", "import sys, nebula_cli.config.codec_params; "
                             "print(sorted(m for m in ('torch', 'pydantic') if m in "
                             "sys.modules))"], capture_output=True, text=True, timeout=60)
    assert loaded.stdout.strip() == "[]", loaded.stderr


# ---------------------------------------------------------------------------- each codec


def test_defaults_are_defined_once_and_the_spec_takes_them() -> None:
    assert (TopKParams().density, TopKParams().bits, Int8Params().block_size) == (0.0625, 2, 256)
    comp = CompressionSpec()
    assert (comp.density, comp.bits, comp.block_size) == (0.0625, 2, 256)
    assert comp.params == params_from_knobs({})
    assert dict(comp.params) == {"none": NoneParams(), "fp16": Fp16Params(), "bf16": Bf16Params(),
                                 "int8": Int8Params(), "topk": TopKParams()}


def test_bytes_per_element_by_hand() -> None:
    assert NoneParams().bytes_per_element() == 4.0
    assert Fp16Params().bytes_per_element() == Bf16Params().bytes_per_element() == 2.0
    assert Int8Params().bytes_per_element() == 1 + 4 / 256
    assert Int8Params(block_size=64).bytes_per_element() == 1 + 4 / 64
    # 1 of 16 kept, a 4-bit position and 2 bits each, two bfloat16 scales per 1024
    assert TopKParams().bytes_per_element() == 4 / 1024 + (4 + 2) / 16 / 8 == 0.05078125
    assert TopKParams(bits=4).bytes_per_element() == 4 / 1024 + (4 + 4) / 16 / 8
    # below 1/32: spans of 256 with 8-bit positions; 0.02 * 256 rounds to 5 kept
    assert TopKParams(density=0.02).bytes_per_element() == 4 / 1024 + 5 * (8 + 2) / 256 / 8
    # SparseLoCo's chunk: 64 of 4096 (1.56 %), 12-bit positions, one pair of scales a span
    assert TopKParams(density=1 / 64, bits=1, span=4096).bytes_per_element() == (
        4 / 4096 + 64 * (12 + 1) / 4096 / 8)
    assert TopKParams(density=1e-6, bits=1, span=4096).bytes_per_element() == (
        4 / 4096 + (12 + 1) / 4096 / 8)  # at least one a span


@pytest.mark.parametrize(("density", "layout"), [
    (1.0, (16, 16)), (0.125, (16, 2)), (0.0625, (16, 1)), (0.04, (16, 1)),
    (1 / 32, (256, 8)),  # 16 / 32 rounds (to even) to none of 16
    (0.03, (256, 8)), (0.02, (256, 5)), (1e-6, (256, 1))])
def test_topk_layout_of_a_density(density: float, layout: tuple[int, int]) -> None:
    assert TopKParams(density=density).layout() == layout


@pytest.mark.parametrize(("density", "span", "layout"), [
    (1 / 64, 4096, (4096, 64)), (0.01, 1024, (1024, 10)), (1e-6, 32, (32, 1)),
    (1.0, 64, (64, 64)), (0.0625, 16, (16, 1))])
def test_topk_layout_of_a_span_asked(density: float, span: int,
                                     layout: tuple[int, int]) -> None:
    assert TopKParams(density=density, span=span).layout() == layout
    assert TopKParams(span=48).problems() == [
        ("span", "expected one of 0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, found 48")]


def test_ranking_outer_defaults_labels_and_handshake() -> None:
    ranked = sorted(CODEC_PARAMS, key=lambda n: CODEC_PARAMS[n].rel_error)
    assert ranked == ["none", "fp16", "bf16", "int8", "topk"]
    assert [n for n, c in CODEC_PARAMS.items() if c.sparse] == ["topk"]
    assert {n: (c.outer_lr, c.outer_momentum) for n, c in CODEC_PARAMS.items()} == {
        "none": (0.6, 0.5), "fp16": (0.6, 0.5), "bf16": (0.6, 0.5), "int8": (0.6, 0.5),
        "topk": (2.5, 0.0)}
    assert TopKParams(density=0.125, bits=4).label() == "topk (density 0.125, 4 bits)"
    assert Int8Params(block_size=64).label() == "int8"
    assert TopKParams(density=1 / 64, bits=1, span=4096).label() == (
        "topk (density 0.015625, 1 bit, span 4096)")
    assert TopKParams().handshake() == {"density": 0.0625, "bits": 2, "span": 0}
    assert NoneParams().handshake() == {}
    assert params_from_knobs({"block_size": 64}).handshake() == {
        "block_size": 64, "density": 0.0625, "bits": 2, "span": 0}


@pytest.mark.parametrize(("params", "problem"), [
    (Int8Params(block_size=8), ("block_size", "expected an integer >= 16, found 8")),
    (Int8Params(block_size=2.5), ("block_size", "expected an integer, found 2.5")),  # type: ignore[arg-type]
    (Int8Params(block_size=True), ("block_size", "expected an integer, found true")),
    (TopKParams(density=0), ("density", "expected a number > 0, found 0")),
    (TopKParams(density=1.5), ("density", "expected a number <= 1, found 1.5")),
    (TopKParams(density="0.1"), ("density", "expected a number, found '0.1'")),  # type: ignore[arg-type]
    (TopKParams(density=float("nan")), ("density", "expected a number, found nan")),
    (TopKParams(bits=3), ("bits", "expected one of 1, 2, 4, 8, found 3")),
    (TopKParams(bits=True), ("bits", "expected one of 1, 2, 4, 8, found true")),
])
def test_problems_are_worded_as_the_spec_words_them(params: CodecParams,
                                                    problem: tuple[str, str]) -> None:
    assert params.problems() == [problem]


def test_valid_params_have_no_problems() -> None:
    for params in (*params_from_knobs({}).values(), Int8Params(block_size=16),
                   TopKParams(density=1, bits=8), TopKParams(density=1e-9, bits=4)):
        assert params.problems() == [], params


# ---------------------------------------------------------------------------- the plan's form


def test_params_from_knobs_routes_each_knob_to_its_codec() -> None:
    got = params_from_knobs({"density": 0.125, "block_size": 64})
    assert list(got) == list(CODEC_PARAMS)
    assert got["topk"] == TopKParams(density=0.125, bits=2)
    assert got["int8"] == Int8Params(block_size=64)
    with pytest.raises(TypeError, match="unknown codec knob.*colour; known: block_size, density"):
        params_from_knobs({"colour": 1})


def test_codec_param_set_round_trips_through_json_strictly() -> None:
    params = params_from_knobs({"bits": 4})
    part = dataclasses.make_dataclass("Part", [("p", CodecParamSet)])(params)
    data = json.loads(json.dumps(dataclasses.asdict(part)))["p"]
    assert data == {"none": {}, "fp16": {}, "bf16": {}, "int8": {"block_size": 256},
                    "topk": {"density": 0.0625, "bits": 4, "span": 0}}
    again = CodecParamSet.from_plan(data, "codec_params")
    assert again == params and isinstance(again["topk"], TopKParams)
    assert CodecParamSet.from_plan(params, "codec_params") == params  # already loaded


@pytest.mark.parametrize(("change", "message"), [
    ({"topk": {"density": 0.5, "bits": 3, "span": 0}},
     "codec_params.topk.bits: expected one of 1, 2, 4, 8, found 3"),
    ({"topk": {"density": "half", "bits": 2, "span": 0}},
     "codec_params.topk.density: expected a number, found 'half'"),
    ({"int8": {"block_size": 4}}, "codec_params.int8.block_size: expected an integer >= 16"),
    ({"int8": {}}, r"codec_params.int8: missing key\(s\) block_size"),
    ({"int8": {"block_size": 256, "x": 1}},
     r"codec_params.int8: unknown key\(s\) x; known: block_size"),
    ({"zstd": {}}, "codec_params: expected the params of every codec .*unknown: zstd"),
])
def test_codec_param_set_refuses_with_the_field(change: dict[str, object], message: str) -> None:
    data = {"none": {}, "fp16": {}, "bf16": {}, "int8": {"block_size": 256},
            "topk": {"density": 0.0625, "bits": 2}, **change}
    with pytest.raises(PlanFileError, match=message):
        CodecParamSet.from_plan(data, "codec_params")
    data = {k: v for k, v in data.items() if k != "fp16"}
    with pytest.raises(PlanFileError, match="missing: fp16"):
        CodecParamSet.from_plan(data, "codec_params")
    with pytest.raises(PlanFileError, match="codec_params: expected a mapping"):
        CodecParamSet.from_plan([], "codec_params")


# ---------------------------------------------------------------------------- the spec


def test_the_spec_has_a_field_per_knob_checked_where_it_is_written() -> None:
    assert list(CompressionSpec.model_fields) == [
        "codec", "error_feedback", "feedback_decay", "block_size", "density", "bits", "span"]
    assert spec_problems("{codec: topk, density: 0}") == [
        (7, 39, "relay.compression.density", "expected a number > 0, found 0")]
    assert spec_problems("{codec: topk, bits: 3}") == [
        (7, 36, "relay.compression.bits", "expected one of 1, 2, 4, 8, found 3")]
    assert spec_problems("{codec: int8, block_size: 8}") == [
        (7, 42, "relay.compression.block_size", "expected an integer >= 16, found 8")]
    assert spec_problems("{codec: topk, colour: 1}") == [
        (7, 30, "relay.compression.colour",
         "unknown key 'colour'; known keys: codec, error_feedback, feedback_decay, block_size, "
         "density, bits, span")]
    assert spec_problems("{codec: zip}")[0][3] == (
        "expected one of 'none', 'fp16', 'bf16', 'int8', 'topk', 'auto', found 'zip'")


def test_a_knob_belongs_to_a_codec_the_rounds_use() -> None:
    assert spec_problems("{codec: int8, bits: 4, density: 0.5}") == [
        (7, 16, "relay.compression", "density and bits apply to codec topk (or auto) only, "
                                     "not int8 (set codec: topk, or remove them)")]
    assert spec_problems("{codec: none, density: 0.5}")[0][3].startswith(
        "density applies to codec topk (or auto) only, not none")
    auto = parse_spec(SPEC % "{codec: auto, bits: 4}", base_dir=Path("."))
    assert auto.relay is not None and auto.relay.compression.params["topk"].bits == 4
    # block_size also aligns the relays' chunks: any codec takes it
    topk = parse_spec(SPEC % "{codec: topk, block_size: 128}", base_dir=Path("."))
    assert topk.relay is not None and topk.relay.compression.params["int8"].block_size == 128


def test_the_error_feedback_decay_is_checked_where_it_is_written() -> None:
    """compression.feedback_decay (SparseLoCo's beta): in (0, 1], 1 by default, refused where
    there is no error feedback to decay."""
    assert CompressionSpec().feedback_decay is None  # the codec's
    assert CompressionSpec().decay_for("int8") == codec_knobs.FEEDBACK_DECAY == 1.0
    assert CompressionSpec(codec="topk").decay_for("topk") == TopKParams.feedback_decay
    spec = parse_spec(SPEC % "{codec: topk, feedback_decay: 0.95}", base_dir=Path("."))
    assert spec.relay is not None and spec.relay.compression.feedback_decay == 0.95
    assert spec.relay.compression.decay_for("topk") == 0.95
    assert spec_problems("{codec: topk, feedback_decay: 0}") == [
        (7, 46, "relay.compression.feedback_decay", "expected a number > 0, found 0")]
    assert spec_problems("{codec: topk, feedback_decay: 1.5}")[0][3] == (
        "expected a number <= 1, found 1.5")
    assert spec_problems("{codec: int8, error_feedback: false, feedback_decay: 0.9}") == [
        (7, 16, "relay.compression", "feedback_decay applies to error feedback, which is off "
                                     "(set error_feedback: true, or remove feedback_decay)")]


def test_outer_defaults_come_from_the_codec() -> None:
    assert RelaySpec(compression=CompressionSpec(codec="topk")).outer_for("topk") == (2.5, 0.0)
    relay = RelaySpec(compression=CompressionSpec(codec="int8"))
    assert relay.outer_for("int8") == (0.6, 0.5)
    assert (relay.sync.outer_lr, relay.sync.outer_momentum) == (0.6, 0.5)
