"""Slurm through its command-line tools on the login node: sbatch, squeue, sacct, scontrol,
scancel (what Debian's Slurm 22.05 has: no ``--json``, no ``squeue --only-job-state``).

Every function takes the login node's `Transport`; errors name the login host and the fix.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from nebula_cli.errors import LaunchError, TransportError
from nebula_cli.transport.base import Transport

COMMANDS = ("sbatch", "squeue", "scancel", "scontrol", "srun")
"""What nebula runs on a login node."""
TIMEOUT = 60.0
RUNNING = "RUNNING"
WAITING = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED"})
"""Slurm states in which the allocation has not started (or not yet again)."""
ENDING = frozenset({"COMPLETING", "SIGNALING", "STAGE_OUT", "STOPPED"})
"""Slurm states on the way to an end state (which says why: TIMEOUT, PREEMPTED, ...)."""
FIELD_SEP = "|"


@dataclass(frozen=True)
class QueueState:
    """Where a Slurm job is: its state, why it waits, its nodes (Slurm's compact list)."""

    state: str
    reason: str = ""
    nodelist: str = ""

    @property
    def waiting(self) -> bool:
        return self.state in WAITING

    @property
    def ended(self) -> bool:
        """In an end state (COMPLETED, FAILED, TIMEOUT, PREEMPTED, CANCELLED, NODE_FAIL, ...,
        or UNKNOWN: forgotten by Slurm)."""
        return self.state != RUNNING and not self.waiting and self.state not in ENDING

    def __str__(self) -> str:
        why = f" ({self.reason})" if self.reason and self.reason != "None" else ""
        return f"{self.state}{why}"


def require_commands(t: Transport) -> None:
    """LaunchError naming the host when a Slurm command is not on the login node's PATH."""
    script = 'for c in "$@"; do command -v "$c" >/dev/null 2>&1 || echo "$c"; done'
    result = t.run(["/bin/sh", "-c", script, "sh", *COMMANDS], timeout=TIMEOUT)
    missing = result.stdout.split()
    if missing:
        raise LaunchError(f"{t.name}: {', '.join(missing)} not found on the PATH (is this the "
                          "cluster's Slurm login node? if Slurm comes from a module, load it "
                          "in the cluster's `env:` PATH or in `setup:`)")


def submit(t: Transport, script: str, cwd: str) -> str:
    """Submit a batch script with ``sbatch --parsable``; its job id. LaunchError with sbatch's
    own words when Slurm refuses it (an unknown partition, a time over the limit, ...)."""
    result = t.run(["sbatch", "--parsable", script], cwd=cwd, timeout=TIMEOUT)
    words = result.stdout.strip().splitlines()
    job = words[-1].split(";")[0].strip() if words else ""
    if not result.ok or not job.isdigit():
        said = (result.stderr.strip() or result.stdout.strip() or f"exit {result.exit_code}")
        raise LaunchError(f"{t.name}: Slurm refused the job: {said}")
    return job


REFUSALS = (  # words of sbatch's refusal -> the field of the spec's `slurm:` it is about
    ("partition", "partition"), ("time limit", "time"), ("account", "account"),
    ("qos", "qos"), ("feature", "constraint"), ("constraint", "constraint"),
    ("reservation", "reservation"), ("gres", "gpus_per_node"), ("gpu", "gpus_per_node"),
    ("node count", "nodes"), ("node configuration", "nodes"), ("processors", "nodes"),
)


@dataclass(frozen=True)
class TestOnly:
    """What ``sbatch --test-only`` said of a batch script (nothing submitted)."""

    __test__ = False  # not a pytest class

    ok: bool
    said: str
    """Slurm's words: where and when the job would start ("Job 12 to start at
    2026-11-27T13:05:01 using 16 processors on nodes n[1-2] in partition gpu"), or why not."""
    field: str = ""
    """The spec's `slurm:` field a refusal is about ("" when none is recognised)."""


def test_only(t: Transport, script: str, cwd: str | None = None) -> TestOnly:
    """Ask Slurm whether, where and when it would run the batch script `script` (its text, on
    sbatch's stdin: nothing is written or submitted)."""
    result = t.run(["sbatch", "--test-only"], cwd=cwd, stdin=script.encode(), timeout=TIMEOUT)
    said = (result.stderr.strip() or result.stdout.strip() or f"exit {result.exit_code}")
    lines = [line.removeprefix("sbatch: error: ").removeprefix("sbatch: ").strip()
             for line in said.splitlines()[-3:]]
    if result.ok:
        return TestOnly(ok=True, said=lines[-1])
    said = " ".join(lines)
    return TestOnly(ok=False, said=said,
                    field=next((f for words, f in REFUSALS if words in said.lower()), ""))


def queue_state(t: Transport, job: str) -> QueueState:
    """The job's state: from squeue while Slurm remembers it (ended jobs for MinJobAge, 300 s
    by default), else from sacct (accounting), else UNKNOWN (forgotten, and no accounting)."""
    result = t.run(["squeue", "-h", "-t", "all", "-j", job, "-o",  # -t all: ended ones too
                    FIELD_SEP.join(("%T", "%r", "%N"))], timeout=TIMEOUT)
    line = next((w for w in result.stdout.splitlines() if w.strip()), "")
    if result.ok and line:
        state, reason, nodes = (line.split(FIELD_SEP) + ["", ""])[:3]
        return QueueState(state.strip(), reason.strip(), nodes.strip())
    return QueueState(accounted_state(t, job) or "UNKNOWN")


def accounted_state(t: Transport, job: str) -> str | None:
    """What sacct says of the job's allocation (CANCELLED by 0 -> CANCELLED), or None."""
    result = t.run(["sacct", "-n", "-P", "-X", "-j", job, "-o", "State"], timeout=TIMEOUT)
    words = result.stdout.split()
    return words[0].strip() if result.ok and words else None


def hostnames(t: Transport, nodelist: str) -> list[str]:
    """Slurm's compact node list (``n[1-2]``) spelled out."""
    result = t.run(["scontrol", "show", "hostnames", nodelist], timeout=TIMEOUT)
    if not result.ok:
        raise TransportError(f"cannot expand the node list {nodelist!r}: {result}", host=t.name)
    return result.stdout.split()


_NODE = re.compile(r"NodeName=(\S+).*?\bNodeAddr=(\S+)")


def node_addresses(t: Transport, nodes: list[str]) -> dict[str, str]:
    """node name -> the address Slurm reaches it at (``NodeAddr``)."""
    result = t.run(["scontrol", "-o", "show", "node", ",".join(nodes)], timeout=TIMEOUT)
    found = {m.group(1): m.group(2) for m in map(_NODE.search, result.stdout.splitlines()) if m}
    missing = [n for n in nodes if n not in found]
    if missing:
        raise TransportError(f"scontrol does not know the address of {', '.join(missing)}: "
                             f"{result}", host=t.name)
    return {n: found[n] for n in nodes}


def cancel(t: Transport, job: str) -> None:
    """``scancel`` the job (a job that has ended already is fine)."""
    result = t.run(["scancel", job], timeout=TIMEOUT)
    if not result.ok and "Invalid job id" not in result.stderr \
            and "already completing" not in result.stderr:
        raise TransportError(f"scancel {shlex.quote(job)} failed: {result}", host=t.name)
