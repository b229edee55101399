"""Distillation across sites (issue 24), measured on this machine: a teacher GPT-2 pre-trained
on the BPE-tokenized bundled corpus (examples/distill/bpe.py; built once per settings and
cached under ~/.cache/nebula-bench/, its build time printed), then the same student trained
the same steps on the same batches five ways, side by side:

- ``hard``: hard labels only;
- ``full``: KD from the teacher's full logits, the teacher in the student's process (one site);
- ``colocated``: KD from the soft labels through the label relay, the teacher on the student's
  site;
- ``wan``: the same across a ``--rate-mbit``/``--delay-ms`` link: on this machine a delaying,
  pacing proxy on loopback in front of the label relay (bench/_slow_link.py); with ``--bed``
  (root) the test bed's link between two sites, shaped to the rate by its tbf, the delay added
  by the same proxy on the student's host (the bed's kernel has no netem). With ``--bed`` the
  teachers serve from hosts of the east site (the colocated one from the student's own west
  site) and the student trains on w1, each in its host's network namespace
  (bench/_netns.py), and the ``wan`` run's bytes are also counted on the link
  (``link_bytes_per_token``);
- ``failover``: ``wan`` with two teacher replicas, one killed (SIGKILL) a third of the way in.

Every teacher and every link's proxy is a process of its own (bench/_distill_site.py), pinned
to the first CPU while the student trains on the others (``--no-pin``: all share every CPU): a
teacher at another site has hardware of its own and a link costs its ends nothing, so the
student's process holds only the student and its label client, in ``colocated`` and ``wan``
alike (with the teacher as a thread of the student's process, as before, both runs shared the
interpreter and the CPUs with it).

- ``on_policy``: across the same link, the students' own samples scored by the teacher
  (``distill.mode: on_policy``): each batch's first half a prompt the student continues with
  ``generate`` (``do_sample``), so the teacher runs as many tokens as for ``wan``: the gain
  against off-policy KD is measured at equal teacher compute (``on_policy`` in the JSON: bytes
  per sampled token each way, and the gain per seed);
- ``two_ranks``: ``wan`` again with two student ranks (two processes, gloo; each asks for
  its half of every batch through its own loader): ``identical`` is whether both end with the
  same parameters.

The labels (``--labels topk|sampled``, ``--k``, ``--values``), ``--temperature`` and
``--alpha`` default to the spec's; ``full`` uses the same temperature and alpha. ``--seeds N``
trains the hard, full, colocated and wan students from N initial weights each (the same
labels): the loss and throughput figures are the medians of each seed's ratios (one seed's
final loss moves by a few per cent, a 30-second run's throughput by up to 10 %). The student's
throughput across the link against colocated (``student_util_vs_colocated``) counts from the
end of the first step (the links' TLS handshakes and the first round trip are a job's one-time
cost, 1-2 % of a 30-second run); ``student_util_whole_run`` counts it too. Both teachers (the
colocated and the far one) serve at once and each seed's colocated and wan runs come one after
the other, so that the machine's drift between minutes falls on both alike. Prints one line
per run, each seed's KD gain and cost, then the issue's figures as JSON on the last line:
``per_seed`` (each seed's eval loss per row), the medians and the worst seed
(``kd_gain_worst``, ``loss_cost_worst``), ``goals`` (issue 43's: a gain >= 5 % in the median
and >= 3 % in every seed, a cost <= 1 % in the median and <= 2.5 % in the worst of >= 5 seeds,
>= 300x fewer bytes, >= 0.95 of colocated throughput, identical ranks, no site process left)
and ``goals_met``.

    .venv/bin/python bench/distill.py --quick --json
    .venv/bin/python bench/distill.py --bed --json --seeds 5      # the spec's defaults
    .venv/bin/python bench/distill.py --json --labels topk --k 32  # a top 32 instead
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples" / "distill"), str(Path(__file__).parent)]

from _bed import link_bytes, make_bed, require_bed  # noqa: E402
from _distill_site import site, site_processes  # noqa: E402
from _netns import in_netns  # noqa: E402
from bpe import sequences, token_split, train_tokenizer  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from nebula_cli.config.distill_config import DistillConfig  # noqa: E402
from nebula_cli.config.distill_spec import DistillSpec  # noqa: E402
from nebula_cli.config.relay_config import TlsFiles  # noqa: E402
from nebula_cli.pki.certs import issue_job_pki  # noqa: E402
from nebula_cli.runtime.distill import (  # noqa: E402
    kd_loss,
    on_policy,
    on_policy_loss,
    soft_labelled,
    topk_labels,
)
from nebula_cli.runtime.distill.loader import SoftLabels  # noqa: E402
from nebula_cli.runtime.distill.on_policy import own_samples  # noqa: E402
from nebula_cli.transport.freeport import free_port  # noqa: E402

JOB = "job-bench-distill"
WIDTH = 64
TEACHER = {"embd": 128, "layers": 4}
BED = {"east": ["e1", "e2"], "west": ["w1", "w2"]}


@dataclass(frozen=True)
class Place:
    """Where a process of the bench runs: a network namespace (None: this one), the address
    it serves on there, and its host's name on the bed."""

    ns: str | None
    address: str
    host: str = ""


@dataclass(frozen=True)
class Sites:
    """The student's place, a teacher's on its site (``near``), two across the link
    (``far``), and the bed (None: this machine alone)."""

    student: Place
    near: Place
    far: tuple[Place, Place]
    bed: Any = None

    @contextlib.contextmanager
    def across(self, place: Place, port: int, args: argparse.Namespace
               ) -> Iterator[tuple[str, int]]:
        """Where the student dials a teacher serving at ``place`` on ``port`` across the link:
        a delaying proxy on the student's loopback (bench/_slow_link.py, a process of its own
        on the sites' CPUs, started in the calling thread's namespace: the student's), which
        also paces off the bed (on the bed the link's tbf paces)."""
        rate = [] if self.bed is not None else [str(args.rate_mbit)]
        with site("link", place.address, str(port), str(args.delay_ms), *rate,
                  cpus=args.site_cpus) as (_, line):
            yield "127.0.0.1", int(line.split()[1])


def sites(args: argparse.Namespace, stack: contextlib.ExitStack) -> Sites:
    if not args.bed:
        here = Place(None, "127.0.0.1")
        return Sites(here, here, (here, here))
    require_bed()
    bed = stack.enter_context(make_bed(BED, args.rate_mbit))
    at = {name: Place(h.ns, h.address, name) for name, h in bed.hosts.items()}
    return Sites(at["w1"], at["w2"], (at["e1"], at["e2"]), bed)


CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nebula-bench"
"""Where the bench keeps what it builds once (never in the checkout)."""


def cached_teacher(tokenizer: Path, vocab: int, steps: int, batches: list[torch.Tensor]
                   ) -> tuple[GPT2LMHeadModel, float | None, Path]:
    """The teacher of these settings (its size, steps, seed, tokenizer and batches), loaded
    from the cache when it was built before; (model, the seconds its build took when it was
    loaded from the cache else None, its folder). Built here it is saved there."""
    key = hashlib.sha256(json.dumps({"teacher": TEACHER, "steps": steps, "seed": 0,
                                     "lr": 1e-3, "vocab": vocab}).encode()
                         + tokenizer.read_bytes() + b"".join(b.numpy().tobytes()
                                                            for b in batches)).hexdigest()[:16]
    folder = CACHE / f"distill-teacher-{key}"
    if (folder / "config.json").is_file() and (folder / "built_s").is_file():
        model = GPT2LMHeadModel.from_pretrained(folder).eval()
        return model, float((folder / "built_s").read_text()), folder
    start = time.monotonic()
    teacher = gpt(vocab, TEACHER["embd"], TEACHER["layers"], seed=0)
    opt = torch.optim.AdamW(teacher.parameters(), lr=1e-3)
    for batch in batches:
        loss = teacher(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    teacher.eval()
    partial = folder.with_name(folder.name + f".{os.getpid()}")
    teacher.save_pretrained(partial)
    (partial / "built_s").write_text(f"{time.monotonic() - start:.1f}")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)  # whole, or not there: a killed build leaves no half teacher
    return teacher, None, folder


def gpt(vocab: int, embd: int, layers: int, seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=WIDTH, n_embd=embd,
                                      n_layer=layers, n_head=4))


def cfg(pki: Path, cluster: str, host: str, teachers: dict[str, str], listen: str,
        args: argparse.Namespace, scored: bool = False) -> DistillConfig:
    """A site's distill.json at the bench's settings (``scored``: `distill.mode: on_policy`)."""
    d = DistillSpec(mode="on_policy" if scored else "off_policy", labels=args.labels,
                    topk=args.k, values=args.values)
    return DistillConfig(
        job_id=JOB, cluster=cluster, teacher=bool(listen), listen=listen, teachers=teachers,
        students={"cloud": 2},
        tls=TlsFiles(str(pki / "ca.pem"), str(pki / cluster / f"worker-{host}.pem"),
                     str(pki / cluster / f"worker-{host}.key")),
        topk=d.wire_topk, temperature=args.temperature, alpha=args.alpha,
        lookahead=args.lookahead, when_no_teacher="wait", values=d.wire_values,
        max_tokens=d.max_tokens, vocab=None, wait_s=120.0, dead_after=2.0, model=None,
        hub=False, batch_tokens=None)


@contextlib.contextmanager
def teacher_site(weights: Path, vocab: int, pki: Path, cluster: str, args: argparse.Namespace,
                 place: Place, scored: bool = False
                 ) -> Iterator[tuple[int, Callable[[], None]]]:
    """A teacher serving at ``place`` (a process of its own in its host's namespace, on the
    sites' CPUs): its port, and what kills it (SIGKILL: a teacher process lost mid-run);
    ``scored``: it scores the students' samples (on-policy)."""
    port = free_port("127.0.0.1")
    addr = f"{place.address}:{port}"
    config = pki.parent / f"distill-{cluster}-{place.host or 'here'}{'-op' * scored}.json"
    config.write_text(json.dumps(asdict(cfg(pki, cluster, "t1", {cluster: addr}, addr, args,
                                            scored))))
    with contextlib.ExitStack() as stack:
        with in_netns(place.ns):
            proc, _ = stack.enter_context(site(
                "teacher", str(config), str(weights), str(vocab), str(TEACHER["embd"]),
                str(TEACHER["layers"]), str(WIDTH), cpus=args.site_cpus))
        yield port, proc.kill


@torch.no_grad()
def eval_loss(model: torch.nn.Module, held: torch.Tensor) -> float:
    """The mean loss over ``held`` in batches of 16 sequences."""
    starts = range(0, len(held), 16)
    return sum(model(held[i:i + 16], labels=held[i:i + 16]).loss.item() for i in starts) / len(
        starts)


def train_student(args: argparse.Namespace, batches: list[torch.Tensor], held: torch.Tensor,
                  vocab: int, soft_source: object, seed: int = 1) -> dict:
    model = gpt(vocab, args.student_embd, 2, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = time.monotonic()
    stats = None
    if soft_source is None or callable(soft_source):
        pairs = ((b, soft_source(b) if soft_source else None) for b in batches)
    else:
        pairs = iter(soft_source)
        stats = soft_source.stats
    first = None  # when the first step was done: the links are up, the lookahead asked
    for batch, soft in pairs:
        loss, _, _ = kd_loss(model(batch).logits, batch, soft, temperature=args.temperature,
                             alpha=args.alpha)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first or time.monotonic()
    elapsed = time.monotonic() - start
    ev = eval_loss(model, held)
    out = {"eval_loss": ev, "tokens_per_s": sum(b.numel() for b in batches) / elapsed,
           "steady_tokens_per_s": sum(b.numel() for b in batches[1:])
           / (start + elapsed - (first or start)), "elapsed_s": elapsed}
    if stats is not None:
        out |= {"bytes_per_token": stats.bytes_per_token, "longest_wait_s": stats.longest_wait_s,
                "waited_s": stats.waited_s, "without_labels": stats.without_labels}
    return out


def train_on_policy(args: argparse.Namespace, batches: list[torch.Tensor],
                    held: torch.Tensor, vocab: int, config: DistillConfig, seed: int = 1
                    ) -> dict:
    """The student trained on its own samples of each batch's first half, scored by the
    teacher (`on_policy_loss` at the bench's alpha: the prompts' cross entropy mixed in)."""
    model = gpt(vocab, args.student_embd, 2, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    half = WIDTH // 2
    gen = torch.Generator().manual_seed(seed)

    def sample(prompts: torch.Tensor) -> torch.Tensor:  # the student's own distribution
        torch.manual_seed(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
        return own_samples(model, prompts, WIDTH - half)

    loader = on_policy([b[:, :half] for b in batches], sample, config=config)
    start = time.monotonic()
    try:
        for batch, scores in loader:
            loss, _, _ = on_policy_loss(model(batch.sequences).logits, batch.sequences, scores,
                                        start=batch.start, alpha=args.alpha)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        loader.client.close()
    elapsed = time.monotonic() - start
    stats = loader.stats
    sampled_tokens = stats.tokens // 2
    return {"eval_loss": eval_loss(model, held),
            "tokens_per_s": sum(b.numel() for b in batches) / elapsed, "elapsed_s": elapsed,
            "bytes_per_token": stats.bytes_per_token,
            "bytes_per_sampled_token_up": stats.ask_bytes / sampled_tokens,
            "bytes_per_sampled_token_down": (stats.wire_bytes - stats.ask_bytes)
            / sampled_tokens,
            "longest_wait_s": stats.longest_wait_s, "waited_s": stats.waited_s,
            "without_labels": stats.without_labels}


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="nebula-bench-distill-"))
    try:
        run(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps (fits 20 minutes on 2 cores)")
    p.add_argument("--json", action="store_true", help="the last line is the figures as JSON")
    d = DistillSpec()
    p.add_argument("--labels", choices=["topk", "sampled"], default=d.labels)
    p.add_argument("--k", type=int, default=d.topk, help="labels per token (top k, or draws)")
    p.add_argument("--values", choices=["fp16", "int8"], default=d.values)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--alpha", type=float, default=d.alpha)
    p.add_argument("--lookahead", type=int, default=d.lookahead,
                   help="batches asked ahead (to hide the link, at least its round trip x "
                        "the student's batches per second)")
    p.add_argument("--rate-mbit", type=float, default=20.0)
    p.add_argument("--delay-ms", type=float, default=50.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--student-embd", type=int, default=64)
    p.add_argument("--seeds", type=int, default=1,
                   help="student seeds (initial weights) of the hard, full, colocated and wan "
                        "runs; the loss and throughput figures are the medians of their ratios")
    p.add_argument("--bed", action="store_true",
                   help="the sites on the test bed (root): a shaped link between them")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin the teachers and links to the first CPU and the student "
                        "to the others (a site's own hardware, where the machine has two CPUs "
                        "or more)")
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    args.site_cpus = {cpus[0]} if args.pin and len(cpus) > 1 else None
    student_cpus = set(cpus[1:]) if args.site_cpus else set(cpus)
    teacher_steps, student_steps = (300, 120) if args.quick else (1500, 600)
    started = time.monotonic()
    torch.set_num_threads(2)
    tok = train_tokenizer(work / "bpe.json")
    vocab = tok.get_vocab_size()
    train, held_stream = token_split(tok)
    seqs, held = sequences(train, WIDTH), sequences(held_stream, WIDTH)[:64]
    g = torch.Generator().manual_seed(0)
    pick = lambda n: [seqs[torch.randint(0, len(seqs), (8,), generator=g)] for _ in range(n)]  # noqa: E731
    print(f"vocab {vocab}; {len(train)} train tokens, {held.numel()} eval tokens", flush=True)

    # phase a (one site here: the gpt example does two), built once per settings and cached
    teacher_batches = pick(teacher_steps)
    teacher, built_s, cached = cached_teacher(work / "bpe.json", vocab, teacher_steps,
                                              teacher_batches)
    with torch.no_grad():
        t_eval = teacher(held, labels=held).loss.item()
    print(f"teacher: {teacher_steps} steps, eval loss {t_eval:.4f} ("
          + (f"cached at {cached}, built once in {built_s:.0f} s" if built_s is not None
             else f"built in {time.monotonic() - started:.0f} s, cached at {cached}") + ")",
          flush=True)

    batches = pick(student_steps)
    for task in Path("/proc/self/task").iterdir():  # every thread (torch's pool is made)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), student_cpus)
    torch.set_num_threads(len(student_cpus))
    pki = work / "pki"
    issue_job_pki(JOB, {"lab": ["t1"], "lab2": ["t1"], "cloud": ["s1", "s2"]}, pki,
                  valid_for=dt.timedelta(days=1))
    runs: dict[str, dict] = {}
    for tag, seed in seed_tags(args):
        runs[f"hard{tag}"] = train_student(args, batches, held, vocab, None, seed)

    def full(batch: torch.Tensor) -> SoftLabels:
        with torch.no_grad():
            ids, logp = topk_labels(teacher(batch).logits, vocab, args.temperature)
        return SoftLabels(ids.reshape(*batch.shape, -1), logp.reshape(*batch.shape, -1), "here")

    for tag, seed in seed_tags(args):
        runs[f"full{tag}"] = train_student(args, batches, held, vocab, full, seed)
    with contextlib.ExitStack() as stack:
        where = sites(args, stack)
        with in_netns(where.student.ns):
            link_bytes_per_token = soft_label_runs(args, runs, teacher, batches, held, vocab,
                                                   pki, work, where)
    for name, r in runs.items():
        print(f"{name:16s} eval loss {r['eval_loss']:.4f}  {r['tokens_per_s']:8.0f} tok/s"
              + (f" ({r['steady_tokens_per_s']:.0f} after the first step)"
                 if "steady_tokens_per_s" in r else "")
              + (f"  {r['bytes_per_token']:.1f} B/token, waited {r.get('waited_s', 0):.2f} s, "
                 f"longest wait {r['longest_wait_s']:.2f} s" if "bytes_per_token" in r else ""),
              flush=True)
    full_bytes = vocab * 4
    tags = [tag for tag, _ in seed_tags(args)]
    speed = {name: r["tokens_per_s"] for name, r in runs.items()}
    steady = {name: r["steady_tokens_per_s"] for name, r in runs.items()
              if "steady_tokens_per_s" in r}
    per_seed = [{"seed": seed, **{row: runs[f"{row}{tag}"]["eval_loss"]
                                  for row in ("hard", "full", "colocated", "wan", "on_policy")}}
                for tag, seed in seed_tags(args)]
    gains = [1 - s["wan"] / s["hard"] for s in per_seed]
    on_gains = [1 - s["on_policy"] / s["wan"] for s in per_seed]
    costs = [s["wan"] / s["full"] - 1 for s in per_seed]
    figures = {
        "student_util_vs_colocated": median(steady[f"wan{tag}"] / steady[f"colocated{tag}"]
                                            for tag in tags),
        "student_util_whole_run": median(speed[f"wan{tag}"] / speed[f"colocated{tag}"]
                                         for tag in tags),
        "bytes_per_token": runs["wan"]["bytes_per_token"],
        "bytes_reduction_vs_full_logits": full_bytes / runs["wan"]["bytes_per_token"],
        "loss_cost_vs_full_logits": median(costs),
        "loss_cost_worst": max(costs),
        "kd_gain_vs_hard_labels": median(gains),
        "kd_gain_worst": min(gains),
        "per_seed": per_seed,
        "student_seeds": [seed for _, seed in seed_tags(args)],
        "on_policy": {
            "bytes_per_token_up": runs["on_policy"]["bytes_per_sampled_token_up"],
            "bytes_per_token_down": runs["on_policy"]["bytes_per_sampled_token_down"],
            "gain_vs_off_policy": median(on_gains), "gain_vs_off_policy_per_seed": on_gains,
            "gain_vs_hard_labels": median(1 - s["on_policy"] / s["hard"] for s in per_seed),
            "per": "sampled token (half of each sequence; the teacher runs as many tokens as "
                   "for the off-policy row)"},
        "failover_stall_s": runs["failover"]["longest_wait_s"],
        "failover_throughput_vs_clean": speed["failover"] / speed["wan"],
        "identical": runs["two_ranks"]["identical"],
        "two_ranks_eval_loss": runs["two_ranks"]["eval_loss"],
        "teacher_eval_loss": t_eval, "vocab": vocab, "labels": args.labels, "k": args.k,
        "values": "draws" if args.labels == "sampled" else args.values,
        "temperature": args.temperature, "alpha": args.alpha, "lookahead": args.lookahead,
        "wan_waited_s": runs["wan"]["waited_s"],
        "colocated_waited_s": runs["colocated"]["waited_s"],
        "link_bytes_per_token": link_bytes_per_token,
        "link": f"{args.rate_mbit:g} Mbit/s, {args.delay_ms:g} ms ("
                + ("the test bed's link, the delay by its proxy" if args.bed
                   else "loopback proxy")
                + ")",
        "student_steps": student_steps, "teacher_steps": teacher_steps,
    }
    figures["left_processes"] = len(site_processes())
    goals = {  # issue 43's, at the spec's defaults, over >= 5 student seeds
        "kd_gain_median_5pct": figures["kd_gain_vs_hard_labels"] >= 0.05,
        "kd_gain_every_seed_3pct": figures["kd_gain_worst"] >= 0.03,
        "loss_cost_median_1pct": figures["loss_cost_vs_full_logits"] <= 0.01,
        "loss_cost_worst_2_5pct": figures["loss_cost_worst"] <= 0.025,
        "bytes_300x": figures["bytes_reduction_vs_full_logits"] >= 300,
        "util_0_95": figures["student_util_vs_colocated"] >= 0.95,
        "five_seeds": len(per_seed) >= 5,
        "on_policy_16_bytes_each_way": max(figures["on_policy"]["bytes_per_token_up"],
                                           figures["on_policy"]["bytes_per_token_down"]) <= 16,
        "identical": bool(figures["identical"]), "nothing_left": figures["left_processes"] == 0}
    figures["goals"] = goals
    figures["goals_met"] = all(goals.values())
    print(f"KD gain over hard labels per seed: {', '.join(f'{100 * g:.1f} %' for g in gains)}"
          f" (median {100 * median(gains):.1f} %, worst {100 * min(gains):.1f} %); cost against "
          f"full logits: {', '.join(f'{100 * c:.2f} %' for c in costs)} (median "
          f"{100 * median(costs):.2f} %, worst {100 * max(costs):.2f} %)", flush=True)
    print(f"on-policy against off-policy KD at equal teacher tokens per seed: "
          f"{', '.join(f'{100 * g:.1f} %' for g in on_gains)} (median "
          f"{100 * median(on_gains):.1f} %; positive: on-policy's eval loss lower); "
          f"{figures['on_policy']['bytes_per_token_up']:.2f} B up and "
          f"{figures['on_policy']['bytes_per_token_down']:.2f} B down per sampled token",
          flush=True)
    print("goals: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in goals.items()),
          flush=True)
    if args.json:
        print(json.dumps(figures))


def seed_tags(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(run-name suffix, student seed) of each seed: ("", 1), ("_seed2", 2), ..."""
    return [("" if seed == 1 else f"_seed{seed}", seed) for seed in range(1, args.seeds + 1)]


def soft_label_runs(args: argparse.Namespace, runs: dict[str, dict], teacher: torch.nn.Module,
                    batches: list[torch.Tensor], held: torch.Tensor, vocab: int, pki: Path,
                    work: Path, where: Sites) -> float | None:
    """The runs through the label relay (colocated, wan, two_ranks, failover), from the
    student's place; the wan run's bytes on the bed's link per token (None off the bed)."""
    far, far2 = where.far
    on_link = None
    # both teachers up at once, each seed's colocated and wan runs one after the other: the
    # machine's speed drifts by 10-20 % between minutes, which runs minutes apart would count
    weights = work / "teacher.pt"
    torch.save(teacher.state_dict(), weights)
    with teacher_site(weights, vocab, pki, "lab", args, where.near) as (near_port, _), \
            teacher_site(weights, vocab, pki, "lab2", args, far) as (port, _), \
            where.across(far, port, args) as (host, via):
        colocated = cfg(pki, "cloud", "s1", {"lab": f"{where.near.address}:{near_port}"}, "",
                        args)
        student = cfg(pki, "cloud", "s1", {"lab2": f"{host}:{via}"}, "", args)
        for tag, seed in seed_tags(args):
            loader = soft_labelled(batches, config=colocated)
            runs[f"colocated{tag}"] = train_student(args, batches, held, vocab, loader, seed)
            loader.client.close()
            loader = soft_labelled(batches, config=student)
            before = link_bytes(where.bed) if where.bed else 0
            runs[f"wan{tag}"] = train_student(args, batches, held, vocab, loader, seed)
            if where.bed and on_link is None:
                on_link = (link_bytes(where.bed) - before) / sum(b.numel() for b in batches)
            loader.client.close()
        runs["two_ranks"] = two_ranks(args, batches, held, vocab, pki, {"lab2": f"{host}:{via}"},
                                      work)
    with teacher_site(weights, vocab, pki, "lab2", args, far, scored=True) as (port, _), \
            where.across(far, port, args) as (host, via):
        scoring = cfg(pki, "cloud", "s1", {"lab2": f"{host}:{via}"}, "", args, scored=True)
        for tag, seed in seed_tags(args):
            runs[f"on_policy{tag}"] = train_on_policy(args, batches, held, vocab, scoring, seed)
    with teacher_site(weights, vocab, pki, "lab", args, far) as (p1, kill1), \
            teacher_site(weights, vocab, pki, "lab2", args, far2) as (p2, _), \
            where.across(far, p1, args) as (h1, v1), where.across(far2, p2, args) as (h2, v2):
        student = cfg(pki, "cloud", "s1", {"lab": f"{h1}:{v1}", "lab2": f"{h2}:{v2}"}, "",
                      args)
        loader = soft_labelled(batches, config=student)
        killer = threading.Thread(target=lambda: (
            _wait_batches(loader, len(batches) // 3), kill1()), daemon=True)
        killer.start()
        runs["failover"] = train_student(args, batches, held, vocab, loader)
        loader.client.close()
    return on_link


def two_ranks(args: argparse.Namespace, batches: list[torch.Tensor], held: torch.Tensor,
              vocab: int, pki: Path, teachers: dict[str, str], work: Path) -> dict:
    """The ``wan`` student as two ranks (processes, gloo): rank r trains on rows r::2 of every
    batch with its own loader (host s{r+1}'s certificate), gradients averaged each step."""
    init = f"file://{work / 'gloo-init'}"
    out = work / "two_ranks.json"
    start = time.monotonic()
    torch.multiprocessing.spawn(_rank, args=(args, batches, held, vocab, pki, teachers, init, out),
                                nprocs=2, join=True)
    elapsed = time.monotonic() - start
    ranks = [json.loads(out.with_suffix(f".{r}").read_text()) for r in range(2)]
    return {"eval_loss": ranks[0]["eval_loss"], "identical": ranks[0]["sha"] == ranks[1]["sha"],
            "tokens_per_s": sum(b.numel() for b in batches) / elapsed,
            "bytes_per_token": ranks[0]["bytes_per_token"],
            "longest_wait_s": max(r["longest_wait_s"] for r in ranks)}


def _rank(rank: int, args: argparse.Namespace, batches: list[torch.Tensor], held: torch.Tensor,
          vocab: int, pki: Path, teachers: dict[str, str], init: str, out: Path) -> None:
    import hashlib

    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    model = gpt(vocab, args.student_embd, 2, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    student = cfg(pki, "cloud", f"s{rank + 1}", teachers, "", args)
    loader = soft_labelled([b[rank::2] for b in batches], config=student, rank=rank)
    for batch, soft in loader:
        loss, _, _ = kd_loss(model(batch).logits, batch, soft, temperature=args.temperature,
                             alpha=args.alpha)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= 2
        opt.step()
    loader.client.close()
    ev = eval_loss(model, held)
    sha = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    out.with_suffix(f".{rank}").write_text(json.dumps(
        {"eval_loss": ev, "sha": sha.hexdigest(), "bytes_per_token": loader.stats.bytes_per_token,
         "longest_wait_s": loader.stats.longest_wait_s}))
    dist.destroy_process_group()


def _wait_batches(loader: object, n: int) -> None:
    while loader.stats.batches < n:  # type: ignore[attr-defined]
        time.sleep(0.05)


if __name__ == "__main__":
    main()
