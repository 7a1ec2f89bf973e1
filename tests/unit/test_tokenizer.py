"""Tokenizers (shared/tokenizer.py): a BPE trained on a corpus, bytes, and which one a run uses."""

from __future__ import annotations

import gzip

import pytest

from services.trainer.data import BUNDLED_CORPUS
from shared.model import PRESETS
from shared.tokenizer import (
    EOS_TOKEN,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    save_byte_tokenizer,
    save_tokenizer,
    train_bpe,
)

SAMPLE = gzip.decompress(BUNDLED_CORPUS.read_bytes())[:200_000].decode()
TEXT = "Now is the winter of our discontent\nMade glorious summer by this sun of York; ünïcödé ✓\n\n  spaces  "


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_bpe([SAMPLE], 512, tmp_path_factory.mktemp("tok"))


def test_a_trained_bpe_has_its_vocabulary_round_trips_text_and_ends_text_with_id_0(bpe):
    assert bpe.vocab_size == 512 and bpe.eos_id == 0 and bpe.token(0) == EOS_TOKEN
    ids = bpe.encode(TEXT)
    assert bpe.decode(ids) == TEXT
    assert (
        len(bpe.encode(SAMPLE[:5000])) < 5000 / 1.5
    )  # it compresses what it was trained on (255 merges: 1.85 bytes a token)
    assert bpe.encode_batch([TEXT, "x"]) == [ids, bpe.encode("x")]
    assert 0 not in ids  # the separator never comes out of text


def test_training_is_deterministic(bpe, tmp_path):
    again = train_bpe([SAMPLE], 512, tmp_path)
    assert again.file.read_bytes() == bpe.file.read_bytes() and again.fingerprint == bpe.fingerprint


def test_transformers_loads_the_trained_tokenizer_directory(bpe):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(bpe.file.parent)
    assert tok.encode(TEXT, add_special_tokens=False) == bpe.encode(TEXT)
    assert tok.decode(bpe.encode(TEXT)) == TEXT and tok.eos_token_id == 0


def test_save_tokenizer_copies_a_file_so_that_autotokenizer_loads_it(bpe, tmp_path):
    transformers = pytest.importorskip("transformers")
    save_tokenizer(bpe.file, tmp_path)  # a bare tokenizer.json: the config is written
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).encode(TEXT, add_special_tokens=False) == bpe.encode(
        TEXT
    )


def test_bytes_round_trip():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode_batch([TEXT])[0]) == TEXT and tok.eos_id == 0 and tok.vocab_size == 256


def test_the_byte_tokenizer_as_a_hugging_face_directory_gives_the_same_ids(tmp_path):
    transformers = pytest.importorskip("transformers")
    saved = save_byte_tokenizer(tmp_path, model_max_length=128)
    text = TEXT + "\x00after the end of a document"
    expected = ByteTokenizer().encode_batch([text])[0]
    assert saved.vocab_size == 256 and saved.eos_id == 0 and saved.encode(text) == expected
    assert saved.decode(expected) == text
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)  # as lm-eval's tokenizer= and --model hf load it
    assert auto(text, add_special_tokens=False)["input_ids"] == expected and auto.decode(expected) == text
    assert (auto.eos_token_id, auto.model_max_length, len(auto)) == (0, 128, 256)
    assert isinstance(load_tokenizer("", str(tmp_path), PRESETS["tiny"]), HFTokenizer)  # fits a byte preset


def test_the_run_tokenizer_bytes_for_byte_presets_and_a_clear_error_for_llama_without_one(bpe):
    assert isinstance(load_tokenizer("tiny", "", PRESETS["tiny"]), ByteTokenizer)
    with pytest.raises(ValueError, match="SWARM_TOKENIZER") as exc:
        load_tokenizer("llama-tiny", "", PRESETS["llama-tiny"])
    assert "swarm tokenizer train" in str(exc.value)
    tok = load_tokenizer("llama-tiny", str(bpe.file.parent), PRESETS["llama-tiny"])
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 512


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_naming_file_and_settings(bpe):
    with pytest.raises(ValueError) as exc:
        load_tokenizer("tiny", str(bpe.file), PRESETS["tiny"])  # 512 tokens into a 256-byte vocabulary
    message = str(exc.value)
    assert str(bpe.file) in message and "SWARM_TOKENIZER" in message and "SWARM_MODEL" in message


def test_a_missing_or_malformed_tokenizer_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="SWARM_TOKENIZER"):
        HFTokenizer(tmp_path / "nope.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=str(bad)):
        HFTokenizer(tmp_path)


def test_vocab_size_below_the_bytes_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab-size"):
        train_bpe(["abc"], 100, tmp_path)
