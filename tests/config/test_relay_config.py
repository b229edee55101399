"""config/relay_config.py: relay.json is one strict typed load (every key, of its type; codec
knobs checked by their codec), refused with the file and the field; what is left to check by
hand is how the fields agree with each other."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.plan_defaults import relay_defaults

from nebula_cli.codecs.int8.params import Int8Params
from nebula_cli.codecs.topk.params import TopKParams
from nebula_cli.config.codec_params import CodecParamSet
from nebula_cli.config.relay_config import RelayConfig, RelayConfigError


def make(**settings: Any) -> RelayConfig:
    return RelayConfig(job_id="j", cluster="b", clusters=["a", "b"], peer_listen="127.0.0.1:1",
                       worker_listen="127.0.0.1:2", peers={"a": "127.0.0.1:3"},
                       tls={"ca": "/ca", "cert": "/cert", "key": "/key"},
                       **relay_defaults(**settings))


def written(tmp_path: Path, cfg: RelayConfig, **changes: Any) -> Path:
    data = json.loads(json.dumps(cfg.to_dict()))
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        where = data
        for key in parents:
            where = where[key]
        where[last] = value
    path = tmp_path / "relay.json"
    path.write_text(json.dumps(data))
    return path


def test_codec_params_travel_whole_and_load_typed(tmp_path: Path) -> None:
    cfg = make(block_size=64, density=0.125, bits=4)
    assert cfg.codec_params["topk"] == TopKParams(density=0.125, bits=4)
    assert cfg.block_size == 64  # chunks are whole int8 blocks, whatever the codec
    again = RelayConfig.load(written(tmp_path, cfg))
    assert again == cfg
    assert isinstance(again.codec_params, CodecParamSet)
    assert isinstance(again.codec_params["int8"], Int8Params)
    assert json.loads((tmp_path / "relay.json").read_text())["codec_params"]["topk"] == {
        "density": 0.125, "bits": 4, "span": 0}


@pytest.mark.parametrize(("change", "message"), [
    ({"codec_params__topk__bits": 3}, "codec_params.topk.bits: expected one of 1, 2, 4, 8"),
    ({"codec_params__int8__block_size": "big"},
     "codec_params.int8.block_size: expected an integer, found 'big'"),
    ({"codec_params__topk": {"density": 0.1}}, r"codec_params.topk: missing key\(s\) bits, span"),
    ({"heartbeat": "2"}, "heartbeat: expected a number, found '2'"),
    ({"feedback_decay": "0.9"}, "feedback_decay: expected a mapping, found '0.9'"),
    ({"feedback_decay": {"int8": "0.9"}}, "feedback_decay.int8: expected a number"),
    ({"feedback_decay": {"int8": 0.0}}, r"feedback_decay.int8: expected a number in \(0, 1\]"),
    ({"feedback_decay": {"topk": 0.7}}, "feedback_decay: 'topk' is not a codec the rounds use"),
    ({"tls__ca": 5}, "tls.ca: expected str, found 5"),
    ({"clusters": ["a", "b", "b"]}, "clusters: a cluster is listed twice"),
    ({"peers": {}}, "peers: expected an address for each of"),
    ({"peer_listen": "nowhere"}, "address 'nowhere' is not host:port"),
    ({"codec": "auto"}, "auto_codec is set exactly when codec is 'auto'"),
    ({"chunk_numel": 0}, "chunk_numel: expected a positive integer"),
    ({"worker_socket": "relative.sock"}, "worker_socket: expected an absolute path"),
])
def test_a_bad_file_is_refused_with_the_file_and_the_field(tmp_path: Path,
                                                          change: dict[str, Any],
                                                          message: str) -> None:
    path = written(tmp_path, make(), **change)
    with pytest.raises(RelayConfigError, match=message) as info:
        RelayConfig.load(path)
    assert str(info.value).startswith(f"{path}: ")


def test_unreadable_and_malformed_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(RelayConfigError, match="cannot read .*missing.json"):
        RelayConfig.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{\n  oops")
    with pytest.raises(RelayConfigError, match=r"bad.json:2:3: "):
        RelayConfig.load(bad)
    bad.write_text("[]")
    with pytest.raises(RelayConfigError, match="bad.json: relay config: expected a mapping"):
        RelayConfig.load(bad)


def test_codec_params_given_as_plain_data_are_loaded_and_checked() -> None:
    plain = json.loads(json.dumps(make().to_dict()["codec_params"]))
    assert make(codec_params=plain).codec_params == make().codec_params
    plain["topk"]["density"] = 0
    with pytest.raises(RelayConfigError, match="codec_params.topk.density: expected a number > 0"):
        make(codec_params=plain)
