"""A real subword vocabulary for the distillation example: a byte-level BPE tokenizer trained
locally (the `tokenizers` library) on the bundled corpus (examples/gpt/data/corpus.txt), and
the corpus as token ids split 95/5 by blocks as examples/gpt does."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = Path(__file__).resolve().parents[1] / "gpt" / "data" / "corpus.txt"
VOCAB = 2048
EVAL_EVERY = 20
BLOCK_TOKENS = 512


def train_tokenizer(path: Path, vocab: int = VOCAB, corpus: Path = CORPUS) -> Tokenizer:
    """Train (or load, when `path` exists) the BPE tokenizer."""
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(corpus)], trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


def token_split(tok: Tokenizer, corpus: Path = CORPUS) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, eval) token ids: every EVAL_EVERY-th block of BLOCK_TOKENS to eval."""
    ids = torch.tensor(tok.encode(corpus.read_text()).ids, dtype=torch.long)
    blocks = list(ids.split(BLOCK_TOKENS))
    train = torch.cat([b for i, b in enumerate(blocks) if i % EVAL_EVERY != EVAL_EVERY - 1])
    held = torch.cat([b for i, b in enumerate(blocks) if i % EVAL_EVERY == EVAL_EVERY - 1])
    return train, held


def sequences(stream: torch.Tensor, width: int) -> torch.Tensor:
    """The stream cut into (n, width) sequences (the rest dropped)."""
    n = len(stream) // width
    return stream[: n * width].reshape(n, width)
