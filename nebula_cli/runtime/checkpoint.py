"""Checkpoints of a training process: DeepSpeed's own (``engine.save_checkpoint``) plus nebula's
outer state (each rank's shard of theta_global, outer momentum and anchor, with the round:
``OuterSync.saved_part``, ``runtime.outer_files``), saved every ``checkpoint.every`` optimizer
steps and at the end, on every host, and loaded at start.

Layout, in this host's directory (``CheckpointSettings.dir``, one per cluster and host: no
shared filesystem is assumed, DeepSpeed's ``use_node_local_storage`` is switched on so that
local rank 0 of every host writes the model states)::

    step<N>/            one complete checkpoint: DeepSpeed's files, each of this host's
                        ranks' nebula_outer.rank<r>.pt (runtime.outer_files), COMPLETE
    latest              the newest complete tag (written with os.replace; informational)
    .tmp-step<N>-<pid>  a checkpoint being published (never picked; removed at the next start)

Saving (``save``), on every rank of the DeepSpeed world:

1. the ranks agree (one all-reduce) that this host's directory is writable everywhere; if not,
   nobody saves, the error is logged and recorded (``checkpoint_error``) and training goes on;
2. ``engine.save_checkpoint`` writes into a staging directory in ``/dev/shm`` (host memory, as
   prime does) when it has room and the process runs under an agent, else into
   ``<dir>/.staging``. The directory in /dev/shm is private to the job's user, has a random
   name, and is recorded in the agent's folder, where the host's other ranks find it
   (`nebula_cli.config.staging`: other users share /dev/shm). This is the part that stalls
   training: DeepSpeed's save is synchronous (``torch.save`` in the training thread; its
   decoupled engines need a config given before ``deepspeed.initialize``). To tmpfs it costs
   about a memory copy of the model and optimizer states;
3. once every rank has written its files (one more all-reduce, which also says whether every
   rank's save succeeded: a checkpoint one rank could not write is published by nobody;
   before it, every rank wrote its own shard of the outer state into the staging tag, as it
   lies: no rank gathers it), local rank 0 of each host publishes in a background thread:
   copies the staging tag into ``.tmp-step<N>-<pid>``, fsyncs every file, writes
   ``COMPLETE`` last, renames the directory to ``step<N>``, fsyncs the parent, points
   ``latest`` at it and removes the oldest complete checkpoints beyond ``keep``. A crash at
   any point leaves either no ``step<N>`` or a complete one. A failure in the background (a
   full disk) is logged and recorded at the next save or at ``close``; training goes on.

Loading (``load_newest``): every rank lists the complete tags of its host; the ranks agree on
the newest step complete on every rank (all-reduces of min and max, narrowing until they
agree), DeepSpeed loads it, and the outer state's files are kept for the OuterSync
(``restore_outer``: each rank's shard assembled from them, at any rank count).
DeepSpeed reads its files with ``torch.load(weights_only=False)`` (they hold objects of its
own, not only tensors), which runs code: so a checkpoint is loaded only when its directory and
every file in it belong to the job's user and nobody else may write them (nebula makes the
directory 0700 and publishes files 0600; anything else is refused with the fix), and when no
ancestor of the directory lets another user replace it (`checkpoint_trust`; nor is a checkpoint
saved into such a directory, or into an existing one of another user). The outer
state holds tensors and plain values only and is read with ``weights_only=True``.
The log says ``nebula: resumed from checkpoint step N (<dir>)`` and a ``resumed_from_step``
record is written. With ``keep: 1``, a crash after one host published a checkpoint and before
another did can leave no tag common to every host: the cluster then starts from the beginning
(said in the log). In overlap mode, a round still in flight at a periodic save is not in it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nebula_cli.config import staging
from nebula_cli.config.parts import CHECKPOINT_MARKER as MARKER
from nebula_cli.config.parts import CHECKPOINT_TAG_PREFIX as TAG_PREFIX
from nebula_cli.config.parts import SHM, CheckpointSettings
from nebula_cli.config.parts import checkpoint_tag as tag_of
from nebula_cli.ownership import not_own_folder
from nebula_cli.runtime import outer_files
from nebula_cli.runtime.checkpoint_trust import FIX, unsafe_ancestors
from nebula_cli.runtime.metrics import emit
from nebula_cli.runtime.outer import SyncError
from nebula_cli.runtime.settle import keep
from nebula_cli.runtime.threads import start_or_run

LATEST = "latest"
SHM_HEADROOM = 2.0
"""Staging in /dev/shm needs this many times the estimated checkpoint size free."""
BYTES_PER_PARAM = 16
"""Estimated checkpoint bytes per parameter (fp32 weights and two Adam moments, and more)."""


def say(message: str) -> None:
    print(f"nebula: {message}", file=sys.stderr, flush=True)


def step_of(name: str) -> int | None:
    digits = name[len(TAG_PREFIX):]
    return int(digits) if name.startswith(TAG_PREFIX) and digits.isdigit() else None


def complete_steps(directory: str | Path) -> list[int]:
    """Steps of the complete checkpoints in `directory` (named step<N>, with their marker)."""
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return []
    steps = [step_of(p.name) for p in entries if (p / MARKER).is_file()]
    return sorted(s for s in steps if s is not None)


def _fsync(path: Path, mode: int | None = None) -> None:
    """fsync `path` (no symlink followed), given `mode` first when one is named."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, and make them private (0600 and 0700);
    a symlink in it fails the publication (DeepSpeed writes none)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync(Path(dirpath) / name, 0o600)
        _fsync(Path(dirpath), 0o700)


def check_loadable(directory: Path, tag: Path) -> None:
    """Refuse (SyncError) to load `tag` unless it and `directory`, and everything in the tag,
    belong to this user, are no symlinks, and are writable by nobody else, and no ancestor of
    `directory` lets another user replace it (`checkpoint_trust`): DeepSpeed unpickles its
    files, and a file someone else could write would run their code as the job's user."""
    bad: list[str] = []
    for path in (directory, tag, *sorted(tag.rglob("*"))):
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            bad.append(f"{path} is a symlink")
        elif info.st_uid != os.getuid():
            bad.append(f"{path} belongs to uid {info.st_uid}")
        elif info.st_mode & 0o022:
            bad.append(f"{path} is writable by other users "
                       f"(mode {stat.S_IMODE(info.st_mode):04o})")
    if bad:
        raise SyncError(
            f"checkpoint {tag} not loaded: {'; '.join(bad[:3])}. DeepSpeed's checkpoint files "
            "are unpickled, which runs code: load only what this user wrote (fix the owner, "
            f"`chmod -R go-w {directory}`, or remove the checkpoint)")
    above = unsafe_ancestors(directory)
    if above:
        raise SyncError(
            f"checkpoint {tag} not loaded: {'; '.join(above[:3])}, so another user could "
            "replace it after this check (DeepSpeed reopens it by path and unpickles it, which "
            f"runs code): {FIX}")


def _not_ours(directory: Path) -> str | None:
    """Why checkpoints must not be written into `directory` (None when they may): it is not
    a folder of this user's, or an ancestor lets another user replace it."""
    why = not_own_folder(directory) or "; ".join(unsafe_ancestors(directory))
    return f"checkpoint directory {directory} not used: {why}: {FIX}" if why else None


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` so that readers see the old content or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with open(fd, "wb") as fh:
        os.fchmod(fd, 0o600)  # also a stale one of another mode
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def publish(staged: Path, directory: Path, step: int, keep: int) -> Path:
    """Make `staged` (DeepSpeed's files of one tag) the complete checkpoint `step` of
    `directory`, atomically (see the module's docstring); then keep the newest `keep`."""
    tag = tag_of(step)
    tmp = directory / f".tmp-{tag}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    if staged.parent.parent == directory:  # staged on the same filesystem: no copy
        os.rename(staged, tmp)
    else:
        shutil.copytree(staged, tmp)
    _fsync_tree(tmp)
    write_atomic(tmp / MARKER, json.dumps({"step": step, "time": time.time()}).encode())
    final = directory / tag
    if final.exists():  # the same step saved again (a final save right after a periodic one)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(directory)
    write_atomic(directory / LATEST, tag.encode())
    for old in complete_steps(directory)[:-keep]:
        shutil.rmtree(directory / tag_of(old), ignore_errors=True)
    return final


def agree_step(mine: list[int], reduce: Any) -> int | None:
    """The newest step in every rank's `mine`, or None. `reduce(a, b)` returns (min over the
    ranks of a, max over the ranks of b); every rank calls this the same number of times."""
    bound: int | None = None
    while True:
        cand = max((s for s in mine if bound is None or s <= bound), default=-1)
        low, high = reduce(cand, cand)
        if low == high:
            return low if low >= 0 else None
        bound = low


def enable_node_local_storage(engine: Any) -> None:
    """DeepSpeed's ``checkpoint: {use_node_local_storage: true}`` on a built engine: local rank
    0 of every host writes the model states (not only global rank 0)."""
    config = getattr(engine, "_config", None)
    writers = getattr(engine, "checkpoint_engine", None)
    if config is None or writers is None or getattr(config, "use_node_local_storage", False):
        return
    config.use_node_local_storage = True
    writer = bool(writers.is_data_parallel_writer(int(engine.local_rank)))
    partitioned = getattr(engine, "zero_optimization_partition_weights", None)
    if callable(partitioned) and partitioned():
        writer = writer or bool(engine.is_first_weights_partition_group())
    engine.save_non_zero_checkpoint = writer


class Checkpointer:
    """Saves and loads one engine's checkpoints on this host (see the module's docstring).
    Every rank of the DeepSpeed world calls ``save`` and ``load_newest`` at the same steps."""

    def __init__(self, engine: Any, settings: CheckpointSettings, *, sync: Any = None,
                 group: Any = None) -> None:
        self.engine = engine
        self.settings = settings
        self.sync = sync
        self.group = group
        self.dir = Path(settings.dir)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.rank = dist.get_rank() if self.distributed else 0
        local = getattr(engine, "local_rank", None)
        if not isinstance(local, int) or local < 0:
            local = int(os.environ.get("LOCAL_RANK") or 0)
        self.writer = local == 0  # writes this host's checkpoint files
        self.agent_dir = staging.agent_dir()  # where the staging directory is recorded
        self.shm_root: Path | None = None  # the writer's staging directory in /dev/shm
        self.last_step: int | None = None  # the newest step saved (or loaded) by this process
        self.resumed_from: int | None = None
        self.outer_state: outer_files.Saved | None = None
        """The outer state's files loaded (mapped), not yet given to the OuterSync."""
        self.errors = 0
        self.stall_s: float | None = None
        self._thread: threading.Thread | None = None
        self._failure: str | None = None
        enable_node_local_storage(engine)

    # --- saving -----------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        every = self.settings.every
        return bool(every) and step % int(every) == 0 and step != self.last_step

    def maybe_save(self, step: int, *, final: bool = False) -> bool:
        """Save when `step` is a multiple of ``every``, or `final` (unless `step` was just
        saved). Returns whether a checkpoint was saved."""
        if final and step != self.last_step and step > 0:
            return self.save(step)
        return self.save(step) if self.due(step) else False

    def save(self, step: int) -> bool:
        """Save checkpoint `step` (see the module's docstring). False when it was not saved;
        training goes on either way."""
        self.wait()
        t0 = time.perf_counter()
        problem, shm = self._prepare(step) if self.writer else (None, True)
        ok, all_shm = self._reduce_min(int(problem is None), int(shm))
        if not ok:
            self._failed(step, problem or "another host of the cluster cannot write its "
                         "checkpoint directory")
            return False
        shm_root = self._staging_in_memory() if all_shm else None
        if all_shm and not self._reduce_min(int(shm_root is not None))[0]:
            shm_root = None  # a rank could not use its host's: every rank stages on disk
        root = shm_root or self.dir / ".staging"
        problem = None
        try:
            self.engine.save_checkpoint(str(root), tag=tag_of(step), save_latest=False)
        except Exception as exc:  # a full /dev/shm, a DeepSpeed error: training goes on
            problem = f"DeepSpeed's save_checkpoint failed: {exc}"
        if problem is None:
            problem = self._write_outer(root / tag_of(step), step)
        # Every rank's files are written before a writer publishes them, and a checkpoint one
        # rank could not write is published by nobody: one all-reduce, not DeepSpeed's own
        # barriers inside save_checkpoint (which no contract promises).
        if not self._reduce_min(int(problem is None))[0]:
            self._failed(step, problem or "another rank's save_checkpoint failed")
            return False
        self.stall_s = time.perf_counter() - t0
        self.last_step = step
        if self.writer:
            self._thread = start_or_run(self._publish, (root / tag_of(step), step, self.stall_s),
                                        f"nebula-checkpoint-{step}")
        return True

    def wait(self) -> None:
        """Wait for the checkpoint being published; report its failure, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        failure, self._failure = self._failure, None
        if failure is not None:
            self._failed(self.last_step or 0, failure)

    def close(self) -> None:
        """Wait for the last checkpoint to be on disk. Safe to call twice."""
        self.wait()
        if self.shm_root is not None and self.agent_dir is not None:
            with contextlib.suppress(OSError):
                self.shm_root.rmdir()  # empty by now, unless another rank of the host stages
                staging.remove(self.agent_dir)
                self.shm_root = None

    def _staging_in_memory(self) -> Path | None:
        """This host's staging directory in /dev/shm: the writer's own; on the other ranks the
        one the writer recorded, checked private. None (said why) when it cannot be used."""
        if self.writer or self.agent_dir is None:  # the writer stages in memory only with one
            return self.shm_root
        try:
            return staging.open_recorded(self.agent_dir)
        except (staging.StagingError, OSError) as exc:
            say(f"checkpoint staging in {SHM} not used: {exc}")
            return None

    def _make_staging(self) -> bool:
        """On the writer: this process's private staging directory in /dev/shm, made on first
        use (what an earlier process of the host left is removed first). Whether there is one."""
        if self.shm_root is not None or self.agent_dir is None:
            return self.shm_root is not None
        try:
            staging.remove(self.agent_dir)
            self.shm_root = staging.create(self.agent_dir)
        except (staging.StagingError, OSError) as exc:
            say(f"checkpoint staging in {SHM} not used: {exc}")
            return False
        return True

    def _prepare(self, step: int) -> tuple[str | None, bool]:
        """On this host's writer: whether the directory is writable (None, else why not), and
        whether /dev/shm has room for the staging copy (then this process's private staging
        directory there exists). Clears stale staging of `step`."""
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if (problem := _not_ours(self.dir)) is not None:
                return problem, False
            probe = self.dir / f".probe-{os.getpid()}"
            probe.write_bytes(b"nebula")
            probe.unlink()
            shutil.rmtree(self.dir / ".staging" / tag_of(step), ignore_errors=True)
        except OSError as exc:
            return f"checkpoint directory {self.dir} is not writable: {exc}", False
        need = SHM_HEADROOM * BYTES_PER_PARAM * sum(
            p.numel() for p in getattr(self.engine, "module", self.engine).parameters())
        try:
            shm = (self.agent_dir is not None and os.access(SHM, os.W_OK)
                   and shutil.disk_usage(SHM).free > need and self._make_staging())
            if shm and self.shm_root is not None:
                shutil.rmtree(self.shm_root / tag_of(step), ignore_errors=True)
        except OSError:
            shm = False
        return None, bool(shm)

    def _write_outer(self, tag: Path, step: int) -> str | None:
        """This rank's part of the outer state written into the staged ``tag``, in this
        thread (its shard as it lies, before training changes it); None, else why not."""
        if self.sync is None:
            return None
        try:
            outer_files.write(tag, {**self.sync.saved_part(), "step": step})
        except Exception as exc:  # a full /dev/shm or disk: training goes on
            return f"writing the outer state into {tag} failed: {exc}"
        return None

    def _publish(self, staged: Path, step: int, stall: float) -> None:
        t0 = time.perf_counter()
        try:
            final = publish(staged, self.dir, step, self.settings.keep)
        except Exception as exc:  # reported by the training thread (wait)
            self._failure = f"publishing checkpoint step {step} in {self.dir} failed: {exc}"
            return
        finally:
            if self.shm_root is not None and staged.is_relative_to(self.shm_root):
                shutil.rmtree(staged, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    staged.parent.rmdir()  # <dir>/.staging, empty once its tag moved
        emit(step=step, checkpoint_step=step, checkpoint_dir=str(final), checkpoint_error=None,
             checkpoint_stall_s=stall, checkpoint_write_s=time.perf_counter() - t0)

    def _failed(self, step: int, message: str) -> None:
        self.errors += 1
        say(f"checkpoint at step {step} not saved: {message}; training goes on")
        emit(step=step, checkpoint_error=message, checkpoint_errors=self.errors)

    # --- loading ----------------------------------------------------------------------------

    def load_newest(self) -> int | None:
        """Load the newest checkpoint complete on every rank (see the module's docstring);
        returns its step, or None when there is none (training starts from the beginning)."""
        if self.writer:
            self._clear_leftovers()
        mine = complete_steps(self.dir)
        step = agree_step(mine, self._min_max)
        newest = max(mine, default=None)
        if step is None:
            if newest is not None and self.writer:
                say(f"no checkpoint is complete on every host of the cluster (this one has "
                    f"step {newest} in {self.dir}): training starts from the beginning")
            return None
        tag = self.dir / tag_of(step)
        check_loadable(self.dir, tag)
        load_path, _ = self.engine.load_checkpoint(str(self.dir), tag=tag_of(step))
        if load_path is None:
            raise SyncError(f"DeepSpeed could not load checkpoint {tag}")
        self.outer_state = outer_files.read(tag)
        self.resumed_from = self.last_step = step
        self.restore_outer()
        if self.writer:
            say(f"resumed from checkpoint step {step} ({tag})")
            emit(step=step, resumed_from_step=step, checkpoint_dir=str(tag))
        return step

    def restore_outer(self, sync: Any = None) -> None:
        """Give the loaded outer state to the OuterSync (`sync`, or the one given before)."""
        if sync is not None:
            self.sync = sync
        if self.sync is not None and self.outer_state is not None:
            saved, self.outer_state = self.outer_state, None
            self.sync.load_saved(saved, contributes=self.writer)

    def _clear_leftovers(self) -> None:
        """What a crash left: half-published tags, staging copies (also in /dev/shm)."""
        if self.agent_dir is not None and self.shm_root is None:
            staging.remove(self.agent_dir)  # an earlier process's (this one has made none)
        with contextlib.suppress(OSError):
            for entry in self.dir.iterdir():
                if entry.name.startswith((".tmp-", ".staging", ".probe-")):
                    if entry.is_dir():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)

    def _min_max(self, low: int, high: int) -> tuple[int, int]:
        """The minimum of `low` and the maximum of `high` over the ranks (one all-reduce)."""
        a, b = self._reduce_min(low, -high)
        return a, -b

    def _reduce_min(self, *values: int) -> list[int]:
        """Each value's minimum over the ranks (one all-reduce)."""
        t = torch.tensor(values, dtype=torch.int64)
        if self.world_size > 1:
            dist.all_reduce(keep(t), op=dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t.tolist()]


def checkpointer_for(sync: Any) -> Checkpointer | None:
    """The explicit API's Checkpointer of an OuterSync (built on first use from its plan's
    settings), or None when the job's spec has no `checkpoint:` section."""
    existing = getattr(sync, "checkpointer", None)
    if existing is not None:
        return existing
    settings = getattr(sync.config, "checkpoint", None) if sync.config is not None else None
    if settings is None:
        return None
    sync.checkpointer = Checkpointer(sync.engine, settings, sync=sync, group=sync._group)
    return sync.checkpointer


def save_due(sync: Any, step: int, *, final: bool = False) -> bool:
    """``OuterSync.checkpoint``: save when the spec asks for a checkpoint at `step` (every
    ``checkpoint.every`` optimizer steps, or `final`); False without a `checkpoint:` section."""
    ckpt = checkpointer_for(sync)
    return ckpt is not None and ckpt.maybe_save(step, final=final)


def resume(sync: Any) -> int:
    """``OuterSync.resume``: load the newest checkpoint every rank has (DeepSpeed's and the
    outer state); the optimizer step it was saved at, 0 when there is none."""
    ckpt = checkpointer_for(sync)
    return (ckpt.load_newest() or 0) if ckpt is not None else 0
