"""Corpus loading and ByteBatcher: deterministic, contiguous windows, held-out eval tail."""

from __future__ import annotations

import gzip
import random

import pytest
import torch

from services.trainer.data import BUNDLED_CORPUS, ByteBatcher, load_corpus

SEQ_LEN = 16


def random_corpus(n: int = 20_000, seed: int = 0) -> torch.Tensor:
    """Random bytes: every window of SEQ_LEN + 1 bytes occurs at exactly one place (w.h.p.),
    so a window's position in the corpus can be recovered with bytes.find."""
    rng = random.Random(seed)
    return torch.tensor(list(rng.randbytes(n)), dtype=torch.uint8)


def window(mb, row: int) -> bytes:
    """Row ``row`` of a microbatch as the raw window it was cut from: inputs + last target."""
    return bytes(mb.inputs[row].tolist() + [mb.targets[row, -1].item()])


# --- load_corpus ---------------------------------------------------------------------


def test_bundled_corpus_loads_as_ascii_prose():
    tokens = load_corpus()
    assert tokens.dtype == torch.uint8 and tokens.dim() == 1
    assert len(tokens) >= 1_000_000
    raw = bytes(tokens.tolist())
    assert raw == gzip.decompress(BUNDLED_CORPUS.read_bytes())
    assert max(raw) < 128  # plain ASCII
    assert b"HAMLET" in raw and b"the " in raw
    assert load_corpus("").equal(tokens) and load_corpus(None).equal(tokens)  # empty setting: bundled


def test_local_text_file_loads_by_path(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"To be, or not to be\n\xff")
    for given in (path, str(path)):
        tokens = load_corpus(given)
        assert tokens.dtype == torch.uint8
        assert bytes(tokens.tolist()) == b"To be, or not to be\n\xff"


def test_gz_file_is_decompressed(tmp_path):
    text = b"that is the question\n" * 100
    path = tmp_path / "corpus.txt.gz"
    path.write_bytes(gzip.compress(text))
    assert bytes(load_corpus(path).tolist()) == text


def test_missing_file_raises_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match="SWARM_CORPUS"):
        load_corpus(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match="SWARM_CORPUS"):
        load_corpus(tmp_path)  # a directory is not a corpus file


# --- ByteBatcher ---------------------------------------------------------------------


def test_microbatch_is_deterministic_in_seed_and_index():
    tokens = random_corpus()
    a, b = ByteBatcher(tokens, SEQ_LEN, 4, seed=3), ByteBatcher(tokens, SEQ_LEN, 4, seed=3)
    for i in (0, 1, 17):
        x, y = a.microbatch(i), b.microbatch(i)
        assert x.index == i
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
        assert torch.equal(a.microbatch(i).inputs, x.inputs)  # asking again: the same
    assert not torch.equal(a.microbatch(0).inputs, a.microbatch(1).inputs)
    other_seed = ByteBatcher(tokens, SEQ_LEN, 4, seed=4)
    assert not torch.equal(a.microbatch(0).inputs, other_seed.microbatch(0).inputs)
    assert not torch.equal(a.microbatch(0).inputs, a.microbatch(0, split="eval").inputs)


def test_shapes_and_dtypes():
    mb = ByteBatcher(random_corpus(), SEQ_LEN, 5).microbatch(0)
    assert mb.inputs.shape == mb.targets.shape == (5, SEQ_LEN)
    assert mb.inputs.dtype == mb.targets.dtype == torch.int64
    assert mb.num_tokens == 5 * SEQ_LEN
    assert 0 <= int(mb.inputs.min()) and int(mb.inputs.max()) < 256


def test_targets_are_inputs_shifted_by_one_within_a_contiguous_train_window():
    tokens = random_corpus()
    batcher = ByteBatcher(tokens, SEQ_LEN, 8, seed=1)
    raw = bytes(tokens.tolist())
    train_end = len(batcher.train)
    for i in range(10):
        mb = batcher.microbatch(i)
        assert torch.equal(mb.inputs[:, 1:], mb.targets[:, :-1])
        for row in range(mb.inputs.shape[0]):
            pos = raw.find(window(mb, row))
            assert pos != -1, "row is not a contiguous window of the corpus"
            assert pos + SEQ_LEN + 1 <= train_end, "train window reaches into the eval split"


def test_targets_shift_on_the_bundled_corpus():
    tokens = load_corpus()
    batcher = ByteBatcher(tokens, 64, 4, seed=0)
    train_raw = bytes(batcher.train.tolist())
    mb = batcher.microbatch(5)
    assert torch.equal(mb.inputs[:, 1:], mb.targets[:, :-1])
    for row in range(4):
        assert train_raw.find(window(mb, row)) != -1


def test_eval_windows_come_from_the_held_out_tail():
    tokens = random_corpus(40_000)
    batcher = ByteBatcher(tokens, SEQ_LEN, 8, seed=0, eval_fraction=0.1)
    n_eval = int(len(tokens) * 0.1)
    assert len(batcher.eval) == n_eval and len(batcher.train) + n_eval == len(tokens)
    assert torch.equal(batcher.eval, tokens[-n_eval:])
    raw = bytes(tokens.tolist())
    train_end = len(tokens) - n_eval
    for i in range(10):
        mb = batcher.microbatch(i, split="eval")
        assert torch.equal(mb.inputs[:, 1:], mb.targets[:, :-1])
        for row in range(8):
            pos = raw.find(window(mb, row))
            assert pos >= train_end, f"eval window at {pos} lies in the train split (< {train_end})"


def test_too_short_corpus_raises_naming_seq_len():
    with pytest.raises(ValueError, match="SWARM_SEQ_LEN"):
        ByteBatcher(random_corpus(50), 64, 2)
    # long enough to train on, but the held-out 5% is shorter than one window
    with pytest.raises(ValueError, match="SWARM_SEQ_LEN"):
        ByteBatcher(random_corpus(1_000), 64, 2)
    ByteBatcher(random_corpus(2_000), 64, 2)  # 100 held-out bytes: enough


def test_different_seeds_do_not_share_microbatch_streams():
    tokens = random_corpus()
    seed0, seed2 = ByteBatcher(tokens, SEQ_LEN, 4, seed=0), ByteBatcher(tokens, SEQ_LEN, 4, seed=2)
    assert not torch.equal(seed0.microbatch(7_919).inputs, seed2.microbatch(0).inputs)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_samples_do_not_depend_on_the_microbatch_size(split):
    """A run's samples are one stream however it cuts them: microbatches of 1, 2, 3, 5 or 12
    hold, in order, the windows that microbatches of 8 hold (so a side that trains with
    smaller microbatches trains on the same global batches as one process with 8)."""
    tokens = random_corpus()
    eights = ByteBatcher(tokens, SEQ_LEN, 8, seed=5)
    stream = torch.cat([eights.microbatch(i, split=split).inputs for i in range(6)])  # samples 0..47
    for size in (1, 2, 3, 5, 12):
        batcher = ByteBatcher(tokens, SEQ_LEN, size, seed=5)
        count = 48 // size
        cut = torch.cat([batcher.microbatch(i, split=split).inputs for i in range(count)])
        assert torch.equal(cut, stream[: count * size]), size
        later = batcher.microbatch(count + 3, split=split)  # a microbatch past the first draws: its own samples
        first = (count + 3) * size
        assert torch.equal(later.inputs[0], eights.microbatch(first // 8, split=split).inputs[first % 8])
