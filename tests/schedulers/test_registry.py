"""One registry of schedulers: a scheduler is its package plus one line in `PACKAGES`, and the
spec's names and sections, the allocators and the nodes' transport kinds follow from it. Shown
with the skeleton `dummy` scheduler (tests/helpers/dummy_scheduler/), registered in a fresh
interpreter (the spec's model is built from the registry when `nebula_cli.config` loads)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from helpers.jobs import REPO

from nebula_cli.config.schedulers.registry import SCHEDULERS
from nebula_cli.config.spec import parse_spec
from nebula_cli.errors import SpecError
from nebula_cli.scheduler.registry import ALLOCATORS
from nebula_cli.schedulers import registry
from nebula_cli.transport.registry import KINDS

PROBE = textwrap.dedent("""
    import json
    from nebula_cli.schedulers import registry
    registry.PACKAGES.append("helpers.dummy_scheduler")  # the registration line

    from nebula_cli.config.schedulers.registry import SCHEDULERS
    from nebula_cli.config.spec import parse_spec
    from nebula_cli.errors import SpecError
    from nebula_cli.scheduler.registry import ALLOCATORS
    from nebula_cli.transport.registry import KINDS

    def spec(cluster):
        return parse_spec(f"name: j\\nrun: x\\nclusters:\\n  - {cluster}\\n").clusters[0]

    def problems(cluster):
        try:
            spec(cluster)
        except SpecError as exc:
            return {p.field: p.message for p in exc.problems}
        return {}

    c = spec("{name: pods, hosts: [k8s], scheduler: dummy, dummy: {pods: 3}}")
    plain = spec("{name: pods, hosts: [k8s], scheduler: dummy}")
    print(json.dumps({
        "names": list(SCHEDULERS), "nodes": c.node_count, "ranks": c.process_count,
        "default_pods": plain.node_count, "summary": c.scheduling.summary(c),
        "checkpoints": [c.scheduling.checkpoint_host(c, i)
                        for i in c.scheduling.checkpoint_places(c, c.hosts[0])],
        "rank_env": c.scheduling.rank_env(c, 2, 0),
        "too_many_pods": problems("{name: p, hosts: [k], scheduler: dummy, dummy: {pods: 9}}"),
        "on_slurm": problems("{name: p, hosts: [k], scheduler: slurm, dummy: {pods: 2}}"),
        "slurm_on_dummy": problems("{name: p, hosts: [k], scheduler: dummy, slurm: {}}"),
        "two_hosts": problems("{name: p, hosts: [a, b], scheduler: dummy}"),
        "allocators": sorted(ALLOCATORS), "kinds": sorted(KINDS)}))
""")


def test_a_scheduler_is_its_package_and_one_registry_line() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         cwd=REPO / "tests", timeout=120)
    assert out.returncode == 0, out.stderr
    said = json.loads(out.stdout)
    assert said["names"] == ["none", "slurm", "dummy"]
    assert (said["nodes"], said["ranks"], said["default_pods"]) == (3, 3, 2)
    assert said["summary"] == "3 dummy pod(s)"
    assert said["checkpoints"] == ["pod0", "pod1", "pod2"]
    assert said["rank_env"] == {"DUMMY_POD": "2"}
    assert list(said["too_many_pods"]) == ["clusters[0].dummy.pods"]
    assert said["on_slurm"] == {"clusters[0].dummy": "`dummy:` needs `scheduler: dummy` in "
                                                     "this cluster"}
    assert said["slurm_on_dummy"] == {"clusters[0].slurm": "`slurm:` needs `scheduler: slurm` "
                                                           "in this cluster"}
    assert said["two_hosts"] == {"clusters[0].hosts": "a dummy cluster has one host"}
    assert said["allocators"] == sorted(ALLOCATORS)  # it allocates nothing: no allocator
    assert said["kinds"] == sorted(KINDS)  # nor a transport kind of its own


def test_without_its_line_the_spec_knows_no_such_scheduler() -> None:
    assert list(SCHEDULERS) == ["none", "slurm"]
    with pytest.raises(SpecError) as info:
        parse_spec("name: j\nrun: x\nclusters:\n  - {name: p, hosts: [k], scheduler: dummy, "
                   "dummy: {pods: 3}}\n")
    fields = {p.field for p in info.value.problems}
    assert "clusters[0].scheduler" in fields and "clusters[0].dummy" in fields, fields


def test_a_package_without_its_scheduler_module_is_refused_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "PACKAGES", [*registry.PACKAGES, "helpers"])
    with pytest.raises(ImportError, match="scheduler package helpers has no scheduler module"):
        registry.parts("scheduler", required=True)
    assert [m.__name__ for m in registry.parts("node_conn")] == [
        "nebula_cli.schedulers.slurm.node_conn"]
