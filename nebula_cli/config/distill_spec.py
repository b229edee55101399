"""The spec's distillation sections: the job's `distill:` (how students learn from a teacher's
sparse soft labels) and a teacher cluster's `teacher:` (the built-in server's model).

Re-exported by `nebula_cli.config.spec`; each field's default is defined here, once. What the
settings mean on the wire and in the loss: `nebula_cli.relay.distill` and
`nebula_cli.runtime.distill`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from nebula_cli.config.fields import Port
from nebula_cli.config.sections import SpecModel

MAX_TOPK = 1024
"""Most soft labels a token may carry (the bound every label frame is checked against)."""
MAX_TOKENS = 1 << 18
"""Most tokens one request to a teacher may carry (the bound of a request frame)."""


TOP_K_FIELDS = ("topk", "temperature", "values")
"""Settings a spec written for the old default (`labels: topk`) set without `labels`."""


class DistillSpec(SpecModel):
    """How the training (student) clusters distil from the job's teacher cluster(s).

    The defaults are the settings measured best (docs/benchmarks.md, "Distillation across
    sites"): 12 sampled labels per token at T 1 with alpha 0.9 sent 458x fewer bytes than full
    logits and gained 8.4 % over hard labels at a 0.95 % loss cost (medians of five seeds).
    (They had been a top 32 at T 2 with alpha 0.5, which trained a student about 1 % worse than
    none.)"""

    mode: Literal["off_policy", "on_policy"] = "off_policy"
    """Whose tokens the students learn on: 'off_policy': their own batches, with the
    teacher's labels of every position (`labels`); 'on_policy': continuations the students
    sample from their prompts, which the teacher scores (its log-probability of each sampled
    token, 2 bytes back, at temperature 1 as the students sample; `labels`, `topk`, `values`
    and `temperature` do not apply), trained on with the reverse KL
    (`runtime.distill.on_policy`)."""
    topk: int = Field(12, ge=1, le=MAX_TOPK)
    """Soft labels per token, k: the teacher's k most likely next tokens (ids and values), or
    with `labels: sampled` k tokens drawn from its distribution."""
    labels: Literal["topk", "sampled"] = "sampled"
    """What a token's soft labels are: 'topk': the teacher's k most likely next tokens with
    their log-probabilities (`values`); 'sampled': k tokens drawn, with repeats, from the
    teacher's distribution at `temperature`, each worth how often it was drawn over k. Sampled
    labels send ids only (no values) and, unlike a top k, are an unbiased estimate of the whole
    distribution ("sparse logit sampling", ACL 2025): docs/benchmarks.md measures both."""
    temperature: float = Field(1.0, gt=0.0, le=100.0)
    """Softening temperature T of the teacher's and the student's distributions."""
    alpha: float = Field(0.9, ge=0.0, le=1.0)
    """Weight of the distillation term: loss = alpha * T^2 * KL + (1 - alpha) * CE."""
    lookahead: int = Field(8, ge=0, le=256)
    """Batches asked for ahead of the step that trains on them, so the student never waits."""
    when_no_teacher: Literal["wait", "ce_only"] = "wait"
    """With no teacher answering: 'wait' for one, or 'ce_only': train on the hard labels
    (counted in the metrics) until a teacher answers again."""
    values: Literal["fp16", "int8"] = "fp16"
    """How a top-k soft label's value (a log-probability) crosses the WAN: 'fp16' (2 bytes), or
    'int8' (1 byte, linear between the row's lowest and highest value, 4 bytes per token).
    Sampled labels send no values."""
    max_tokens: int = Field(65536, ge=1, le=MAX_TOKENS)
    """Most tokens one request may carry (a student's batch, flattened); larger is refused."""
    port: Port | None = None
    """Port the teacher clusters' label relays listen on (on their relay's host). Default: the
    relay's port + 2."""
    wait_s: float = Field(60.0, gt=0.0)
    """With when_no_teacher: wait, seconds a step waits for its labels before it fails
    naming the teacher clusters tried."""

    vocab: int | None = Field(None, ge=1)
    """The students' models' vocabulary, their config's `vocab_size` (the width of their
    logits, padding included), when declared: a teacher whose model has another is refused
    before launch (`validate`, for a `teacher: {model:}` whose config it can read) and at its
    first answer. Default: not declared (a teacher's label id beyond the student's vocabulary
    is still refused by the loss)."""
    context: int | None = Field(None, ge=1)
    """The students' sequence length, when declared: a `teacher: {model:}` with fewer positions
    is refused at `validate`. Default: not declared (an ask longer than the teacher's context
    is refused at the teacher)."""

    @property
    def on_policy(self) -> bool:
        return self.mode == "on_policy"

    @property
    def wire_values(self) -> str:
        """How the labels cross the wire (`relay.distill.sparse.Values`)."""
        if self.on_policy:
            return "token"
        return "draws" if self.labels == "sampled" else self.values

    @property
    def wire_topk(self) -> int:
        """Labels a token carries on the wire (on-policy: one score)."""
        return 1 if self.on_policy else self.topk

    def notes(self) -> list[str]:
        """What `validate` and `launch` say of settings whose meaning the new defaults changed:
        a spec that sets `topk`, `temperature` or `values` but not `labels` was written for a
        top k (sampled labels send no values); an on-policy spec that sets what applies to
        off-policy labels only."""
        given = self.model_fields_set
        if self.on_policy:
            unused = [f for f in ("labels", "topk", "values", "temperature") if f in given]
            return [f"distill.mode: on_policy: the teacher scores the students' samples (one "
                    f"value a token, at temperature 1); {', '.join(unused)} apply to off-policy "
                    f"labels only and are not used"] if unused else []
        if "labels" in given or not given & set(TOP_K_FIELDS):
            return []
        said = ", ".join(f"{f}: {getattr(self, f)}" for f in TOP_K_FIELDS if f in given)
        return [f"distill sets {said} but not `labels`: the default is now "
                f"`labels: sampled` (k tokens drawn from the teacher, ids only), no longer the "
                f"teacher's top k; write `labels: topk` to keep a top k (CHANGELOG.md)"]

    def summary(self) -> str:
        """One line for `validate`: what the students are sent and how they weigh it."""
        if self.on_policy:
            return (f"on-policy: the students' samples scored by the teacher (2 bytes a token "
                    f"back, both at temperature 1), alpha {self.alpha:g}, "
                    f"{self.lookahead} batches ahead, with no teacher: {self.when_no_teacher}")
        labels = (f"{self.topk} sampled labels per token (ids only)" if self.labels == "sampled"
                  else f"top {self.topk} labels per token ({self.values} values)")
        return (f"{labels}, temperature {self.temperature:g}, alpha {self.alpha:g}, "
                f"{self.lookahead} batches ahead, with no teacher: {self.when_no_teacher}")


class TeacherSpec(SpecModel):
    """What a teacher cluster serves: a Hugging Face model with the built-in server
    (`model`, instead of its own `run`), or a checkpoint its own `run` loads (`from_job`: an
    earlier nebula job's newest one, copied to its hosts at launch; `checkpoint`: a folder
    already on them)."""

    model: str | None = Field(None, min_length=1)
    """A Hugging Face causal LM directory on the teacher's hosts (relative: to the workdir),
    or with `hub: true` a Hugging Face hub id (`org/name`) its hosts download."""
    from_job: str | None = Field(None, min_length=1)
    """An earlier nebula job (its id, short id or name, as `nebula status` takes it) whose
    newest complete checkpoint (`checkpoint:` of that job) the teacher serves: at launch it
    is copied from the job's first host of `from_cluster` to each of the teacher's hosts,
    through this machine (its size printed; a copy cut off goes on where it stopped at the
    next launch), and the cluster's `run` finds it in ``NEBULA_TEACHER_CHECKPOINT``
    (`nebula_cli.runtime.distill.teacher_checkpoint.load_state_dict()`)."""
    from_cluster: str | None = Field(None, min_length=1)
    """With `from_job`: which of its training clusters to take the checkpoint of (they end
    with the same parameters). Default: its first."""
    checkpoint: str | None = Field(None, min_length=1)
    """A nebula (DeepSpeed) checkpoint folder on the teacher's hosts (relative: to the
    workdir) that the cluster's `run` loads (``NEBULA_TEACHER_CHECKPOINT`` names it)."""
    hub: bool = False
    """Whether `model` names a model of the Hugging Face hub. By default it is a directory and
    the teacher never asks the hub (`HF_HUB_OFFLINE`): a directory that is not there is said
    at once, not retried as a download."""
    batch_tokens: int = Field(16384, ge=1)
    """Most tokens the server runs through the model at once."""

    @model_validator(mode="after")
    def _one_source(self) -> TeacherSpec:
        given = [f for f in ("model", "from_job", "checkpoint") if getattr(self, f)]
        if len(given) != 1:
            raise ValueError("a teacher serves one of `model` (a Hugging Face model, built-in "
                             "server), `from_job` (an earlier job's checkpoint) or `checkpoint` "
                             f"(a checkpoint folder on its hosts): found "
                             f"{', '.join(given) or 'none'}")
        if self.from_cluster and not self.from_job:
            raise ValueError("`from_cluster` names a cluster of `from_job`'s job")
        if self.hub and not self.model:
            raise ValueError("`hub` is for a `model` that names a Hugging Face hub id")
        return self

    @property
    def builtin(self) -> bool:
        """Whether the built-in server runs (a Hugging Face `model`), not the cluster's run."""
        return self.model is not None
