"""The faults bench/soak.py injects into a running local job, and their undoing.

- `host_pids(job_id, cluster, role)`: a host's agent and the processes it runs.
- `Injector`: injects one named fault (`FAULTS`) and keeps what must be undone later (a frozen
  relay thawed, a cut link restored, a full volume emptied) as timed undos that `due()` runs
  from the bench's loop and `close()` runs at the end, whatever happened.
- `CheckpointVolumes`: each host's checkpoint directory on a small file system of its own (a
  tmpfs; root), so that one host's disk can fill while the other's does not.

Two faults need root: `cut-link` drops every packet of the relays' connections between the
clusters (an nftables table on this machine's loopback, deleted to restore the link: TCP
retransmits, so the relays see a silent link, not a closed connection), and `full-disk`, which
fills one host's checkpoint volume until ENOSPC and empties it again. Without root (or `nft`)
`available()` leaves them out and says why.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from _soak_sample import processes

FAULTS = ("kill-worker", "kill-relay", "stall-relay", "kill-agent", "reboot-host",
          "cut-link", "full-disk")
ROOT_FAULTS = ("cut-link", "full-disk")
NFT_TABLE = "nebula_soak"
VOLUME_MB = 192


def available() -> tuple[tuple[str, ...], str | None]:
    """The faults this machine can inject, and why any are left out."""
    if os.geteuid() != 0:
        return tuple(f for f in FAULTS if f not in ROOT_FAULTS), (
            "not root: no cut-link (nftables) and no full-disk (a tmpfs per host)")
    if shutil.which("nft") is None:
        return tuple(f for f in FAULTS if f != "cut-link"), "no `nft` here: no cut-link"
    return FAULTS, None


def host_pids(job_id: str, cluster: str, role: str) -> tuple[int | None, list[int]]:
    """(the agent's pid, every process of its directory) of `role` on `cluster`'s host."""
    mark = f"/{job_id}/{cluster}/"
    agent, group = None, []
    for pid in (p for pids in processes(job_id).values() for p in pids):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            mine = any(x.startswith(b"NEBULA_AGENT_DIR=") and mark.encode() in x
                       and x.endswith(f"/{role}".encode()) for x in env)
            supervises = "nebula_cli.agent start" in cmd or "nebula_cli.agent revive" in cmd
            if supervises and mark in cmd and cmd.rstrip().endswith(role):
                agent = pid
            elif mine:
                group.append(pid)
    return agent, group


def relay_ports(job_dir: Path) -> list[int]:
    """Every relay's port for the other clusters (`peer_listen` of its relay.json)."""
    ports = []
    for path in job_dir.glob("*/*/relay/relay.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            ports.append(int(json.loads(path.read_text())["peer_listen"].rsplit(":", 1)[1]))
    return sorted(set(ports))


def _nft(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nft", *args], capture_output=True, text=True, timeout=10)


def cut(ports: list[int]) -> Callable[[], None]:
    """Drop every packet to or from `ports` on this machine; the returned call restores."""
    _nft("delete", "table", "inet", NFT_TABLE)  # a table left by an earlier run
    listed = ", ".join(map(str, ports))
    for cmd in (("add", "table", "inet", NFT_TABLE),
                ("add", "chain", "inet", NFT_TABLE, "out",
                 "{ type filter hook output priority 0; policy accept; }"),
                ("add", "rule", "inet", NFT_TABLE, "out", "tcp", "dport", f"{{ {listed} }}",
                 "drop"),
                ("add", "rule", "inet", NFT_TABLE, "out", "tcp", "sport", f"{{ {listed} }}",
                 "drop")):
        done = _nft(*cmd)
        if done.returncode:
            _nft("delete", "table", "inet", NFT_TABLE)
            raise OSError(f"nft {' '.join(cmd)}: {done.stderr.strip()}")
    return uncut


def uncut() -> None:
    """The link restored: the table gone (it is, or an OSError says why not)."""
    done = _nft("delete", "table", "inet", NFT_TABLE)
    if done.returncode and NFT_TABLE in _nft("list", "tables").stdout:
        raise OSError(f"nft delete table inet {NFT_TABLE}: {done.stderr.strip()}")


def fill(volume: Path) -> Callable[[], None]:
    """Write a file into `volume` until its file system is full; the returned call removes it."""
    filler = volume / ".soak-filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return lambda: filler.unlink(missing_ok=True)


@dataclass
class CheckpointVolumes:
    """A tmpfs of VOLUME_MB per host, mounted at each host's checkpoint directory of a job
    whose `checkpoint.dir` is the absolute `root` (`<root>/<job id>/<cluster>/<host>`); 0700,
    as the runtime loads checkpoints only from a directory no other user can write (a tmpfs
    is 1777 by default)."""

    root: Path
    mounted: list[Path] = field(default_factory=list)

    def mount(self, job_id: str, hosts: dict[str, str]) -> None:
        """Mount each host's volume; OSError if a host already wrote a checkpoint there (it
        would be hidden under the volume: mounted too late)."""
        for cluster, host in hosts.items():
            where = self.root / job_id / cluster / host
            where.mkdir(parents=True, exist_ok=True)
            if any(where.iterdir()):
                raise OSError(f"{where} already holds checkpoints: mounted too late")
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={VOLUME_MB}m,mode=0700", "tmpfs",
                            str(where)], check=True, capture_output=True, timeout=10)
            self.mounted.append(where)

    def of(self, job_id: str, cluster: str) -> Path | None:
        return next((m for m in self.mounted if m.parent.name == cluster
                     and m.parent.parent.name == job_id), None)

    def close(self) -> None:
        """Unmount every volume (lazily: a process still in one keeps it until it leaves);
        raises after trying all if one could not be."""
        failed = []
        for where in reversed(self.mounted):
            done = subprocess.run(["umount", "-l", str(where)], capture_output=True, text=True,
                                  timeout=10)
            if done.returncode:
                failed.append(f"{where}: {done.stderr.strip()}")
        self.mounted.clear()
        if failed:
            raise OSError("umount -l " + "; ".join(failed))


@dataclass
class Lasting:
    """A fault in force until `due` (monotonic), undone by `undo`; `key` says what it holds
    (one at a time each: a second cut, or a second fill of the same volume, would be undone
    by the first's undo)."""

    due: float
    kind: str
    key: str
    undo: Callable[[], None]


@dataclass
class Injector:
    """Injects the named faults into job `job_id` (its directories under `job_dir`)."""

    job_id: str
    job_dir: Path
    volumes: CheckpointVolumes | None
    lasting: list[Lasting] = field(default_factory=list)
    cut_made: bool = False

    def inject(self, kind: str, cluster: str, hold_s: float) -> bool:
        """Inject `kind` on `cluster` now; a fault that lasts is undone after `hold_s`. False
        when there is nothing to inject it into, or the same one is still in force."""
        key = "link" if kind == "cut-link" else f"{kind}:{cluster}"
        if any(x.key == key for x in self.lasting):
            return False
        if kind == "cut-link":
            ports = relay_ports(self.job_dir)
            if not ports:
                return False
            self.cut_made = True
            self._later(hold_s, kind, key, cut(ports))
            return True
        if kind == "full-disk":
            volume = self.volumes.of(self.job_id, cluster) if self.volumes else None
            if volume is None:
                return False
            self._later(hold_s, kind, key, fill(volume))
            return True
        # (the processes are looked up only for the faults that signal them)
        role = "relay" if "relay" in kind else "worker"
        agent, group = host_pids(self.job_id, cluster, role)
        procs = processes(self.job_id)
        if kind == "kill-worker":
            targets = [p for p in group if p in procs["worker"]]
        elif kind in ("kill-relay", "stall-relay"):
            targets = [p for p in group if p in procs["relay"]]
        elif kind == "kill-agent":
            targets = [agent] if agent else []
        else:  # reboot-host
            targets = ([agent] if agent else []) + group
        sent = [p for p in targets if _signal(p, signal.SIGSTOP if kind == "stall-relay"
                                              else signal.SIGKILL)]
        if kind == "stall-relay" and sent:
            self._later(hold_s, kind, key,
                        lambda: [_signal(p, signal.SIGCONT) for p in sent] and None)
        return bool(sent)

    def _later(self, hold_s: float, kind: str, key: str, undo: Callable[[], None]) -> None:
        self.lasting.append(Lasting(time.monotonic() + hold_s, kind, key, undo))

    def due(self, everything: bool = False) -> list[str]:
        """Undo what is due now (`everything`: all that is in force); the kinds undone. One
        that fails stays, to be tried again, and the first failure is raised after the rest
        were tried."""
        now = time.monotonic()
        done, failure = [], None
        for x in [x for x in self.lasting if everything or x.due <= now]:
            try:
                x.undo()
            except (OSError, subprocess.SubprocessError) as exc:
                failure = failure or exc
                continue
            self.lasting.remove(x)
            done.append(x.kind)
        if failure is not None:
            raise failure
        return done

    def pending(self) -> bool:
        return bool(self.lasting)

    def close(self) -> None:
        """Undo everything still in force, whatever happened; the link restored even if its
        undo was lost. Raises if something could not be undone."""
        try:
            self.due(everything=True)
        finally:
            if self.cut_made:
                uncut()


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True
