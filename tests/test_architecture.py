"""The package's shape: docs/architecture.md names every module under its folder with its one
job (and nothing that is gone), no import runs up a layer, and variants (transport kinds,
schedulers) are routed by name in one place."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers.jobs import REPO

PACKAGE = REPO / "nebula_cli"
ARCHITECTURE = REPO / "docs" / "architecture.md"


def _documented_modules() -> dict[str, str]:
    """{"nebula_cli/relay/net/wire.py": its one job} from the doc's "Every module" section."""
    text = ARCHITECTURE.read_text()
    assert "\n## Every module\n" in text, "docs/architecture.md has no 'Every module' section"
    section = text.split("\n## Every module\n", 1)[1].split("\n## ", 1)[0]
    found: dict[str, str] = {}
    folder = None
    for line in section.splitlines():
        if m := re.fullmatch(r"### `(nebula_cli(?:/[\w]+)*)/`", line.strip()):
            folder = m.group(1)
        elif m := re.match(r"- `([\w]+\.py)`: (.*)", line):
            assert folder, f"a module before any folder: {line}"
            found[f"{folder}/{m.group(1)}"] = m.group(2).strip()
    return found


def _modules() -> set[str]:
    return {str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
            if p.name != "__init__.py" and "__pycache__" not in p.parts}


def test_the_architecture_names_every_module_and_nothing_that_is_gone() -> None:
    documented, present = _documented_modules(), _modules()
    missing = sorted(present - set(documented))
    gone = sorted(set(documented) - present)
    assert not missing, ("modules missing from docs/architecture.md's 'Every module' (`python3 "
                         f"scripts/list-modules.py` prints lines to start from): {missing}")
    assert not gone, f"docs/architecture.md names modules that are gone: {gone}"


def test_every_module_says_its_one_job() -> None:
    no_job = sorted(m for m, job in _documented_modules().items() if len(job) < 8)
    no_doc = sorted(m for m in _modules()
                    if not ast.get_docstring(ast.parse((REPO / m).read_text())))
    assert not no_job, f"modules listed without their job: {no_job}"
    assert not no_doc, f"modules without a docstring: {no_doc}"


def _compares_to_transport_names(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            consts = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
            if any(c.value in ("local", "ssh") for c in consts):
                lines.append(node.lineno)
    return lines


def test_no_transport_branch_in_the_plan_or_the_control_plane() -> None:
    files = [PACKAGE / "config" / "jobplan.py", *sorted((PACKAGE / "control").glob("*.py"))]
    found = {f.name: lines for f in files
             if (lines := _compares_to_transport_names(ast.parse(f.read_text())))}
    assert not found, f"`== 'local'`-style branches: {found}"


VARIANT_HOMES = ("config/schedulers/", "scheduler/", "schedulers/", "transport/")
"""Where schedulers and transport kinds are implemented and routed by name (registries)."""


def _names_a_variant(node: ast.AST) -> bool:
    """A comparison with a scheduler's or a transport kind's name, or a look at Slurm's
    environment (`SLURM_JOB_ID`, ...)."""
    if isinstance(node, ast.Compare):
        consts = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
        return any(c.value in ("slurm", "slurm-node") for c in consts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str) \
        and node.value.startswith("SLURM_JOB")


def test_schedulers_and_transport_kinds_are_routed_by_name_in_one_place() -> None:
    found = {str(f.relative_to(PACKAGE)): lines for f in sorted(PACKAGE.rglob("*.py"))
             if not str(f.relative_to(PACKAGE)).startswith(VARIANT_HOMES)
             and (lines := [n.lineno for n in ast.walk(ast.parse(f.read_text()))
                            if _names_a_variant(n)])}
    assert not found, f"`scheduler == 'slurm'`-style branches outside their registries: {found}"


def test_job_roles_are_asked_not_compared() -> None:
    """A cluster's role answers what it does (`RoleKind.averages`, `serves_labels`, `trains`):
    no `role == "teacher"` outside config/roles/."""
    found = {str(f.relative_to(PACKAGE)): lines for f in sorted(PACKAGE.rglob("*.py"))
             if not str(f.relative_to(PACKAGE)).startswith("config/roles/")
             and (lines := [n.lineno for n in ast.walk(ast.parse(f.read_text()))
                            if isinstance(n, ast.Compare) and any(
                                isinstance(c, ast.Constant) and c.value in ("train", "teacher")
                                for c in [n.left, *n.comparators])])}
    assert not found, f"`role == 'teacher'`-style branches outside config/roles/: {found}"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.startswith("nebula_cli")}


FORBIDDEN = {
    "transport": ("nebula_cli.control", "nebula_cli.cli", "nebula_cli.config",
                  "nebula_cli.scheduler"),
    "scheduler": ("nebula_cli.control", "nebula_cli.cli", "nebula_cli.agent",
                  "nebula_cli.relay", "nebula_cli.runtime"),
    "agent": ("nebula_cli.control", "nebula_cli.cli", "nebula_cli.config.spec",
              "nebula_cli.config.jobplan", "nebula_cli.transport", "nebula_cli.relay",
              "nebula_cli.scheduler"),
    "relay": ("nebula_cli.control", "nebula_cli.cli", "nebula_cli.config.spec",
              "nebula_cli.config.jobplan", "nebula_cli.transport", "nebula_cli.runtime"),
    "runtime": ("nebula_cli.control", "nebula_cli.cli", "nebula_cli.config.spec",
                "nebula_cli.config.jobplan", "nebula_cli.transport"),
    "config": ("nebula_cli.control", "nebula_cli.cli", "nebula_cli.transport",
               "nebula_cli.relay", "nebula_cli.runtime", "nebula_cli.agent",
               "nebula_cli.scheduler"),
    "control": ("nebula_cli.cli",),
    "planner": ("nebula_cli.control", "nebula_cli.cli"),
}
"""What each folder may not import (a name, or a module below it)."""
SCHEDULER_MODULE_LAYERS = ((r"spec|scheduler", "config"),
                           (r"allocator|batch|manifests|\w+_cli", "scheduler"),
                           (r"node_\w+", "transport"), (r"keeper", "agent"))
"""A scheduler package (`nebula_cli/schedulers/<name>/`) holds one module per layer it serves,
each in that layer by its name: its spec section and what it means for the plan (config), its
allocator, the tools it drives and the objects it creates at launch (scheduler), how its nodes
are reached (transport), what runs on its nodes (agent)."""


CODEC_MODULE_LAYERS = ((r"params", "config"), (r"codec", "relay"))
"""A codec package (`nebula_cli/codecs/<name>/`): what the plan knows of its codecs (config,
standard library only) and their wire format (relay)."""


def _codec_module_layer(module: str) -> str:
    """The layer of `nebula_cli.codecs.<name>.<module>`."""
    layer = next((lay for pattern, lay in CODEC_MODULE_LAYERS
                  if re.fullmatch(pattern, module)), None)
    assert layer, (f"nebula_cli/codecs/*/{module}.py has no layer: name it after one of "
                   f"{[p for p, _ in CODEC_MODULE_LAYERS]} (tests/test_architecture.py)")
    return layer


def _scheduler_module_layer(module: str) -> str:
    """The layer of `nebula_cli.schedulers.<name>.<module>`."""
    layer = next((lay for pattern, lay in SCHEDULER_MODULE_LAYERS
                  if re.fullmatch(pattern, module)), None)
    assert layer, (f"nebula_cli/schedulers/*/{module}.py has no layer: name it after one of "
                   f"{[p for p, _ in SCHEDULER_MODULE_LAYERS]} (tests/test_architecture.py)")
    return layer


def _as_layer(name: str) -> str:
    """An imported module as the layers see it: a scheduler package's module is its layer's."""
    if m := re.fullmatch(r"nebula_cli\.schedulers\.\w+\.(\w+)(?:\.\w+)*", name):
        return f"nebula_cli.{_scheduler_module_layer(m.group(1))}"
    if m := re.fullmatch(r"nebula_cli\.codecs\.\w+\.(\w+)(?:\.\w+)*", name):
        return f"nebula_cli.{_codec_module_layer(m.group(1))}"
    return name


def _forbids(forbidden: tuple[str, ...], name: str) -> bool:
    name = _as_layer(name)
    return any(name == f or name.startswith(f"{f}.") for f in forbidden)


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_import_runs_up_a_layer(folder: str) -> None:
    files = [f for f in (PACKAGE / folder).rglob("*.py")]
    files += [f for f in (PACKAGE / "schedulers").glob("*/*.py") if f.name != "__init__.py"
              and _scheduler_module_layer(f.stem) == folder]
    files += [f for f in (PACKAGE / "codecs").glob("*/*.py") if f.name != "__init__.py"
              and _codec_module_layer(f.stem) == folder]
    bad = {f"{f.relative_to(PACKAGE)}: {name}" for f in files for name in _imports(f)
           if _forbids(FORBIDDEN[folder], name)}
    assert not bad, sorted(bad)


def test_a_scheduler_package_imports_nothing_of_its_own_when_loaded() -> None:
    """Its `__init__` imports nothing, so that a node loads its keeper alone (standard library
    only), and the registry names packages without importing them; a codec package's likewise
    (a host loads its `params` without torch), and a transport kind's."""
    inits = [*(PACKAGE / "schedulers").glob("*/__init__.py"),
             PACKAGE / "schedulers" / "__init__.py", PACKAGE / "schedulers" / "registry.py",
             *(PACKAGE / "codecs").glob("*/__init__.py"),
             PACKAGE / "codecs" / "__init__.py", PACKAGE / "codecs" / "registry.py",
             *(PACKAGE / "transport").glob("*/__init__.py")]
    imports = {str(f.relative_to(PACKAGE)): sorted(_imports(f)) for f in inits
               if f.exists() and _imports(f)}
    assert not imports, imports


def test_the_relay_process_asks_its_rounds_by_their_verbs() -> None:
    """relay/process/ (the relay's server and worker port) calls `Rounds`' own methods, never
    its parts (`rounds.state`, `rounds.control`, `rounds.recovery`)."""
    reach = []
    for path in sorted((PACKAGE / "relay" / "process").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in {"state", "control",
                                                                 "recovery"}:
                owner = node.value
                if (isinstance(owner, ast.Name) and owner.id == "rounds") or (
                        isinstance(owner, ast.Attribute) and owner.attr == "rounds"):
                    reach.append(f"{path.name}:{node.lineno} rounds.{node.attr}")
    assert not reach, f"the process layer reaches into Rounds' parts: {reach}"
