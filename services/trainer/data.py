"""The trainer's data: :func:`make_batcher` picks the run's batches.

- A byte-level model (the ``gpt`` presets) on one text file or the bundled corpus:
  :class:`ByteBatcher` here. Tokens are the bytes of the file (vocabulary 256). The
  bundled corpus is twelve Shakespeare plays from Project Gutenberg (public domain),
  ~1.5 MB. The last ``eval_fraction`` of the file is held out for evaluation.
- Anything else (a tokenizer, JSONL, Parquet, a directory of shards): the corpus is
  tokenized once into a memory-mapped cache, and each trainer reads its own disjoint
  shard of it (``token_cache.py``).
"""

from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shared.config import TrainerSettings

BUNDLED_CORPUS = Path(__file__).parent / "corpus" / "shakespeare.txt.gz"


def load_corpus(path: str | Path | None = None) -> torch.Tensor:
    """The corpus as a 1-D uint8 tensor of byte tokens. ``.gz`` files are decompressed."""
    path = Path(path) if path else BUNDLED_CORPUS
    if not path.is_file():
        raise ValueError(f"corpus file {str(path)!r} does not exist (setting SWARM_CORPUS)")
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    if not raw:
        raise ValueError(f"corpus file {str(path)!r} is empty (setting SWARM_CORPUS)")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


@dataclass(frozen=True)
class Microbatch:
    index: int
    inputs: torch.Tensor  # (B, T) int64 token ids
    targets: torch.Tensor  # (B, T) int64, inputs shifted by one

    @property
    def num_tokens(self) -> int:
        return self.inputs.numel()


SAMPLES_PER_DRAW = 8  # windows drawn per seed: microbatches of 8 are exactly one draw each


class ByteBatcher:
    """Microbatch ``i`` is samples ``i * microbatch_size`` to ``(i + 1) * microbatch_size - 1``
    of one stream of windows, drawn ``SAMPLES_PER_DRAW`` at a time from ``(seed, split,
    draw)`` alone: any run can be replayed, and the samples a run trains on do not depend on
    how it cuts them into microbatches (a trainer with microbatches of 2 trains on the same
    samples, in the same order, as one with microbatches of 8, like ``TokenBatcher``)."""

    def __init__(
        self, tokens: torch.Tensor, seq_len: int, microbatch_size: int, *, seed: int = 0, eval_fraction: float = 0.05
    ):
        n_eval = int(len(tokens) * eval_fraction)
        self.train, self.eval = tokens[: len(tokens) - n_eval], tokens[len(tokens) - n_eval :]
        if len(self.train) <= seq_len + 1 or len(self.eval) <= seq_len + 1:
            raise ValueError(
                f"corpus of {len(tokens)} bytes is too short for seq_len={seq_len} (setting SWARM_SEQ_LEN)"
            )
        self.seq_len, self.microbatch_size, self.seed = seq_len, microbatch_size, seed

    def microbatch(self, index: int, *, split: str = "train") -> Microbatch:
        data = self.train if split == "train" else self.eval
        first, stop = index * self.microbatch_size, (index + 1) * self.microbatch_size
        starts: list[int] = []
        for draw in range(first // SAMPLES_PER_DRAW, (stop - 1) // SAMPLES_PER_DRAW + 1):
            gen = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{split}:{draw}".encode()))
            drawn = torch.randint(0, len(data) - self.seq_len - 1, (SAMPLES_PER_DRAW,), generator=gen).tolist()
            lo = draw * SAMPLES_PER_DRAW
            starts += drawn[max(first - lo, 0) : min(stop - lo, SAMPLES_PER_DRAW)]
        windows = torch.stack([data[s : s + self.seq_len + 1] for s in starts]).long()
        return Microbatch(index, windows[:, :-1].contiguous(), windows[:, 1:].contiguous())


def make_batcher(settings: TrainerSettings, cfg, log=None):
    """The run's batches for ``settings`` and the model config ``cfg``: a :class:`ByteBatcher`
    for a byte-level model on one text file (or the bundled corpus), else a
    ``TokenBatcher`` over the token cache of SWARM_CORPUS with the run's tokenizer.
    ValueError naming the setting when the data or the tokenizer do not fit."""
    from services.trainer.documents import is_document_data
    from services.trainer.token_cache import TokenBatcher, default_cache_root, open_token_cache
    from shared.tokenizer import ByteTokenizer, load_tokenizer

    tokenizer = load_tokenizer(settings.model, settings.tokenizer, cfg)
    if isinstance(tokenizer, ByteTokenizer) and not (settings.corpus and is_document_data(settings.corpus)):
        return ByteBatcher(
            load_corpus(settings.corpus or None), settings.seq_len, settings.microbatch_size, seed=settings.seed
        )
    cache = open_token_cache(
        settings.corpus or BUNDLED_CORPUS, tokenizer, settings.token_cache_dir or default_cache_root(), log=log
    )
    if log:
        log.info(
            "tokens.opened",
            path=str(cache.path),
            reused=not cache.built,
            tokens=len(cache.tokens),
            held_out=cache.n_eval,
            tokenizer=tokenizer.name,
        )
    return TokenBatcher(
        cache, settings.seq_len, settings.microbatch_size, seed=settings.seed, num_shards=settings.num_shards
    )
