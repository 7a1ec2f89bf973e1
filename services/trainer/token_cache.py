"""A corpus tokenized once into a memory-mapped cache of token ids, and the batches drawn from it.

**The cache.** :func:`open_token_cache` reads the documents of a corpus
(``documents.py``), tokenizes them in batches, joins them with the tokenizer's end-of-text
id after each document and writes the ids (uint16, or uint32 past 65,536 tokens) to
``ROOT/<key>/tokens.bin`` with ``meta.json``. The key is a hash of the tokenizer's
fingerprint, the data files (path, size, modification time) and the held-out fraction, so a
second run on the same data reuses the cache, and any change builds a new one. A lock file
makes concurrent trainers build it once; the directory appears complete or not at all
(written aside, then renamed).

**The split.** The last ``eval_fraction`` of the token ids is held out: no training window
reaches into it.

**The samples.** The training ids are cut into windows of ``seq_len + 1`` ids starting at
multiples of ``seq_len`` (sample ``j`` starts at ``j * seq_len``: inputs and targets shifted
by one). A permutation drawn from the seed deals the samples into ``num_shards`` disjoint
shards, one per trainer; trainer ``t``'s ``k``-th microbatch (run index ``t + k *
num_shards``, as ``Trainer.microbatch_index`` numbers them) takes the next
``microbatch_size`` samples of its own shard, in a new order every pass over the shard.
So two trainers never see the same sample, and microbatch ``i`` depends on
``(seed, num_shards, i)`` alone. Held-out microbatch ``i`` is the ``i``-th run of
consecutive held-out windows, the same for every trainer.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.trainer.data import Microbatch
from services.trainer.documents import data_files, iter_documents

CACHE_VERSION = 1
TOKENS, META = "tokens.bin", "meta.json"
ENCODE_BATCH_DOCS = 256
DEFAULT_EVAL_FRACTION = 0.05


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/swarm-mesh/tokens`` (``~/.cache/...``): where SWARM_TOKEN_CACHE_DIR points by default."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "swarm-mesh" / "tokens"


@dataclass
class TokenCache:
    path: Path
    tokens: np.ndarray  # memory-mapped ids of every document, each followed by the end-of-text id
    n_train: int  # ids before the held-out split
    meta: dict
    built: bool  # False: an existing cache was reused

    @property
    def n_eval(self) -> int:
        return len(self.tokens) - self.n_train


def cache_key(files: list[Path], tokenizer, eval_fraction: float) -> str:
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    blob = json.dumps(
        {"version": CACHE_VERSION, "tokenizer": tokenizer.fingerprint, "files": stats, "eval_fraction": eval_fraction}
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def open_token_cache(
    corpus: str | Path, tokenizer, root: str | Path, *, eval_fraction: float = DEFAULT_EVAL_FRACTION, log=None
) -> TokenCache:
    """The cache of ``corpus`` tokenized by ``tokenizer`` under ``root``: opened if it exists, else built."""
    files = data_files(corpus)
    root = Path(root)
    path = root / cache_key(files, tokenizer, eval_fraction)
    if (path / META).is_file():
        return _open(path, built=False)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a trainer that comes second waits here, then reuses
        if (path / META).is_file():
            return _open(path, built=False)
        _build(path, corpus, files, tokenizer, eval_fraction, log)
    return _open(path, built=True)


def _build(path: Path, corpus, files: list[Path], tokenizer, eval_fraction: float, log) -> None:
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    n_tokens = n_docs = 0
    with open(tmp / TOKENS, "wb") as out:
        batch: list[str] = []
        for doc in (*iter_documents(corpus), None):
            if doc is not None:
                batch.append(doc)
            if batch and (doc is None or len(batch) >= ENCODE_BATCH_DOCS):
                for ids in tokenizer.encode_batch(batch):
                    np.asarray([*ids, tokenizer.eos_id], dtype=dtype).tofile(out)
                    n_tokens += len(ids) + 1
                n_docs += len(batch)
                batch = []
    n_eval = int(n_tokens * eval_fraction)
    meta = {
        "version": CACHE_VERSION,
        "tokenizer": tokenizer.name,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "dtype": np.dtype(dtype).name,
        "documents": n_docs,
        "tokens": n_tokens,
        "train_tokens": n_tokens - n_eval,
        "files": [str(f) for f in files],
        "eval_fraction": eval_fraction,
    }
    (tmp / META).write_text(json.dumps(meta, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    if log:
        log.info("tokens.cached", path=str(path), documents=n_docs, tokens=n_tokens, tokenizer=tokenizer.name)


def _open(path: Path, *, built: bool) -> TokenCache:
    meta = json.loads((path / META).read_text())
    tokens = (
        np.memmap(path / TOKENS, dtype=np.dtype(meta["dtype"]), mode="r")
        if meta["tokens"]
        else np.zeros(0, dtype=np.uint16)
    )
    return TokenCache(path, tokens, int(meta["train_tokens"]), meta, built)


class TokenBatcher:
    """Microbatches of a :class:`TokenCache`: trainer shards of disjoint samples (module docstring)."""

    def __init__(self, cache: TokenCache, seq_len: int, microbatch_size: int, *, seed: int = 0, num_shards: int = 1):
        self.cache, self.seq_len, self.microbatch_size = cache, seq_len, microbatch_size
        self.seed, self.num_shards = seed, num_shards
        num_samples = max(0, (cache.n_train - 1) // seq_len)
        self.num_eval_samples = max(0, (cache.n_eval - 1) // seq_len)
        if num_samples < num_shards * microbatch_size or self.num_eval_samples < 1:
            raise ValueError(
                f"the corpus' {cache.meta['tokens']} tokens are too few for seq_len={seq_len} "
                f"x microbatch_size={microbatch_size} "
                f"per trainer ({num_shards}) and one held-out window (settings SWARM_SEQ_LEN, SWARM_CORPUS)"
            )
        order = np.random.default_rng([seed, 0x5EED]).permutation(num_samples)
        self.shards = [order[t::num_shards] for t in range(num_shards)]  # sample numbers of each trainer

    def sample_numbers(self, index: int) -> np.ndarray:
        """The samples of run microbatch ``index``: the next ones of its trainer's shard."""
        shard = self.shards[index % self.num_shards]
        positions = (index // self.num_shards) * self.microbatch_size + np.arange(self.microbatch_size)
        passes, within = positions // len(shard), positions % len(shard)
        out = np.empty(self.microbatch_size, dtype=np.int64)
        for p in np.unique(passes):  # every pass over the shard after the first in a new order
            order = (
                shard
                if p == 0
                else shard[np.random.default_rng([self.seed, index % self.num_shards, int(p)]).permutation(len(shard))]
            )
            out[passes == p] = order[within[passes == p]]
        return out

    def microbatch(self, index: int, *, split: str = "train") -> Microbatch:
        if split == "train":
            starts = self.sample_numbers(index) * self.seq_len
        else:
            starts = (
                self.cache.n_train
                + ((index * self.microbatch_size + np.arange(self.microbatch_size)) % self.num_eval_samples)
                * self.seq_len
            )
        windows = torch.from_numpy(
            np.stack([self.cache.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        )
        return Microbatch(index, windows[:, :-1].contiguous(), windows[:, 1:].contiguous())
