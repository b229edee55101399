"""Hostile spec files: every file gets a located SpecError or a valid JobSpec, quickly, with
bounded memory, never a traceback. Explicit cases for each kind, a hypothesis fuzz of the loader,
and `nebula validate FILE` run as a subprocess."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest
import yaml
from helpers.jobs import CLI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nebula_cli.config import specfile
from nebula_cli.config import yaml_positions as yp
from nebula_cli.config.spec import JobSpec, load_spec
from nebula_cli.errors import SpecError

TIME_BOUND = 2.0  # CPU seconds per file, in-process (this thread's: a loaded machine's waits
# are not counted)
BASE = """\
name: demo
run: echo hi
clusters:
  - name: east
    hosts: [e1, e2]
"""

BOMB = "\n".join(
    [f"l0: &l0 [{', '.join(['lol'] * 9)}]"]
    + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]) + "\n"
_NINE = "[" + ", ".join(["*m{0}"] * 9) + "]"
MERGE_BOMB = "\n".join(
    ["m0: &m0 {" + ", ".join(f"k{i}: {i}" for i in range(9)) + "}"]
    + [f"m{i}: &m{i} {{<<: {_NINE.format(i - 1)}, v{i}: {_NINE.format(i - 1)}}}"
       for i in range(1, 8)]) + "\n"


def outcome(path: Path) -> tuple[JobSpec | SpecError, float]:
    """load_spec's answer (a spec or the SpecError) and the CPU time it took; anything else
    fails."""
    start = time.thread_time()
    try:
        answer: JobSpec | SpecError = load_spec(path)
    except SpecError as exc:
        answer = exc
    return answer, time.thread_time() - start


def refused(tmp_path: Path, data: bytes | str, name: str = "job.yaml") -> SpecError:
    path = tmp_path / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    answer, took = outcome(path)
    assert isinstance(answer, SpecError), f"accepted as valid: {data[:200]!r}"
    assert took < TIME_BOUND, f"took {took:.2f} s"
    assert answer.problems and all(p.file == str(path) for p in answer.problems)
    return answer.problems[0]


# ---- expansion bombs, depth, size --------------------------------------------------------------


def test_billion_laughs_is_refused_fast_and_small(tmp_path: Path) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    p = refused(tmp_path, BASE + BOMB)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert f"expands to more than {yp.MAX_VALUES} values" in p.message
    assert p.line is not None and p.line > 5  # at a node of the bomb, not at the top
    assert grown_mb < 100


def test_merge_key_bomb_and_recursive_merge(tmp_path: Path) -> None:
    p = refused(tmp_path, BASE + MERGE_BOMB)
    assert "expands to more than" in p.message
    p = refused(tmp_path, BASE + "x: &x {<<: *x}\n")
    assert "recursive" in p.message and p.line == 6


def test_anchors_within_budget_still_work(tmp_path: Path) -> None:
    text = BASE + "env: &e {A: 1}\nrelay: {sync: {inner_steps: 5}}\n"
    (tmp_path / "ok.yaml").write_text(text)
    answer, _ = outcome(tmp_path / "ok.yaml")
    assert isinstance(answer, JobSpec) and answer.env == {"A": "1"}


@pytest.mark.parametrize("opener, closer", [("[", "]"), ("{a: ", "}"), ("- ", "")])
def test_deep_nesting_is_refused_before_recursing(tmp_path: Path, opener: str, closer: str
                                                  ) -> None:
    if opener == "- ":
        text = "".join("  " * i + "-\n" for i in range(200))
    else:
        text = "x: " + opener * 40_000 + closer * 40_000 + "\n"
    p = refused(tmp_path, text)
    assert p.message == f"nested more than {yp.MAX_DEPTH} levels deep"
    assert p.line is not None and p.col is not None


def test_deep_nesting_through_aliases(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x]"] + [f"a{i}: &a{i} [*a{i - 1}]" for i in range(1, 60)]
    p = refused(tmp_path, BASE + "\n".join(lines) + "\n")
    assert "levels deep" in p.message


def test_huge_files(tmp_path: Path) -> None:
    p = refused(tmp_path, BASE + "# " + "x" * specfile.MAX_SPEC_BYTES + "\n")
    assert "larger than 256 KiB" in p.message
    many = BASE + "exclude: [" + ", ".join(["a"] * (yp.MAX_VALUES + 10)) + "]\n"
    p = refused(tmp_path, many[:specfile.MAX_SPEC_BYTES])
    assert f"more than {yp.MAX_VALUES} values" in p.message and p.line == 6


def test_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)
    answer, took = outcome(fifo)  # no writer: must not block
    assert isinstance(answer, SpecError) and "not a regular file" in answer.problems[0].message
    answer, took = outcome(Path("/dev/zero"))
    assert isinstance(answer, SpecError) and took < TIME_BOUND


def test_files_the_spec_names_are_bounded_too(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "ds.fifo")
    p = refused(tmp_path, BASE + "deepspeed: ds.fifo\n")
    assert p.field == "deepspeed" and "not a regular file" in p.message
    p = refused(tmp_path, BASE + "deepspeed: /dev/zero\n")
    assert p.field == "deepspeed" and "not a regular file" in p.message
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    p = refused(tmp_path, BASE + "deepspeed: deep.json\n")
    assert p.field == "deepspeed" and "nested too deeply" in p.message
    p = refused(tmp_path, BASE + "workdir: ~no-such-user-xyz/x\n")
    assert p.field == "workdir"


# ---- characters and encodings -----------------------------------------------------------------


def test_raw_control_characters(tmp_path: Path) -> None:
    p = refused(tmp_path, BASE.replace("run: echo hi", "run: echo\x07hi"))
    assert (p.line, p.col) == (2, 10) and "U+0007" in p.message


@pytest.mark.parametrize("escape, code", [("\\0", "U+0000"), ("\\e[31m", "U+001B"),
                                          ("\\x7f", "U+007F"), ("\\N", "U+0085")])
def test_escaped_control_characters_in_values_and_keys(tmp_path: Path, escape: str, code: str
                                                       ) -> None:
    p = refused(tmp_path, BASE.replace("run: echo hi", f'run: "echo {escape}hi"'))
    assert (p.line, p.col, p.field) == (2, 6, "run") and code in p.message
    p = refused(tmp_path, BASE + f'env: {{"A{escape}": x}}\n')
    assert p.line == 6 and code in p.message and "in a key" in p.message


def test_tabs_and_newlines_are_fine(tmp_path: Path) -> None:
    (tmp_path / "ok.yaml").write_text(BASE.replace("run: echo hi", 'run: "echo\\ta\\nb"'))
    answer, _ = outcome(tmp_path / "ok.yaml")
    assert isinstance(answer, JobSpec) and answer.run == "echo\ta\nb"


@pytest.mark.parametrize("data, where, words", [
    (b"name: demo\nrun: \xff\xfe\n", (2, 6), "not valid UTF-8: byte 0xff"),
    (b"name: d\xc3mo\n", (1, 8), "not valid UTF-8"),
    ("name: demo\n".encode("utf-16"), (1, 1), "UTF-16"),
    (b"name: demo\nrun: \xed\xa0\x80\n", (2, 6), "not valid UTF-8"),  # a UTF-8 surrogate
])
def test_invalid_encodings_are_located(tmp_path: Path, data: bytes, where: tuple[int, int],
                                       words: str) -> None:
    p = refused(tmp_path, data)
    assert (p.line, p.col) == where and words in p.message


@pytest.mark.parametrize("text, words", [
    ("x: !!int abc\n", "cannot read 'abc' as int"),
    ("x: " + "1" * 6000 + "\n", "as int"),
    ("x: !!timestamp soon\n", "as timestamp"),
    ("x: !!python/object:os.system x\n", "could not determine a constructor"),
    ("? [a]\n: b\n", "mapping keys must be plain scalars"),
    ("a: 1\n---\nb: 2\n", "expected a single document"),
])
def test_odd_yaml_values_are_located_errors(tmp_path: Path, text: str, words: str) -> None:
    p = refused(tmp_path, text)
    assert words in p.message and p.line is not None


def test_non_finite_and_huge_numbers(tmp_path: Path) -> None:
    p = refused(tmp_path, BASE + "grace: .inf\n")
    assert p.field == "grace" and "finite" in p.message
    p = refused(tmp_path, BASE + "relay: {timeout: .nan}\n")
    assert p.field == "relay.timeout"
    p = refused(tmp_path, BASE.replace("[e1, e2]", "[{host: e1, slots: 100000000000}]"))
    assert p.field == "clusters[0].hosts[0].slots"


# ---- what ends up in a command or a connection -----------------------------------------------


HOSTILE_VALUES = ["a b", "a;b", "$(id)", "a`id`", "a'b", 'a"b', "-oProxyCommand=sh", "a|b",
                  "a&b", "a\\b", "a>b", "${HOME}", "a\tb", "../etc", "a/b", ""]


@pytest.mark.parametrize("value", HOSTILE_VALUES)
@pytest.mark.parametrize("field, template", [
    ("clusters[0].hosts[0].host", "hosts: [{{host: {v}}}]"),
    ("clusters[0].hosts[0].user", "hosts: [{{host: e1, user: {v}}}]"),
    ("clusters[0].hosts[0].address", "hosts: [{{host: e1, address: {v}}}]"),
    ("clusters[0].hosts[0].interface", "hosts: [{{host: e1, interface: {v}}}]"),
    ("clusters[0].gateway", "hosts: [e1]\n    gateway: {v}"),
    ("clusters[0].jump", "hosts: [e1]\n    jump: {v}"),
    ("clusters[0].relay_address", "hosts: [e1]\n    relay_address: {v}"),
    ("clusters[0].interface", "hosts: [e1]\n    interface: {v}"),
    ("clusters[0].python", "hosts: [e1]\n    python: {v}"),
])
def test_hostile_names_are_refused_where_they_reach_commands(
        tmp_path: Path, field: str, template: str, value: str) -> None:
    if value in ("../etc", "a/b") and field.endswith("python"):
        pytest.skip("a path is what python: holds")
    text = BASE.replace("hosts: [e1, e2]", template.format(v=json.dumps(value)))
    p = refused(tmp_path, text)
    assert p.field is not None and p.field.startswith(field), (p.field, p.message)
    assert p.line is not None and p.col is not None


@pytest.mark.parametrize("value", ["~/.ssh/authorized_keys\n", "/home/me/keys\n"])
def test_a_path_with_a_trailing_newline_is_refused(tmp_path: Path, value: str) -> None:
    text = BASE.replace("hosts: [e1, e2]", f"hosts: [e1]\n    authorized_keys: {json.dumps(value)}")
    p = refused(tmp_path, text)
    assert p.field == "clusters[0].authorized_keys" and "absolute path" in p.message, p


def test_shorthand_with_hostile_parts(tmp_path: Path) -> None:
    p = refused(tmp_path, BASE.replace("[e1, e2]", '["$(id)@e1"]'))
    assert p.field == "clusters[0].hosts[0].user" and "'$' is not allowed" in p.message


@pytest.mark.parametrize("value, field", [
    ("e1.example.com", "host"), ("10.0.0.1", "host"), ("::1", "host"), ("fe80::1%eth0", "host"),
    ("gpu_box-3", "host"), ("alice", "user"), ("svc.train-1", "user"), ("ens5", "interface"),
    ("^docker,lo", "interface"), ("eth0.100", "interface"),
])
def test_real_names_still_pass(tmp_path: Path, value: str, field: str) -> None:
    host = f"{{host: e1, {field}: '{value}'}}" if field != "host" else f"{{host: '{value}'}}"
    (tmp_path / "ok.yaml").write_text(BASE.replace("[e1, e2]", f"[{host}]"))
    answer, _ = outcome(tmp_path / "ok.yaml")
    assert isinstance(answer, JobSpec), answer


@pytest.mark.parametrize("jump", ["bastion", "me@bastion", "me@bastion:2222", "[::1]:22",
                                  "10.1.2.3"])
def test_real_jumps_and_pythons_pass(tmp_path: Path, jump: str) -> None:
    text = BASE.replace("hosts: [e1, e2]", f"hosts: [e1]\n    jump: '{jump}'\n"
                        "    python: /opt/conda/envs/train-3.11/bin/python3")
    (tmp_path / "ok.yaml").write_text(text)
    answer, _ = outcome(tmp_path / "ok.yaml")
    assert isinstance(answer, JobSpec), answer


# ---- fuzz: random YAML documents and byte strings ------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                    st.text(max_size=30), st.sampled_from(["e1", "local", "ssh", "int8", "1e9"]))
keys = st.one_of(st.sampled_from(["name", "run", "clusters", "hosts", "host", "slots", "relay",
                                  "sync", "env", "transport", "port", "jump", "user", "python",
                                  "parallelism", "pipeline_stages", "workdir", "deepspeed",
                                  "compression", "lifetime_days", "placement", "<<"]),
                 st.text(max_size=10))
documents = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(keys, inner, max_size=6)), max_leaves=40)


def spec_like() -> st.SearchStrategy[dict]:
    """Documents near a valid spec: the base with random values put in at known keys."""
    host = st.one_of(st.text(max_size=12), st.sampled_from(["e1", "a b", "$(x)", "::1"]),
                     documents)
    cluster = st.fixed_dictionaries({"name": st.one_of(st.just("east"), documents),
                                     "hosts": st.lists(host, max_size=3)},
                                    optional={"transport": documents, "jump": host,
                                              "python": host, "interface": host})
    return st.fixed_dictionaries({"name": st.just("demo"), "run": st.just("x"),
                                  "clusters": st.lists(cluster, max_size=3)},
                                 optional={"relay": documents, "env": documents,
                                           "parallelism": documents, "lifetime_days": scalars})


def check_any(path: Path) -> None:
    answer, took = outcome(path)
    assert took < TIME_BOUND, f"{took:.2f} s for {path.read_bytes()[:300]!r}"
    if isinstance(answer, SpecError):
        assert answer.problems and all(p.file for p in answer.problems)
        assert all(p.line is not None or "read" in p.message or "larger" in p.message
                   for p in answer.problems), [str(p) for p in answer.problems]


FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(doc=st.one_of(documents, spec_like()))
def test_fuzz_random_yaml_documents(tmp_path: Path, doc: object) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    check_any(path)


@FUZZ
@given(data=st.one_of(st.binary(max_size=400),
                      st.builds(lambda b, cut, junk: b[:cut] + junk + b[cut:],
                                st.just((BASE + BOMB).encode()), st.integers(0, 400),
                                st.binary(max_size=8)),
                      st.text(alphabet=st.sampled_from(list("[]{}&*!|>-:?,'\"#\n \t%@`ab01")),
                              max_size=200).map(str.encode)))
def test_fuzz_random_bytes(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(data)
    check_any(path)


# ---- the command line ----------------------------------------------------------------------------

CLI_CASES = {
    "bomb": BASE + BOMB,
    "deep": "x: " + "[" * 50_000 + "]" * 50_000 + "\n",
    "control": BASE.replace("echo hi", '"echo \\e[2J hi"'),
    "encoding": b"name: demo\nrun: \xff\n",
    "host": BASE.replace("[e1, e2]", "['e1; rm -rf ~']"),
    "jump": BASE.replace("hosts: [e1, e2]", "hosts: [e1]\n    jump: 'b`id`'"),
    "huge": BASE + "#" * (specfile.MAX_SPEC_BYTES + 1) + "\n",
    "bigint": "x: " + "9" * 6000 + "\n",
}


@pytest.mark.parametrize("kind", sorted(CLI_CASES))
def test_nebula_validate_answers_hostile_files(tmp_path: Path, cli: CLI, kind: str) -> None:
    data = CLI_CASES[kind]
    path = tmp_path / f"{kind}.yaml"
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    start = time.monotonic()
    proc = cli("validate", str(path), timeout=60)
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.startswith(f"{path}:"), proc.stderr
    assert took < 15, f"nebula validate took {took:.1f} s"  # process start-up included
