"""Distillation through `nebula launch`: a spec with a teacher cluster (`lab`, the built-in
server of a tiny Hugging Face GPT-2) and a student cluster (`cloud`, two gloo ranks of
helpers.distill_student) on the local transport. The job ends SUCCEEDED by itself: the
teacher's processes are ended once the students are done; every student batch came with soft
labels (the loader's metric records, in `nebula status --json`), the KD loss fell, both
ranks end identical, and nothing of the job is left running. The teacher's server killed by
SIGKILL mid-run: its agent starts it again, the students wait for it and go on. `nebula stop`
and `resume`: the students go on from their checkpoint, asking again for the batches from there,
and the teacher is started again with them."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers.distill_student import saved_steps
from helpers.jobs import CLI, REPO, job_processes, wait_for
from helpers.label_teacher import peaked_teacher
from helpers.sshd_bed import descendants
from transformers import GPT2Config, GPT2LMHeadModel

pytestmark = pytest.mark.slow

VOCAB, WIDTH, STEPS = 512, 32, 8


def spec_file(tmp_path: Path, steps: int = STEPS, **change: Any) -> Path:
    """The job: `change` updated into the distill section, the teacher cluster and the
    student cluster's env (keys ``distill``, ``lab``, ``cloud_env``)."""
    work = tmp_path / "work"
    work.mkdir()
    torch.manual_seed(3)
    teacher_model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=WIDTH, n_embd=64,
                                               n_layer=2, n_head=2))
    peaked_teacher(teacher_model).save_pretrained(work / "teacher")
    torch.save(torch.randint(0, VOCAB, (2 * 4 * steps, WIDTH)), work / "data.pt")
    spec = {
        "name": "distill-launch", "workdir": str(work), "relay": {},
        "run": f"python -u -m helpers.distill_student {work}/r$RANK.json {steps}",
        "runtime": {"auto": False},  # the student trains with gloo, not DeepSpeed
        "env": {"OMP_NUM_THREADS": "1"},
        "distill": {"topk": 16, "lookahead": 2, "wait_s": 60.0},
        "clusters": [
            {"name": "lab", "transport": "local", "role": "teacher",
             "teacher": {"model": "teacher", "batch_tokens": 4096}, "hosts": ["lab1"]},
            {"name": "cloud", "transport": "local", "hosts": [{"host": "c1", "slots": 2}],
             "env": {"PYTHONPATH": str(REPO / "tests"), "DISTILL_DATA": str(work / "data.pt"),
                     "DISTILL_VOCAB": str(VOCAB)}},
        ],
    }
    spec["distill"].update(change.get("distill", {}))
    spec["clusters"][0].update(change.get("lab", {}))
    spec["clusters"][1]["env"].update(change.get("cloud_env", {}))
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_launched_student_cluster_learns_from_its_teacher_cluster(
        cli: CLI, tmp_path: Path) -> None:
    path = spec_file(tmp_path)
    said = cli("validate", str(path), check=True).stdout  # what applies, and the old default
    assert "distill: 16 sampled labels per token (ids only), temperature 1, alpha 0.9" in said
    old_default = "note: distill sets topk: 16 but not `labels`: the default is now"
    assert old_default in " ".join(said.split()), said
    proc = cli("launch", str(path), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert old_default in " ".join(proc.stderr.split()), proc.stderr[-2000:]
    (job_id,) = cli.job_ids()
    st = json.loads(cli("status", job_id, "--json", check=True).stdout)
    assert st["state"] == "SUCCEEDED", st
    assert job_processes(job_id) == []  # the teacher's server too

    soft = st["metrics"]["cloud"]  # the loader's last record (its end)
    assert soft["distill_batches"] == STEPS and soft["distill_without_labels"] == 0, soft
    assert soft["distill_kd"] > 0, soft  # the student's KD term, as kd_loss computed it
    teacher = st["metrics"]["lab"]  # the teacher's label relay's last record (at its stop)
    assert "distill_batches" not in teacher
    assert teacher["teacher_answers"] >= STEPS and teacher["teacher_queue"] == 0, teacher
    assert teacher["step"] == teacher["teacher_answers"]
    # each side's loss on the students' batches, side by side in status
    assert teacher["teacher_ce"] > 0 and soft["distill_ce"] > 0, (teacher, soft)
    shown = " ".join(cli("status", job_id, check=True).stdout.split())
    assert (f"loss on the students' batches: teacher lab {teacher['teacher_ce']:.3f}, student "
            f"cloud {soft['distill_ce']:.3f}") in shown, shown
    # the test's teacher is random weights made peaked, on random tokens: no better than
    # the student there, which status says
    warned = "the teacher is no better than student cloud on its own batches" in shown
    assert warned == (teacher["teacher_ce"] >= soft["distill_ce"]), shown
    page = tmp_path / "report.html"  # the report says it too
    assert cli("report", job_id, "--output", str(page)).returncode == 0
    text = page.read_text()
    assert "<h2>soft labels (distillation)</h2>" in text
    assert f"<tr><td>cloud</td><td>{STEPS}</td><td>0</td>" in text
    assert "<h2>teacher (distillation)</h2>" in text
    assert f"<tr><td>lab</td><td>{teacher['teacher_answers']}</td>" in text

    results = [json.loads((tmp_path / "work" / f"r{r}.json").read_text()) for r in range(2)]
    assert results[0]["digest"] == results[1]["digest"]  # identical parameters
    for r in results:
        assert r["steps"] == STEPS and r["without_labels"] == 0
        assert r["kd_last"] < r["kd_first"], r

    # the teacher serves until told to stop: nebula ended it once the students had ended
    (lab,) = [h for h in st["hosts"] if h["cluster"] == "lab"]
    (cloud,) = [h for h in st["hosts"] if h["cluster"] == "cloud" and h["role"] == "worker"]
    assert lab["state"] == "STOPPED" and cloud["state"] == "SUCCEEDED", st["hosts"]
    assert lab["detail"]["reason"] == "ended after the training finished"
    assert lab["detail"]["ended"] >= cloud["detail"]["ended"]
    assert lab["detail"]["exit_codes"] == {"0": 0}  # hf_server left cleanly on SIGTERM


def test_on_policy_students_learn_from_the_teachers_scores_of_their_own_samples(
        cli: CLI, tmp_path: Path) -> None:
    """`distill.mode: on_policy` through `nebula launch`: each student rank continues the first
    half of its batches with `generate`, the built-in server scores the samples (its
    log-probability of each sampled token), the students train on the reverse KL; every batch
    is scored, at most 16 bytes per generated token cross each way, both ranks end identical,
    and nothing is left running."""
    path = spec_file(tmp_path, distill={"mode": "on_policy", "topk": 12},
                     cloud_env={"DISTILL_ON_POLICY": "1"})
    said = " ".join(cli("validate", str(path), check=True).stdout.split())
    assert "distill: on-policy: the students' samples scored by the teacher" in said, said
    assert "topk apply to off-policy labels only and are not used" in said, said
    proc = cli("launch", str(path), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (job_id,) = cli.job_ids()
    st = json.loads(cli("status", job_id, "--json", check=True).stdout)
    assert st["state"] == "SUCCEEDED", st
    soft = st["metrics"]["cloud"]
    assert soft["distill_batches"] == STEPS and soft["distill_without_labels"] == 0, soft
    assert soft["distill_kd"] is not None, soft  # the reverse KL of the samples
    assert st["metrics"]["lab"]["teacher_answers"] >= STEPS
    results = [json.loads((tmp_path / "work" / f"r{r}.json").read_text()) for r in range(2)]
    assert results[0]["digest"] == results[1]["digest"]
    for r in results:
        assert r["steps"] == STEPS and r["without_labels"] == 0, r
        generated = r["seen_tokens"] // 2  # the second half of every sequence was sampled
        up, down = r["ask_bytes"], r["wire_bytes"] - r["ask_bytes"]
        assert down == 2 * r["seen_tokens"], r  # one fp16 score a position, no ids back
        assert up / generated <= 16 and down / generated <= 16, r
    assert job_processes(job_id) == []


def test_a_teacher_killed_by_sigkill_is_restarted_and_the_students_go_on(
        cli: CLI, tmp_path: Path) -> None:
    """The teacher cluster's server (and all it ran) SIGKILLed while the students train: its
    agent starts it again (`max_restarts`), the students wait for it (`when_no_teacher:
    wait`) and every batch still comes with its soft labels; the job ends SUCCEEDED."""
    steps = 100  # 50 s of training: the kill lands well before the end, however loaded
    spec = spec_file(tmp_path, steps, distill={"wait_s": 120.0, "when_no_teacher": "wait"},
                     lab={"max_restarts": 2}, cloud_env={"DISTILL_STEP_S": "0.5"})
    job_id = cli("launch", str(spec), "--detach", check=True).stdout.strip()

    def status() -> dict[str, Any]:
        return json.loads(cli("status", job_id, "--json", check=True).stdout)

    wait_for(lambda: status()["metrics"].get("cloud", {}).get("distill_batches", 0) >= 1,
             timeout=120)  # the students are training with labels (the loader's first record)
    (lab,) = [h for h in status()["hosts"] if h["cluster"] == "lab"]
    killed = [lab["pid"], *descendants(lab["pid"])]
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    st = wait_for(lambda: (s := status())["state"] not in ("RUNNING", "PENDING") and s,
                  timeout=300, every=1.0)
    assert st["state"] == "SUCCEEDED", st
    (lab,) = [h for h in st["hosts"] if h["cluster"] == "lab"]
    assert lab["restarts"] == 1 and lab["state"] == "STOPPED", lab
    results = [json.loads((tmp_path / "work" / f"r{r}.json").read_text()) for r in range(2)]
    assert results[0]["digest"] == results[1]["digest"]
    assert all(r["steps"] == steps and r["without_labels"] == 0 for r in results), results
    assert max(r["longest_wait_s"] for r in results) > 0.5  # they waited for the restart
    assert st["metrics"]["cloud"]["distill_batches"] == steps
    assert job_processes(job_id) == []


def test_a_stopped_distillation_resumes_from_the_students_checkpoint(
        cli: CLI, tmp_path: Path) -> None:
    """`stop` mid-run, then `resume`: every student rank goes on from the newest step both
    saved, asks for the soft labels of exactly the batches from there (none skipped, none
    twice), the teacher cluster is started again, and the job ends SUCCEEDED."""
    steps, ckpt = 80, tmp_path / "ckpt"  # 16 s of training: `stop` lands before the end
    spec = spec_file(tmp_path, steps,
                     cloud_env={"DISTILL_STEP_S": "0.2", "DISTILL_CKPT": str(ckpt)})
    job_id = cli("launch", str(spec), "--detach", check=True).stdout.strip()

    def saved() -> int:
        return min(max(saved_steps(ckpt, r), default=0) for r in range(2))

    wait_for(lambda: saved() >= 10, timeout=180)
    cli("stop", job_id, check=True, timeout=180)
    st = json.loads(cli("status", job_id, "--json", check=True).stdout)
    assert st["state"] == "STOPPED" and job_processes(job_id) == [], st
    stopped_at = saved()
    assert 10 <= stopped_at < steps
    cli("resume", job_id, "--detach", check=True, timeout=300)
    st = wait_for(lambda: (s := json.loads(cli("status", job_id, "--json", check=True).stdout))
                  ["state"] not in ("RUNNING", "PENDING") and s, timeout=300, every=1.0)
    assert st["state"] == "SUCCEEDED" and st["attempt"] == 2, st
    results = [json.loads((tmp_path / "work" / f"r{r}.json").read_text()) for r in range(2)]
    assert results[0]["digest"] == results[1]["digest"]
    for r in results:
        assert (r["first_step"], r["steps"]) == (stopped_at, steps), r
        assert r["batches"] == steps - stopped_at and r["without_labels"] == 0, r
    (lab,) = [h for h in st["hosts"] if h["cluster"] == "lab"]
    assert lab["state"] == "STOPPED", lab  # served the second attempt, ended after it
    assert job_processes(job_id) == []
