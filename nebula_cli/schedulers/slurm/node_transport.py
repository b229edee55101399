"""SlurmNodeTransport: a node of a running Slurm allocation, reached through its login node.

Commands run as ``srun --jobid J --overlap -w NODE -N1 -n1`` steps (without the login
environment's SLURM_* variables, which srun would take as options) started on the login node;
commands that must outlive their own step (`run_detached`: the agent's `start`) are handed to
the node's keeper (`nebula_cli.agent.keeper`), the batch job's long-lived step. Files are the
login node's: a Slurm cluster's nodes share its file system (as every Slurm site's do).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

from nebula_cli.transport.base import (
    DEFAULT_TIMEOUT,
    CommandResult,
    OutputSink,
    Transport,
)
from nebula_cli.transport.freeport import FREE_PORT_PY

STEP_ENV_SH = ('for v in $(env | sed -n "s/^\\([A-Z]*_[A-Za-z0-9_]*\\)=.*/\\1/p"); do '
               'case $v in SLURM_CONF) ;; SLURM_*|SRUN_*|SALLOC_*) unset "$v" ;; esac; done; '
               'exec "$@"')
"""Runs its arguments without the SLURM_*/SRUN_* variables of the login node's environment
(but SLURM_CONF, where Slurm is): nebula run from a shell inside an allocation (`salloc`, an
interactive job) would otherwise hand that job's SLURM_NTASKS, SLURM_CPUS_PER_TASK, ... to
srun, which takes them as its own options and reshapes the step."""
SRUN_SLACK = 30.0
"""Seconds a step may take to start (slurmctld and slurmd round trips) on top of a command's."""


class SlurmNodeTransport(Transport):
    """One node of allocation `job`, through the login node's transport `login`."""

    def __init__(self, name: str, login: Transport, *, job: str, node: str, address: str,
                 keeper: str, python: str, pythonpath: str | None = None) -> None:
        self.name = name
        self.login = login
        self.job = job
        self.node = node
        self._address = address
        self.keeper = keeper
        self._python = python
        self.pythonpath = pythonpath

    # -- what the host is ----------------------------------------------------------------------
    @property
    def home(self) -> str:
        return self.login.home

    @property
    def python(self) -> str:
        return self._python

    @property
    def address(self) -> str:
        return self._address

    @property
    def bind_address(self) -> str:
        return "0.0.0.0"

    @property
    def shares_files(self) -> bool:
        return False

    def listen_port(self, preferred: int | None = None) -> int:
        if preferred is not None:
            return preferred
        result = self.run_checked([self.python, "-c", FREE_PORT_PY], timeout=60)
        return int(result.stdout.strip().splitlines()[-1])

    # -- commands ------------------------------------------------------------------------------
    def srun(self, argv: Sequence[str] | str, cwd: str | None = None) -> list[str]:
        """`argv` as a one-task step on this node (sharing the allocation's resources), its
        shape what the options say whatever the login node's environment says."""
        command = ["/bin/sh", "-c", argv] if isinstance(argv, str) else list(argv)
        return ["/bin/sh", "-c", STEP_ENV_SH, "sh",
                "srun", f"--jobid={self.job}", "--overlap", "--nodes=1", "--ntasks=1",
                f"--nodelist={self.node}", "--quiet", "--kill-on-bad-exit=1",
                *([f"--chdir={cwd}"] if cwd else []), *command]

    def run(self, argv: Sequence[str] | str, *, env: Mapping[str, str] | None = None,
            cwd: str | None = None, timeout: float = DEFAULT_TIMEOUT,
            stdin: bytes | None = None, on_output: OutputSink | None = None) -> CommandResult:
        self.check_open()
        result = self.login.run(self.srun(argv, cwd), env=env, timeout=timeout + SRUN_SLACK,
                                stdin=stdin, on_output=on_output)
        return CommandResult(command=_shown(argv), exit_code=result.exit_code,
                             stdout=result.stdout, stderr=result.stderr)

    def run_detached(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                     cwd: str | None = None,
                     timeout: float = DEFAULT_TIMEOUT) -> CommandResult:
        """`argv` run by the node's keeper: what it starts lives on in the keeper's step."""
        call = [self.python, "-m", "nebula_cli.agent.keeper", "call", self.keeper,
                "--env-json", json.dumps(dict(env or {})), "--timeout", str(timeout),
                *(["--cwd", cwd] if cwd else []), "--", *argv]
        lib = {"PYTHONPATH": self.pythonpath} if self.pythonpath else None
        self.check_open()
        result = self.login.run(self.srun(call), env=lib, timeout=timeout + SRUN_SLACK)
        return CommandResult(command=_shown(argv), exit_code=result.exit_code,
                             stdout=result.stdout, stderr=result.stderr)

    # -- files: the login node's ---------------------------------------------------------------
    def upload_tree(self, local_dir: str, remote_dir: str, exclude: Sequence[str] = (),
                    progress: Callable[[int, int], None] | None = None) -> tuple[int, int]:
        return self.login.upload_tree(local_dir, remote_dir, exclude, progress)

    def put_bytes(self, data: bytes, remote: str, *, mode: int = 0o644) -> None:
        self.login.put_bytes(data, remote, mode=mode)

    def put(self, local: str, remote: str, *, mode: int | None = None) -> None:
        self.login.put(local, remote, mode=mode)

    def get(self, remote: str, local: str) -> None:
        self.login.get(remote, local)

    def read_tail(self, remote: str, offset: int, max_bytes: int = 1 << 20) -> tuple[bytes, int]:
        return self.login.read_tail(remote, offset, max_bytes)

    def makedirs(self, remote: str, *, mode: int = 0o700) -> None:
        self.login.makedirs(remote, mode=mode)

    def exists(self, remote: str) -> bool:
        return self.login.exists(remote)

    def abort(self) -> None:
        self.aborted = True  # the login node's transport is shared: its owner closes it


def _shown(argv: Sequence[str] | str) -> str:
    return argv if isinstance(argv, str) else " ".join(argv)
