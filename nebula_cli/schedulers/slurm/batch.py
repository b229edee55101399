"""The batch script of a Slurm cluster: `schedulers/slurm/slurm.sbatch` (or the spec's own template)
with its placeholders filled in."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping

from nebula_cli.errors import UsageError
from nebula_cli.schedulers.slurm.spec import SlurmSpec

PLACEHOLDER = re.compile(r"\{\{\s*([a-z_]+)\s*\}\}")
NOTICE_LEAD = re.compile(r"^--signal=(?:[RB]+:)?\w+(?:@(\d+))?$")
"""sbatch's --signal=[{R|B}:]SIG[@SECONDS] (SECONDS before the time limit, 60 if not said)."""
NOTICE_SLACK = 480
"""Seconds a keeper waits for Slurm to end the job after its notice beyond the notice's lead:
Slurm may send it up to 60 s early, then ends the job and waits its KillWait (30 s by
default); the rest is margin (the keeper leaves as soon as Slurm ends the job)."""


def render(template: str, values: Mapping[str, str]) -> str:
    """`template` with every ``{{name}}`` replaced; UsageError naming any unknown one."""
    unknown = sorted({m for m in PLACEHOLDER.findall(template) if m not in values})
    if unknown:
        raise UsageError(f"the Slurm batch template uses unknown placeholders: "
                         f"{', '.join(unknown)} (known: {', '.join(sorted(values))})")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def values(request: SlurmSpec, *, job_name: str, output: str, job_root: str,
           pythonpath: str, python: str) -> dict[str, str]:
    """The placeholders' values for one cluster's job (shell-quoted where they are words)."""
    return {
        "job_name": job_name,
        "output": output,
        "sbatch_options": "\n".join(f"#SBATCH {opt}" for opt in request.sbatch_options()),
        "job_root": shlex.quote(job_root),
        "pythonpath": shlex.quote(pythonpath),
        "python": shlex.quote(python),
        "gpu_option": f"--gpus-per-node={request.gpus_per_node}" if request.gpus_per_node
        else "",
        "notice_wait": str(notice_wait(request)),
    }


def notice_wait(request: SlurmSpec) -> int:
    """Seconds the keepers wait at most, after Slurm's notice, for Slurm to end the job: the
    notice's lead (the section's --signal) and `NOTICE_SLACK`."""
    leads = [int(m.group(1) or 60) for option in request.sbatch_options()
             if (m := NOTICE_LEAD.match(option))]
    return max(leads, default=0) + NOTICE_SLACK
