"""A `run:` that starts a launcher of its own (`torchrun ...`, `deepspeed train.py`,
`accelerate launch ...`, `python -m torch.distributed.run ...`), as many scripts' READMEs say
to start them. nebula already starts one process per slot with the world's variables set
(RANK, WORLD_SIZE, MASTER_ADDR, ...), so such a launcher would start its own processes in each
slot. Found by reading the command as a shell reads it (every simple command of a `&&`/`;`/`|`
list, past `VAR=value`, `env`, `exec`, `nohup`), never by a substring, so that
`python deepspeed_train.py` is not one. Pure functions of the command's text.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass

_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SEPARATORS = {"&&", "||", ";", "|", "&"}
_PREFIXES = {"exec", "nohup", "time", "command"}
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")

_TORCHRUN_VALUES = {
    "nnodes", "nproc_per_node", "nproc-per-node", "node_rank", "node-rank", "master_addr",
    "master-addr", "master_port", "master-port", "rdzv_backend", "rdzv-backend",
    "rdzv_endpoint", "rdzv-endpoint", "rdzv_id", "rdzv-id", "rdzv_conf", "rdzv-conf",
    "max_restarts", "max-restarts", "monitor_interval", "monitor-interval", "start_method",
    "start-method", "role", "log_dir", "log-dir", "redirects", "tee", "local_addr",
    "local-addr", "logs_specs", "logs-specs", "local_ranks_filter", "local-ranks-filter",
}
_DEEPSPEED_VALUES = {
    "num_gpus", "num_nodes", "hostfile", "include", "exclude", "master_port", "master_addr",
    "launcher", "launcher_args", "node_rank", "min_elastic_nodes", "max_elastic_nodes",
    "ssh_port", "bind_core_list",
}
_ACCELERATE_VALUES = {
    "config_file", "num_processes", "num_machines", "machine_rank", "main_process_ip",
    "main_process_port", "mixed_precision", "dynamo_backend", "gpu_ids",
    "num_cpu_threads_per_process", "rdzv_backend", "rdzv_conf", "max_restarts", "monitor_interval",
    "deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
    "gradient_accumulation_steps", "gradient_clipping", "zero3_init_flag",
    "zero3_save_16bit_model", "deepspeed_hostfile", "deepspeed_exclusion_filter",
    "deepspeed_inclusion_filter", "deepspeed_multinode_launcher", "fsdp_sharding_strategy",
    "module",
}


@dataclass(frozen=True)
class OwnLauncher:
    """A launcher found in `run:`."""

    launcher: str
    """As the user wrote it: "torchrun", "deepspeed", "accelerate launch",
    "python -m torch.distributed.run"."""
    script: list[str]
    """What it launches: the script (or `-m module`) and its arguments ([] when not found)."""
    per_node: int | None
    """Processes per node its flags ask for (--nproc_per_node, --num_gpus,
    --num_processes / --num_machines), None when they do not say."""

    def advice(self) -> str:
        """What to write instead, in one line."""
        instead = f"python {shlex.join(self.script) if self.script else 'train.py ...'}"
        slots = (f"`slots: {self.per_node}` on each host (from its "
                 f"{self._per_node_flag()})" if self.per_node else
                 "`slots: N` on each host (one process per device)")
        return (f"`{self.launcher}` starts processes of its own, but nebula already starts one "
                "process per slot with RANK, WORLD_SIZE and MASTER_ADDR set; write "
                f"`run: {instead}` and {slots}, or set `run_launcher: true` if this command "
                "must run as written in every slot")

    def _per_node_flag(self) -> str:
        return {"torchrun": "--nproc_per_node", "deepspeed": "--num_gpus",
                "accelerate launch": "--num_processes"}.get(
                    self.launcher, "--nproc_per_node")


def _simple_commands(run: str) -> list[list[str]]:
    """The words of each simple command in `run` (a list split at && || ; | &)."""
    try:
        lexer = shlex.shlex(run, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        words = list(lexer)
    except ValueError:  # unbalanced quotes: the shell will say so; nothing to find here
        return []
    out: list[list[str]] = [[]]
    for w in words:
        if w in _SEPARATORS:
            out.append([])
        else:
            out[-1].append(w)
    return [c for c in out if c]


def _program(words: list[str]) -> list[str]:
    """`words` from the program on: past VAR=value, `env [-i] VAR=value`, exec, nohup."""
    i = 0
    while i < len(words):
        w = words[i]
        if _ASSIGNMENT.match(w) or w in _PREFIXES:
            i += 1
        elif posixpath.basename(w) == "env":
            i += 1
            while i < len(words) and (words[i].startswith("-") or _ASSIGNMENT.match(words[i])):
                i += 1
        else:
            break
    return words[i:]


def _split_options(args: list[str], takes_value: set[str]) -> tuple[dict[str, str], list[str]]:
    """(options with their values, the rest from the launched script on)."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return opts, args[i + 1:]
        if a in ("-m", "--module") and i + 1 < len(args):
            return opts, ["-m", *args[i + 1:]]
        if not a.startswith("-"):
            return opts, args[i:]
        name, eq, value = a.lstrip("-").partition("=")
        if eq:
            opts[name] = value
        elif name in takes_value and i + 1 < len(args):
            opts[name] = args[i + 1]
            i += 1
        else:
            opts[name] = ""
        i += 1
    return opts, []


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else None


def _launcher_in(words: list[str]) -> OwnLauncher | None:
    prog = _program(words)
    if not prog:
        return None
    name = posixpath.basename(prog[0])
    if name == "torchrun":
        opts, rest = _split_options(prog[1:], _TORCHRUN_VALUES)
        return OwnLauncher("torchrun", rest, _int(opts.get("nproc_per_node",
                                                           opts.get("nproc-per-node"))))
    if name == "deepspeed":
        opts, rest = _split_options(prog[1:], _DEEPSPEED_VALUES)
        return OwnLauncher("deepspeed", rest, _int(opts.get("num_gpus")))
    if name == "accelerate" and len(prog) > 1 and prog[1] == "launch":
        opts, rest = _split_options(prog[2:], _ACCELERATE_VALUES)
        total, machines = _int(opts.get("num_processes")), _int(opts.get("num_machines")) or 1
        per_node = total // machines if total and total % machines == 0 else None
        return OwnLauncher("accelerate launch", rest, per_node)
    if _PYTHON.match(name) and len(prog) > 2 and prog[1] == "-m" and prog[2] in (
            "torch.distributed.run", "torch.distributed.launch"):
        opts, rest = _split_options(prog[3:], _TORCHRUN_VALUES)
        return OwnLauncher(f"python -m {prog[2]}", rest,
                           _int(opts.get("nproc_per_node", opts.get("nproc-per-node"))))
    return None


def own_launcher(run: str) -> OwnLauncher | None:
    """The first launcher `run` starts, or None."""
    for words in _simple_commands(run):
        found = _launcher_in(words)
        if found is not None:
            return found
    return None
