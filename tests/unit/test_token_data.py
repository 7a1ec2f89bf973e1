"""Documents (text, JSONL, Parquet, shard directories), the token cache and its batches:
reused on a second run, disjoint between trainers, the held-out split never trained on."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

from services.trainer.data import ByteBatcher, make_batcher
from services.trainer.documents import data_files, iter_documents
from services.trainer.token_cache import TokenBatcher, open_token_cache
from shared.config import TrainerSettings
from shared.model import PRESETS
from shared.tokenizer import ByteTokenizer, train_bpe

DOCS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1) for i in range(300)]


class CountingTokenizer(ByteTokenizer):
    """Bytes, counting the texts it encodes."""

    def __init__(self):
        self.encoded = 0

    def encode_batch(self, texts):
        self.encoded += len(texts)
        return super().encode_batch(texts)


def write_shards(root, docs=DOCS):
    """The documents as a directory of shards: JSONL, gzipped JSONL and Parquet (and a text file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "b").mkdir(parents=True)
    (root / "a.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:100])))
    with gzip.open(root / "b" / "c.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps({"text": d}) for d in docs[100:200]) + "\n\n")
    pq.write_table(pa.table({"text": docs[200:299], "n": list(range(99))}), root / "b" / "d.parquet", row_group_size=16)
    (root / "b" / "e.txt").write_text(docs[299])
    (root / "notes.csv").write_text("ignored")
    return root


# ---------------------------------------------------------------- documents
def test_a_directory_of_shards_reads_every_document_in_order(tmp_path):
    root = write_shards(tmp_path / "data")
    assert [p.name for p in data_files(root)] == ["a.jsonl", "c.jsonl.gz", "d.parquet", "e.txt"]
    assert list(iter_documents(root)) == DOCS


def test_single_files_of_each_kind(tmp_path):
    root = write_shards(tmp_path / "data")
    assert list(iter_documents(root / "a.jsonl")) == DOCS[:100]
    assert list(iter_documents(root / "b" / "d.parquet")) == DOCS[200:299]


@pytest.mark.parametrize(
    "name, body, words",
    [
        ("bad.jsonl", '{"text": "ok"}\n{"txt": "no"}\n', "bad.jsonl:2"),
        ("bad.jsonl", '{"text": 3}\n', "not a string"),
        ("bad.csv", "a,b\n", "unknown data format"),
    ],
)
def test_bad_data_is_named_with_the_setting(tmp_path, name, body, words):
    (tmp_path / name).write_text(body)
    with pytest.raises(ValueError, match=words) as exc:
        list(iter_documents(tmp_path / name))
    assert "SWARM_CORPUS" in str(exc.value)


def test_parquet_without_a_text_column_and_an_empty_directory_are_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="'text' column"):
        list(iter_documents(tmp_path / "x.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="SWARM_CORPUS"):
        data_files(tmp_path / "empty")


# ---------------------------------------------------------------- the cache
def test_the_cache_is_built_once_and_reused_and_documents_end_with_eos(tmp_path):
    root = write_shards(tmp_path / "data")
    tok = CountingTokenizer()
    first = open_token_cache(root, tok, tmp_path / "cache")
    assert first.built and tok.encoded == len(DOCS)
    expected = [b for d in DOCS for b in [*d.encode(), tok.eos_id]]
    assert first.tokens.tolist() == expected and first.meta["documents"] == len(DOCS)
    mtime = (first.path / "tokens.bin").stat().st_mtime_ns
    second = open_token_cache(root, tok, tmp_path / "cache")
    assert not second.built and tok.encoded == len(DOCS)  # nothing tokenized again
    assert second.path == first.path and (second.path / "tokens.bin").stat().st_mtime_ns == mtime
    assert isinstance(second.tokens, np.memmap)
    (root / "a.jsonl").write_text(json.dumps({"text": "changed"}) + "\n")
    assert open_token_cache(root, tok, tmp_path / "cache").path != first.path  # changed data: a new cache


def test_a_bpe_cache_holds_the_tokenizer_ids(tmp_path):
    tok = train_bpe(DOCS, 300, tmp_path / "tok")
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:5]))
    cache = open_token_cache(path, tok, tmp_path / "cache")
    assert cache.tokens.dtype == np.uint16
    assert cache.tokens.tolist() == [i for d in DOCS[:5] for i in [*tok.encode(d), tok.eos_id]]


@pytest.fixture
def cache(tmp_path):
    return open_token_cache(write_shards(tmp_path / "data"), ByteTokenizer(), tmp_path / "cache")


def test_two_trainers_see_disjoint_samples_within_a_pass(cache):
    seq, batch = 16, 4
    batchers = [TokenBatcher(cache, seq, batch, seed=7, num_shards=2) for _ in range(2)]
    per_pass = min(len(s) for s in batchers[0].shards) // batch
    seen = []
    for t in range(2):  # trainer t takes run microbatches t, t + 2, t + 4, ... (Trainer.microbatch_index)
        samples = np.concatenate([batchers[t].sample_numbers(t + 2 * k) for k in range(per_pass)])
        assert len(set(samples.tolist())) == len(samples), "a trainer repeats a sample within a pass"
        seen.append(set(samples.tolist()))
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    # the same, by the tokens' positions: no input position is shared between trainers
    spans = [{(int(s) * seq + i) for s in samples for i in range(seq)} for samples in seen]
    assert not spans[0] & spans[1]
    # and across later passes too: each trainer only ever reads its own shard
    later = [
        set(np.concatenate([batchers[t].sample_numbers(t + 2 * k) for k in range(per_pass, 3 * per_pass)]).tolist())
        for t in range(2)
    ]
    assert later[0] <= set(batchers[0].shards[0].tolist()) and later[1] <= set(batchers[0].shards[1].tolist())


def test_microbatches_are_deterministic_windows_of_the_train_split(cache):
    a, b = TokenBatcher(cache, 16, 4, seed=1), TokenBatcher(cache, 16, 4, seed=1)
    raw = bytes(cache.tokens.tolist())
    for i in (0, 1, 50, 10_000):  # 10,000: many passes over the data
        x, y = a.microbatch(i), b.microbatch(i)
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
        assert torch.equal(x.inputs[:, 1:], x.targets[:, :-1]) and x.inputs.dtype == torch.int64
        for row in range(4):
            window = bytes(x.inputs[row].tolist() + [x.targets[row, -1].item()])
            assert raw.find(window) + 17 <= cache.n_train, "a training window reaches into the held-out split"
    assert not torch.equal(a.microbatch(0).inputs, TokenBatcher(cache, 16, 4, seed=2).microbatch(0).inputs)


def test_the_held_out_split_is_never_trained_on(cache):
    batcher = TokenBatcher(cache, 16, 4, seed=0)
    starts = np.concatenate([batcher.sample_numbers(i) for i in range(3000)]) * 16
    assert starts.max() + 17 <= cache.n_train and cache.n_eval > 0
    for i in range(5):
        mb = batcher.microbatch(i, split="eval")
        assert torch.equal(mb.inputs[:, 1:], mb.targets[:, :-1])
    # every held-out window comes from the last 5% of the ids
    tail = bytes(cache.tokens[cache.n_train :].tolist())
    assert all(
        tail.find(bytes(batcher.microbatch(i, split="eval").inputs[r].tolist())) >= 0
        for i in range(5)
        for r in range(4)
    )


def test_too_little_data_names_the_settings(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "short"}) + "\n")
    cache = open_token_cache(tmp_path / "d.jsonl", ByteTokenizer(), tmp_path / "cache")
    with pytest.raises(ValueError, match="SWARM_SEQ_LEN"):
        TokenBatcher(cache, 16, 4)


# ---------------------------------------------------------------- which batches a run gets
def settings(**kw):
    return TrainerSettings(**{"run_id": "t", "mdns": False, "seq_len": 16, "microbatch_size": 4, **kw})


def test_a_byte_preset_on_the_bundled_corpus_keeps_the_byte_batcher(tmp_path):
    batcher = make_batcher(settings(model="tiny", token_cache_dir=str(tmp_path)), PRESETS["tiny"])
    assert isinstance(batcher, ByteBatcher)
    assert not any(tmp_path.iterdir())  # no cache for the byte path


def test_jsonl_with_a_byte_preset_and_a_llama_with_its_tokenizer_use_the_cache(tmp_path):
    root = write_shards(tmp_path / "data")
    batcher = make_batcher(
        settings(model="tiny", corpus=str(root), token_cache_dir=str(tmp_path / "c")), PRESETS["tiny"]
    )
    assert isinstance(batcher, TokenBatcher) and batcher.cache.meta["eos_id"] == 0
    tok = train_bpe(DOCS, 300, tmp_path / "tok")
    s = settings(
        model="llama-tiny",
        tokenizer=str(tmp_path / "tok"),
        corpus=str(root),
        token_cache_dir=str(tmp_path / "c"),
        num_shards=2,
        shard_index=1,
    )
    batcher = make_batcher(s, PRESETS["llama-tiny"])
    assert (
        isinstance(batcher, TokenBatcher)
        and batcher.num_shards == 2
        and batcher.cache.meta["tokenizer_fingerprint"] == tok.fingerprint
    )
    assert int(batcher.microbatch(1).inputs.max()) < 300
