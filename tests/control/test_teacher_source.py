"""`teacher: {from_job:}` (control/teacher_source.py) on the local transport: the earlier
job's newest complete checkpoint found where that job kept it, said before launch from this
machine's records (a job that is not there, saved no checkpoints or has no such cluster is a
problem naming the fix), copied through the local cache a file at a time (a copy cut off goes
on with the files it lacks; a file that changes while copied is refused), and published on a
teacher's host with private files and the marker last."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nebula_cli.config.spec import parse_spec
from nebula_cli.control import teacher_source
from nebula_cli.control.session import Session
from nebula_cli.control.state import StateStore
from nebula_cli.errors import UsageError
from nebula_cli.transport.local.transport import LocalTransport

PHASE_A = {"name": "phase-a", "run": "python train.py", "relay": {},
           "checkpoint": {"dir": "ckpt"},
           "clusters": [{"name": "east", "transport": "local", "hosts": ["e1"]},
                        {"name": "west", "transport": "local", "hosts": ["w1"]}]}
PHASE_B = """\
name: phase-b
run: python train.py
relay: {}
distill: {}
clusters:
  - {name: lab, transport: local, hosts: [t1], role: teacher, run: python serve.py,
     teacher: {from_job: %s}}
  - {name: cloud, transport: local, hosts: [s1]}
"""


def phase_b(tmp_path: Path, ref: str, **teacher: str) -> object:
    text = PHASE_B % ref
    if teacher:
        text = text.replace(f"from_job: {ref}}}", f"from_job: {ref}, " + ", ".join(
            f"{k}: {v}" for k, v in teacher.items()) + "}")
    return parse_spec(text, base_dir=tmp_path)


def saved(store: StateStore, job_id: str, steps: dict[int, dict[str, bytes]],
          complete: tuple[int, ...]) -> Path:
    """Checkpoint tags of cluster east where its job keeps them (the local transport's home
    is the store's): ``steps`` step -> files, ``complete``: the steps with their marker."""
    folder = store.home / "jobs" / job_id / "ckpt" / "east" / "e1"
    for step, files in steps.items():
        for name, data in files.items():
            (folder / f"step{step}" / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / f"step{step}" / name).write_bytes(data)
        if step in complete:
            (folder / f"step{step}" / "COMPLETE").write_bytes(b"")
    return folder


def test_before_launch_the_source_is_said_or_its_problem_named(tmp_path: Path) -> None:
    with StateStore(tmp_path / "home") as store:
        bad, _ = teacher_source.source_problems(store, phase_b(tmp_path, "nope"))
        assert bad == ["lab: teacher.from_job: no job 'nope' (see `nebula status` for the jobs "
                       "there are)"]
        job = store.create_job("phase-a", dict(PHASE_A), None)
        bad, notes = teacher_source.source_problems(store, phase_b(tmp_path, "phase-a"))
        assert bad == [] and notes == [f"lab: serves job {job.id}'s newest complete checkpoint "
                                       "of cluster east (PENDING), copied from e1 at launch"]
        bad, _ = teacher_source.source_problems(store, phase_b(tmp_path, "phase-a",
                                                               from_cluster="south"))
        assert "has no training cluster 'south'" in bad[0] and "east, west" in bad[0]
        store.create_job("plain", {**PHASE_A, "name": "plain", "checkpoint": None}, None)
        bad, _ = teacher_source.source_problems(store, phase_b(tmp_path, "plain"))
        assert "saved no checkpoints (its spec has no `checkpoint:`)" in bad[0]


def test_the_newest_complete_tag_is_copied_resumably_and_published(tmp_path: Path) -> None:
    with StateStore(tmp_path / "home") as store, Session(store) as session:
        job = store.create_job("phase-a", dict(PHASE_A), None)
        files = {"mp_rank_00_model_states.pt": b"m" * 3000, "sub/nebula_outer.rank0.pt": b"o" * 10}
        saved(store, job.id, {10: {"old.pt": b"x"}, 20: files, 30: {"half.pt": b"h"}}, (10, 20))
        source = teacher_source.find_source(store, session.transport, "phase-a", None)
        assert (source.job_id, source.cluster, source.host, source.step) == (job.id, "east",
                                                                           "e1", 20)
        assert dict(source.files) == {"COMPLETE": 0, "mp_rank_00_model_states.pt": 3000,
                                      "sub/nebula_outer.rank0.pt": 10}
        assert "2.9 KB, 3 files, on e1" in source.said()
        cache = tmp_path / "cache"
        t = session.transport(source.conn)
        gets: list[str] = []
        real_get = t.get
        t.get = lambda remote, local: (gets.append(Path(remote).name), real_get(remote, local))
        said: list[str] = []
        # a copy cut off earlier: one file whole in the cache, one only partly
        local = cache / teacher_source.CACHE_DIR / job.id / "east" / "step20"
        (local / "sub").mkdir(parents=True)
        (local / "mp_rank_00_model_states.pt").write_bytes(b"m" * 3000)
        (local / "sub" / "nebula_outer.rank0.pt.part").write_bytes(b"o")
        assert teacher_source.fetch(source, t, cache, said.append) == local
        assert sorted(gets) == ["COMPLETE", "nebula_outer.rank0.pt"]  # only what it lacked
        assert said == [f"copying {source.said()}: 2.9 KB of it already here"]
        assert (local / "sub" / "nebula_outer.rank0.pt").read_bytes() == b"o" * 10
        gets.clear()
        assert teacher_source.fetch(source, t, cache, said.append) == local and gets == []

        host = LocalTransport("t1", home=str(tmp_path / "teacher"))
        order: list[str] = []
        real_put = host.put
        host.put = lambda a, b, mode=None: (order.append(Path(b).name), real_put(a, b, mode=mode))
        folder = teacher_source.place(source, local, host, str(tmp_path / "teacher" / "job"),
                                      "lab/t1", said.append)
        assert order[-1] == "COMPLETE"  # the marker last: a loader never takes half of it
        tag = Path(folder) / "step20"
        assert (tag / "mp_rank_00_model_states.pt").read_bytes() == b"m" * 3000
        for path in [Path(folder), *tag.rglob("*")]:
            mode = stat.S_IMODE(os.lstat(path).st_mode)
            assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


def test_a_file_that_changes_while_copied_is_refused(tmp_path: Path) -> None:
    with StateStore(tmp_path / "home") as store, Session(store) as session:
        job = store.create_job("phase-a", dict(PHASE_A), None)
        folder = saved(store, job.id, {5: {"w.pt": b"w" * 100}}, (5,))
        source = teacher_source.find_source(store, session.transport, job.id, "east")
        (folder / "step5" / "w.pt").write_bytes(b"w" * 50)  # rewritten since it was listed
        with pytest.raises(UsageError, match="came as 50 bytes, not 100"):
            teacher_source.fetch(source, session.transport(source.conn), tmp_path / "c",
                                 lambda _: None)
        empty = store.create_job("phase-a", dict(PHASE_A), None)
        with pytest.raises(UsageError, match="has no complete checkpoint in"):
            teacher_source.find_source(store, session.transport, empty.id, None)


def test_validate_hosts_says_what_a_launch_would_copy(tmp_path: Path) -> None:
    with StateStore(tmp_path / "home") as store, Session(store) as session:
        job = store.create_job("phase-a", dict(PHASE_A), None)
        spec = phase_b(tmp_path, "phase-a")
        found, bad = teacher_source.find_sources(store, session.transport, spec)
        assert found == [] and len(bad) == 1 and "has no complete checkpoint in" in bad[0]
        saved(store, job.id, {40: {"w.pt": b"w" * 2048}}, (40,))
        found, bad = teacher_source.find_sources(store, session.transport, spec)
        assert bad == [] and found == [f"lab: would serve job {job.id}'s checkpoint step40 of "
                                       "cluster east (2.0 KB, 2 files, on e1)"]


def test_a_zero_cluster_of_several_hosts_is_refused_before_anything_is_copied(
        tmp_path: Path) -> None:
    """Each host keeps only its own ranks' ZeRO partitions: one host's tag is no whole model."""
    zero = {**PHASE_A, "deepspeed": {"train_micro_batch_size_per_gpu": 1,
                                     "zero_optimization": {"stage": 2}},
            "clusters": [{"name": "east", "transport": "local", "hosts": ["e1", "e2"]},
                         {"name": "west", "transport": "local", "hosts": ["w1"]}]}
    with StateStore(tmp_path / "home") as store:
        store.create_job("phase-a", zero, None)
        bad, _ = teacher_source.source_problems(store, phase_b(tmp_path, "phase-a"))
        assert len(bad) == 1 and "ran ZeRO 2 on 2 hosts" in bad[0], bad
        assert "take a cluster of one host (teacher.from_cluster)" in bad[0]
        bad, notes = teacher_source.source_problems(store, phase_b(tmp_path, "phase-a",
                                                                   from_cluster="west"))
        assert bad == [] and "of cluster west" in notes[0]
