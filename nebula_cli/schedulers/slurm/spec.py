"""The spec's `slurm:` section of a cluster whose hosts come from a Slurm allocation.

Re-exported by `nebula_cli.config.spec`; each field's default is defined here, once. What the
spec and the plan make of a Slurm cluster is `config.schedulers.slurm`.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field, field_validator

from nebula_cli.config.sections import SpecModel

_TIME = re.compile(r"^(?:\d+-\d{1,2}(?::\d{1,2}){0,2}|\d+(?::\d{1,2}){0,2}|UNLIMITED|INFINITE)$")
_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,:@%+=/\[\]-]{1,128}$")
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.,:@%+=/\[\]()&|*!-]{1,256}$")
"""Slurm's feature expressions ("a100&ib", "[rack1|rack2]", "gpu*2"): nothing that would end
the #SBATCH line or split it (spaces, quotes, control characters) or start a comment."""
_BAD_IN_OPTION = re.compile(r"[\x00-\x1f\x7f\"'\\#]")
"""What an `sbatch_args` item may not hold: a control character (a newline would start a shell
line of the batch script), a quote, a backslash or '#' (sbatch's directive parsing)."""
PREEMPT_SIGNAL = "TERM@120"
"""Asked of Slurm unless `sbatch_args` names a --signal: two minutes before a time limit the
steps' processes (the keepers, not the batch shell: an srun that gets SIGTERM kills its step
after KillWait) get SIGTERM, so the workers stop gracefully and checkpoint."""


_MEM = re.compile(r"--(mem|mem-per-cpu|mem-per-gpu)=(\d+)([KMGT]?)B?", re.IGNORECASE)
"""sbatch's memory options as `sbatch_args` carries them (a size in MB unless a unit says)."""
_CPUS = re.compile(r"--cpus-per-task[= ](\d+)|-c ?(\d+)")
_MEM_UNIT = {"": 1 << 20, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _slurm_time(value: str) -> str:
    """Slurm's time formats: minutes, m:s, h:m:s, d-h, d-h:m, d-h:m:s, UNLIMITED."""
    if not _TIME.fullmatch(value) or re.fullmatch(r"0+(?:[-:]0+)*", value):
        raise ValueError(f"expected a Slurm time limit such as \"90\" (minutes), \"04:00:00\" "
                         f"or \"2-00:00:00\" (days-hours:minutes:seconds), found {value!r}")
    return value


def _slurm_word(value: str) -> str:
    if not _SLURM_WORD.fullmatch(value):
        raise ValueError(f"expected a Slurm name (letters, digits, _ . , : @ % + = / [ ] -), "
                         f"found {value!r}")
    return value


def _constraint(value: str) -> str:
    if not _CONSTRAINT.fullmatch(value):
        raise ValueError(f"expected Slurm node features such as \"a100&ib\" or "
                         f"\"[rack1|rack2]\" (letters, digits and _ . , : @ % + = / [ ] ( ) & | "
                         f"* ! -, no spaces), found {value!r}")
    return value


SlurmTime = Annotated[str, AfterValidator(_slurm_time)]
SlurmWord = Annotated[str, AfterValidator(_slurm_word)]
SlurmConstraint = Annotated[str, AfterValidator(_constraint)]


class SlurmSpec(SpecModel):
    """What to ask Slurm for: one batch job holds the cluster's nodes for the whole run."""

    partition: SlurmWord | None = None
    """--partition. Default: the cluster's default partition."""
    nodes: int = Field(1, ge=1, le=4096)
    """--nodes: the hosts of the cluster's DeepSpeed world."""
    ntasks_per_node: int = Field(1, ge=1, le=1024)
    """Processes (DeepSpeed ranks) per node, e.g. one per GPU."""
    gpus_per_node: int = Field(0, ge=0, le=64)
    """--gpus-per-node (0: a CPU cluster, nothing asked)."""
    cpus_per_task: int | None = Field(None, ge=1, le=4096)
    """--cpus-per-task. Default: Slurm's."""
    time: SlurmTime | None = None
    """--time, the allocation's limit. Default: the partition's."""
    account: SlurmWord | None = None
    """--account."""
    qos: SlurmWord | None = None
    """--qos."""
    constraint: SlurmConstraint | None = None
    """--constraint (node features, e.g. "a100&ib")."""
    reservation: SlurmWord | None = None
    """--reservation."""
    sbatch_args: list[str] = Field(default_factory=list)
    """Anything else for sbatch, passed through (e.g. ["--exclusive"])."""
    template: str | None = Field(None, min_length=1)
    """A batch script template of your own, in place of nebula's schedulers/slurm/slurm.sbatch (the
    same placeholders; path relative to the spec)."""

    @field_validator("sbatch_args")
    @classmethod
    def _options(cls, args: list[str]) -> list[str]:
        for arg in args:
            if not arg.startswith("-") or _BAD_IN_OPTION.search(arg):
                raise ValueError(f"expected sbatch options such as \"--exclusive\" or "
                                 f"\"--mem=0\", each starting with '-', without quotes, "
                                 f"backslashes, '#' or control characters, found {arg!r}")
        return args

    def node_memory(self) -> tuple[int, str] | None:
        """The memory each node of the allocation grants the job, and the option that says
        so, when `sbatch_args` asks for a fixed amount: ``--mem`` (per node), ``--mem-per-cpu``
        (times the node's CPUs: ntasks_per_node x cpus_per_task, or the ``-c`` `sbatch_args`
        gives; unknown with ``--exclusive``) or ``--mem-per-gpu`` (times
        gpus_per_node); None for none of them, ``--mem=0`` (all of the node's) or a per-GPU
        amount with no GPUs. The last one given counts, as sbatch reads them."""
        found = None
        for arg in self.sbatch_args:
            m = _MEM.fullmatch(arg)
            if m is not None:
                found = (m, arg)
        if found is None:
            return None
        m, arg = found
        size = int(m.group(2)) * _MEM_UNIT[m.group(3).upper()]
        kind = m.group(1).lower()
        if kind == "mem-per-cpu":
            if "--exclusive" in self.sbatch_args:  # (not =user, =mcs or =topo)
                return None  # every CPU of the node, however many it has: unknown before
            size *= self.ntasks_per_node * (self._cpus_per_task() or 1)
        elif kind == "mem-per-gpu":
            size *= self.gpus_per_node
        return (size, arg) if size else None

    def _cpus_per_task(self) -> int | None:
        """``cpus_per_task``, or what `sbatch_args` says instead (``--cpus-per-task=N`` or
        ``--cpus-per-task N``, ``-cN`` or ``-c N``; the last one given, as sbatch reads
        them)."""
        found = self.cpus_per_task
        for arg in self.sbatch_args:
            if (m := _CPUS.fullmatch(arg)) is not None:
                found = int(m.group(1) or m.group(2))
        return found

    def sbatch_options(self) -> list[str]:
        """The #SBATCH options this section asks for (the template adds job name, output)."""
        opts = [f"--nodes={self.nodes}", f"--ntasks-per-node={self.ntasks_per_node}"]
        for flag, value in (("partition", self.partition), ("time", self.time),
                            ("account", self.account), ("qos", self.qos),
                            ("constraint", self.constraint),
                            ("reservation", self.reservation),
                            ("cpus-per-task", self.cpus_per_task)):
            if value is not None:
                opts.append(f"--{flag}={value}")
        if self.gpus_per_node:
            opts.append(f"--gpus-per-node={self.gpus_per_node}")
        if not any(a.startswith("--signal") for a in self.sbatch_args):
            opts.append(f"--signal={PREEMPT_SIGNAL}")
        return opts + list(self.sbatch_args)
