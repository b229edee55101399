"""Job spec loading: defaults, shorthands, and errors with exact file:line:col and field paths."""

from __future__ import annotations

import json
import os
from pathlib import Path
from textwrap import dedent

import pytest
import yaml
from helpers.jobs import REPO
from helpers.specs import BASE, one, problems, where, write

from nebula_cli.config.spec import (
    CompressionSpec,
    HostSpec,
    RelaySpec,
    SyncSpec,
    load_spec,
    parse_spec,
    redact_env,
)
from nebula_cli.errors import SpecError, UsageError

# ---- valid specs, defaults, shorthands ------------------------------------------------------


def test_minimal_spec_gets_working_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, BASE)
    spec = load_spec(path)
    assert spec.source == str(path)
    assert spec.workdir == str(tmp_path.resolve())
    assert spec.env == {} and spec.setup is None and spec.deepspeed is None
    assert spec.relay is None and spec.checkpoint is None
    assert spec.max_restarts == 0 and spec.grace == 10.0
    assert spec.exclude == [".git", ".venv", "__pycache__", "*.pyc", ".nebula"]
    east = spec.clusters[0]
    assert east.transport == "ssh" and east.python == "python3" and east.env == {}
    assert [h.host for h in east.hosts] == ["e1", "e2"]
    assert [h.slots for h in east.hosts] == [2, 1]
    assert east.gateway_host.host == "e1"
    assert east.effective_relay_address == "e1"
    assert spec.deepspeed_config() is None


def test_model_defaults() -> None:
    relay = RelaySpec()
    assert (relay.port, relay.worker_port, relay.effective_worker_port) == (29400, None, 29401)
    assert relay.timeout == 120 and relay.heartbeat == 2.0 and relay.dead_after == 10.0
    assert relay.shaping is None
    assert relay.sync == SyncSpec(mode="diloco", inner_steps=100, outer_lr=0.6,
                                  outer_momentum=0.5, nesterov=True, overlap=False)
    assert relay.compression == CompressionSpec(codec="int8", error_feedback=True, block_size=256,
                                                density=0.0625, bits=2)
    host = HostSpec(host="h")
    assert (host.user, host.port, host.slots, host.key, host.reach_address) == (
        None, None, 1, None, "h")


def test_outer_defaults_follow_the_codec(tmp_path: Path) -> None:
    """Unset outer lr and momentum take the codec's (topk: 2.5 without momentum, its error
    feedback carries the past rounds; dense codecs: 0.6 / 0.5); set ones stay."""
    def sync(relay: str) -> SyncSpec:
        spec = parse_spec(BASE + relay, base_dir=tmp_path)
        assert spec.relay is not None
        return spec.relay.sync

    assert (sync("relay: {compression: topk}\n").outer_lr,
            sync("relay: {compression: topk}\n").outer_momentum) == (2.5, 0.0)
    assert (sync("relay: {compression: bf16}\n").outer_lr,
            sync("relay: {compression: bf16}\n").outer_momentum) == (0.6, 0.5)
    mine = sync("relay: {compression: topk, sync: {outer_lr: 1.5, outer_momentum: 0.3}}\n")
    assert (mine.outer_lr, mine.outer_momentum) == (1.5, 0.3)
    half = sync("relay: {compression: topk, sync: {outer_momentum: 0.5}}\n")
    assert (half.outer_lr, half.outer_momentum) == (2.5, 0.5)


def test_host_shorthand_strings(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, """\
        name: demo
        run: echo hi
        clusters:
          - name: east
            hosts: ["bob@h1:2222", h2, alice@h3, "[fe80::1]:22"]
        """))
    hosts = spec.clusters[0].hosts
    assert (hosts[0].user, hosts[0].host, hosts[0].port) == ("bob", "h1", 2222)
    assert (hosts[1].user, hosts[1].host, hosts[1].port) == (None, "h2", None)
    assert (hosts[2].user, hosts[2].host) == ("alice", "h3")
    assert (hosts[3].host, hosts[3].port) == ("fe80::1", 22)


def test_gateway_relay_address_and_worker_port(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, """\
        name: demo
        run: echo hi
        relay: {port: 5000, worker_port: 6000, compression: fp16}
        clusters:
          - name: east
            gateway: e2
            hosts: [e1, {host: e2, address: 10.0.0.2}]
        """))
    east = spec.clusters[0]
    assert east.gateway_host.host == "e2"
    assert east.effective_relay_address == "10.0.0.2"
    assert spec.relay is not None
    assert spec.relay.effective_worker_port == 6000
    assert spec.relay.compression.codec == "fp16" and spec.relay.compression.error_feedback


def test_single_cluster_relay_is_allowed(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, BASE + "relay: {}\n"))
    assert spec.relay == RelaySpec()


def test_key_path_is_expanded(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, BASE.replace("slots: 2", "key: ~/.ssh/id_x")))
    assert spec.clusters[0].hosts[0].key == os.path.expanduser("~/.ssh/id_x")
    assert not spec.clusters[0].hosts[0].key.startswith("~")


def test_yaml_anchors_and_merge_keys(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, """\
        name: demo
        run: echo hi
        clusters:
          - &base {name: east, transport: local, hosts: [a, b]}
          - <<: *base
            name: west
        """))
    assert [c.name for c in spec.clusters] == ["east", "west"]
    assert spec.clusters[1].transport == "local"


def test_env_values_coerced_to_strings_and_redacted(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, BASE + dedent("""\
        env:
          THREADS: 4
          RATIO: 0.5
          DEBUG: true
          QUIET: false
          NAME: x
          HF_TOKEN: hunter2
          db_password: hunter3
          AWS_SECRET_ACCESS_KEY: hunter4
          MyCredential: hunter5
        """)))
    assert spec.env["THREADS"] == "4" and spec.env["RATIO"] == "0.5"
    assert spec.env["DEBUG"] == "true" and spec.env["QUIET"] == "false"
    shown = spec.redacted_env()
    assert shown["THREADS"] == "4" and shown["NAME"] == "x"
    for key in ("HF_TOKEN", "db_password", "AWS_SECRET_ACCESS_KEY", "MyCredential"):
        assert shown[key] == "***"
    assert spec.redacted_env({"API_KEY": "s", "A": "b"}) == {"API_KEY": "***", "A": "b"}
    assert redact_env({"passwd": "p"}) == {"passwd": "***"}
    assert "hunter" not in repr(spec) and "hunter" not in str(spec)
    assert spec.env["HF_TOKEN"] == "hunter2"  # the real value is still there for the processes


def test_deepspeed_path_and_inline(tmp_path: Path) -> None:
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "ds.json").write_text(json.dumps({"train_batch_size": 8}))
    spec = load_spec(write(tmp_path, BASE + "workdir: code\ndeepspeed: ds.json\n"))
    assert spec.workdir == str((tmp_path / "code").resolve())
    assert spec.deepspeed_config() == {"train_batch_size": 8}
    inline = load_spec(write(tmp_path, BASE + "deepspeed: {train_batch_size: 4}\n"))
    config = inline.deepspeed_config()
    assert config == {"train_batch_size": 4}
    config["x"] = 1  # a copy: the spec is not changed through it
    assert inline.deepspeed_config() == {"train_batch_size": 4}


def test_round_trip(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text("{}")
    original = load_spec(write(tmp_path, """\
        name: demo
        run: python -u train.py
        setup: pip install -e .
        deepspeed: ds.json
        env: {A: 1, HF_TOKEN: t}
        max_restarts: 2
        clusters:
          - name: east
            jump: me@bastion:2200
            env: {B: x}
            hosts: ["u@e1:22", {host: e2, slots: 4, interface: eth1}]
          - name: west
            transport: local
            hosts: [w1]
        relay:
          sync: {mode: gradient, overlap: true}
          compression: {codec: bf16, error_feedback: false}
          shaping: {rate_mbit: 50, delay_ms: 20}
        checkpoint: {every: 10}
        """))
    dumped = yaml.safe_dump(original.model_dump())
    again = parse_spec(dumped, file="again.yaml", base_dir=tmp_path / "elsewhere")
    assert again.model_dump() == original.model_dump()
    assert again.clusters == original.clusters and again.relay == original.relay
    assert again.source == "again.yaml"


def test_parse_spec_without_file(tmp_path: Path) -> None:
    spec = parse_spec(BASE, base_dir=tmp_path)
    assert spec.source is None and spec.workdir == str(tmp_path.resolve())


@pytest.mark.parametrize("name", ["hello.yaml", "job.yaml"])
def test_templates_load(name: str) -> None:
    spec = load_spec(REPO / "templates" / name)
    assert len(spec.clusters) == 2
    assert Path(spec.workdir).is_dir()


def test_hello_template_shape() -> None:
    spec = load_spec(REPO / "templates" / "hello.yaml")
    assert [c.name for c in spec.clusters] == ["east", "west"]
    assert all(c.transport == "local" for c in spec.clusters)
    assert [[h.host for h in c.hosts] for c in spec.clusters] == [["e1", "e2"], ["w1", "w2"]]
    assert all(h.slots == 1 for c in spec.clusters for h in c.hosts)
    assert spec.relay is None and spec.deepspeed is None


def test_job_template_shape() -> None:
    spec = load_spec(REPO / "templates" / "job.yaml")
    assert Path(spec.workdir) == (REPO / "examples" / "gpt").resolve()
    assert spec.run == "python -u train.py"
    assert isinstance(spec.deepspeed_config(), dict)
    assert spec.relay is not None and spec.checkpoint is not None
    assert spec.clusters[0].jump and len(spec.clusters[0].hosts) == 2


# ---- errors: each with exact position and field path ----------------------------------------


def test_error_is_one_spec_error_with_every_problem(tmp_path: Path) -> None:
    found = problems(tmp_path, """\
        name: demo
        run: echo hi
        clusters:
          - name: east
            transport: sh
            hosts:
              - host: e1
                slot: 2
              - {host: e2, slots: 0}
        """)
    assert [where(p) for p in found] == [
        (5, 16, "clusters[0].transport"),
        (8, 9, "clusters[0].hosts[0].slot"),
        (9, 27, "clusters[0].hosts[1].slots"),
    ]
    assert found[0].message == "expected one of 'local', 'ssh', 'openssh', found 'sh'"
    assert found[1].message == "unknown key 'slot'; did you mean 'slots'?"
    assert found[2].message == "expected an integer >= 1, found 0"
    with pytest.raises(UsageError) as info:
        load_spec(tmp_path / "job.yaml")
    path = tmp_path / "job.yaml"
    assert str(info.value).splitlines() == [
        f"{path}:5:16: clusters[0].transport: expected one of 'local', 'ssh', 'openssh', "
        "found 'sh'",
        f"{path}:8:9: clusters[0].hosts[0].slot: unknown key 'slot'; did you mean 'slots'?",
        f"{path}:9:27: clusters[0].hosts[1].slots: expected an integer >= 1, found 0",
    ]
    assert info.value.exit_code == 2


def test_unknown_key_at_top_and_without_close_match(tmp_path: Path) -> None:
    found = problems(tmp_path, BASE + "relya: {}\nzzz: 1\n")
    assert [where(p) for p in found] == [(9, 1, "relya"), (10, 1, "zzz")]
    assert found[0].message == "unknown key 'relya'; did you mean 'relay'?"
    assert found[1].message.startswith("unknown key 'zzz'; known keys: name, workdir")


def test_unknown_key_in_nested_relay_section(tmp_path: Path) -> None:
    p = one(tmp_path, BASE + "relay:\n  sync:\n    inner_step: 5\n")
    assert where(p) == (11, 5, "relay.sync.inner_step")
    assert p.message == "unknown key 'inner_step'; did you mean 'inner_steps'?"


def test_wrong_types(tmp_path: Path) -> None:
    found = problems(tmp_path, """\
        name: demo
        run: echo hi
        grace: soon
        clusters:
          - name: east
            hosts:
              - {host: e1, slots: "2", port: 70000}
              - {host: e2, slots: true}
              - host: 5
        relay: {sync: {outer_momentum: 1.0}, timeout: 0, compression: {codec: int9}}
        """)
    got = {p.field: (p.line, p.col, p.message) for p in found}
    assert got == {
        "grace": (3, 8, "expected a number, found 'soon'"),
        "clusters[0].hosts[0].slots": (7, 27, "expected an integer, found '2'"),
        "clusters[0].hosts[0].port": (7, 38, "expected an integer <= 65535, found 70000"),
        "clusters[0].hosts[1].slots": (8, 27, "expected an integer, found true"),
        "clusters[0].hosts[2].host": (9, 15, "expected a string, found 5"),
        "relay.sync.outer_momentum": (10, 32, "expected a number < 1, found 1.0"),
        "relay.timeout": (10, 47, "expected a number > 0, found 0"),
        "relay.compression.codec": (
            10, 71, "expected one of 'none', 'fp16', 'bf16', 'int8', 'topk', 'auto', found 'int9'"),
    }


def test_bad_names(tmp_path: Path) -> None:
    found = problems(tmp_path, BASE.replace("demo", "My Job").replace("east", "-east"))
    assert [where(p) for p in found] == [(1, 7, "name"), (4, 11, "clusters[0].name")]
    assert found[0].message.startswith("expected a name of 1-32 characters: lowercase letters")
    assert found[0].message.endswith("found 'My Job'")


def test_missing_required_keys_point_at_parent(tmp_path: Path) -> None:
    found = problems(tmp_path, """\
        name: demo
        clusters:
          - name: east
          - hosts: [a]
        """)
    assert [(where(p), p.message) for p in found] == [
        ((1, 1, "run"), "missing required key 'run'"),
        ((3, 5, "clusters[0].hosts"), "missing required key 'hosts'"),
        ((4, 5, "clusters[1].name"), "missing required key 'name'"),
    ]


def test_empty_lists(tmp_path: Path) -> None:
    p = one(tmp_path, "name: demo\nrun: x\nclusters:\n  - name: east\n    hosts: []\n")
    assert where(p) == (5, 12, "clusters[0].hosts")
    assert p.message == "a cluster needs at least one host"
    p = one(tmp_path, "name: demo\nrun: x\nclusters: []\n")
    assert (where(p), p.message) == ((3, 11, "clusters"), "a job needs at least one cluster")


def test_empty_run_and_wrong_container_types(tmp_path: Path) -> None:
    found = problems(tmp_path, """\
        name: demo
        run: ""
        env: [A]
        clusters:
          - name: east
            hosts: e1
        """)
    assert [(where(p), p.message) for p in found] == [
        ((2, 6, "run"), "expected a non-empty string, found ''"),
        ((3, 6, "env"), "expected a mapping, found a list"),
        ((6, 12, "clusters[0].hosts"), "expected a list, found 'e1'"),
    ]


def test_bad_host_shorthand(tmp_path: Path) -> None:
    found = problems(tmp_path, """\
        name: demo
        run: echo hi
        clusters:
          - name: east
            hosts: ["a b", "u@h:0"]
            jump: "a@@b"
        """)
    assert [where(p) for p in found] == [
        (5, 13, "clusters[0].hosts[0]"),
        (5, 20, "clusters[0].hosts[1].port"),
        (6, 11, "clusters[0].jump"),
    ]
    assert found[0].message == "expected 'host', 'user@host' or 'user@host:port', found 'a b'"
    assert found[1].message == "expected an integer >= 1, found 0"
    assert found[2].message.startswith(
        "expected [user@]host[:port] or an ssh_config alias, found 'a@@b'")


def test_bad_compression_shorthand(tmp_path: Path) -> None:
    p = one(tmp_path, BASE + "relay:\n  compression: zip\n")
    assert where(p) == (10, 16, "relay.compression.codec")
    assert p.message == ("expected one of 'none', 'fp16', 'bf16', 'int8', 'topk', 'auto', "
                         "found 'zip'")


def test_yaml_syntax_errors(tmp_path: Path) -> None:
    p = one(tmp_path, "name: demo\n  run: x\n")
    assert (p.line, p.col) == (2, 6)
    assert p.message == "invalid YAML: mapping values are not allowed here"
    p = one(tmp_path, "name: demo\nrun: [a, b\n")
    assert (p.line, p.col) == (3, 1)
    assert p.message.startswith("invalid YAML: while parsing a flow sequence")
    p = one(tmp_path, "name: demo\nrun: !!python/object:os.system x\n")
    assert (p.line, p.col) == (2, 6) and "could not determine a constructor" in p.message


def test_empty_and_non_mapping_files(tmp_path: Path) -> None:
    for text in ("", "# nothing here\n"):
        p = one(tmp_path, text)
        assert (p.line, p.col) == (1, 1)
        assert p.message.startswith("the spec is empty; expected a mapping")
    p = one(tmp_path, "- a\n- b\n")
    assert (p.line, p.col, p.message) == (
        1, 1, "expected a mapping (name:, run:, clusters:, ...) at the top level, found a list")


def test_duplicate_keys(tmp_path: Path) -> None:
    found = problems(tmp_path, BASE + "name: other\n")
    assert [(where(p), p.message) for p in found] == [
        ((9, 1, "name"), "duplicate key 'name' (first at line 1)")]
    twice = "        slots: 2\n        slots: 3\n"
    found = problems(tmp_path, BASE.replace("        slots: 2\n", twice))
    assert [where(p) for p in found] == [(8, 9, "clusters[0].hosts[0].slots")]


def test_unreadable_spec_files(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path / "missing.yaml")
    assert str(info.value) == f"{tmp_path / 'missing.yaml'}: cannot read the spec: no such file"
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path)
    assert "is a directory" in info.value.problems[0].message
    (tmp_path / "bin.yaml").write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path / "bin.yaml")
    bad = info.value.problems[0]
    assert "is not valid UTF-8: byte 0xff" in bad.message and (bad.line, bad.col) == (1, 7)
