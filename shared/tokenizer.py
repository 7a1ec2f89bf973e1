"""Tokenizers: bytes for the byte-level presets, Hugging Face ``tokenizers`` for the rest.

- :class:`ByteTokenizer`: the 256 byte values, for the ``gpt`` presets (``tiny`` ...). The
  NUL byte separates documents (it does not occur in text).
- :class:`HFTokenizer`: a ``tokenizer.json`` (a Hugging Face model directory's, or one
  trained by ``swarm tokenizer train``). Its end-of-text token separates documents.
- :func:`train_bpe`: a byte-level BPE trained on documents, written as ``tokenizer.json``
  plus ``tokenizer_config.json``, so that ``transformers.AutoTokenizer`` loads the
  directory too.
- :func:`save_byte_tokenizer`: :class:`ByteTokenizer` as such a directory (``swarm tokenizer
  bytes``), for tools that want a Hugging Face tokenizer of a byte-level model
  (lm-evaluation-harness, ``swarm export --format hf --tokenizer``).

:func:`load_tokenizer` picks the run's tokenizer from SWARM_MODEL and SWARM_TOKENIZER and
refuses one with more tokens than the model's vocabulary, naming the file and the settings.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Iterable, Protocol

from shared.model import ModelConfig

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
EOS_TOKEN = "<|endoftext|>"
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>")


class Tokenizer(Protocol):
    vocab_size: int  # ids lie in [0, vocab_size)
    eos_id: int  # separates documents
    fingerprint: str  # changes whenever the token ids of a text could change

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    vocab_size = 256
    eos_id = 0
    fingerprint = "bytes"
    name = "bytes"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` (``path``: the file, or a directory holding it)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        self.file = path / TOKENIZER_FILE if path.is_dir() else path
        if not self.file.is_file():
            raise ValueError(
                f"no tokenizer at {self.file} (setting SWARM_TOKENIZER, "
                "or the tokenizer.json of SWARM_MODEL's directory)"
            )
        raw = self.file.read_bytes()
        try:
            self._tok = _Tokenizer.from_str(raw.decode())
        except Exception as exc:  # tokenizers raises its own Exception type for a malformed file
            raise ValueError(
                f"{self.file} is not a Hugging Face tokenizer.json: {exc} (setting SWARM_TOKENIZER)"
            ) from None
        self.name = str(self.file)
        self.fingerprint = hashlib.sha256(raw).hexdigest()[:16]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_special("eos")
        self.bos_id = self._find_special("bos", required=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def _find_special(self, kind: str, required: bool = True) -> int | None:
        """The ``eos`` (end of text) or ``bos`` id: named by the directory's
        tokenizer_config.json, else by its generation_config.json or config.json, else (eos)
        a token of a well-known name."""
        folder = self.file.parent
        token = _json(folder / TOKENIZER_CONFIG).get(f"{kind}_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and self._tok.token_to_id(token) is not None:
            return self._tok.token_to_id(token)
        for name in ("generation_config.json", "config.json"):
            value = _json(folder / name).get(f"{kind}_token_id")
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int) and 0 <= value < self.vocab_size:
                return value
        for token in _EOS_CANDIDATES if kind == "eos" else ():
            if (value := self._tok.token_to_id(token)) is not None:
                return value
        if required:
            raise ValueError(
                f"{self.file}: no end-of-text token to separate documents (none named in {TOKENIZER_CONFIG}, no "
                f"eos_token_id, none of {list(_EOS_CANDIDATES)})"
            )
        return None


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def load_tokenizer(model: str, tokenizer: str, cfg: ModelConfig) -> ByteTokenizer | HFTokenizer:
    """The run's tokenizer: ``tokenizer`` (SWARM_TOKENIZER) if set, else the tokenizer.json of
    the model directory ``model`` (SWARM_MODEL), else bytes for a byte-level preset.
    ValueError naming the file and the setting when there is none or it does not fit ``cfg``."""
    from shared.hf import is_hf_dir

    if tokenizer:
        tok = HFTokenizer(tokenizer)
    elif is_hf_dir(model):
        tok = HFTokenizer(model)
    elif cfg.vocab_size == ByteTokenizer.vocab_size:
        tok = ByteTokenizer()
    else:
        raise ValueError(
            f"SWARM_MODEL={model} has a vocabulary of {cfg.vocab_size} tokens and needs a tokenizer: train one with "
            f"`swarm tokenizer train --corpus FILES --vocab-size {cfg.vocab_size} --out DIR` and set "
            "SWARM_TOKENIZER=DIR"
        )
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"the tokenizer {tok.name} has {tok.vocab_size} tokens, more than the model's vocabulary of "
            f"{cfg.vocab_size} (settings SWARM_TOKENIZER and SWARM_MODEL={model}): its ids would not fit the embedding"
        )
    return tok


def train_bpe(
    documents: Iterable[str], vocab_size: int, out_dir: str | Path, *, model_max_length: int = 0
) -> HFTokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` is id 0) on
    ``documents`` and write ``out_dir/tokenizer.json`` and ``tokenizer_config.json``."""
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"--vocab-size must be at least 257 (the 256 bytes and {EOS_TOKEN}), got {vocab_size}")
    tok = _Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / TOKENIZER_FILE))
    write_tokenizer_config(out, eos_token=EOS_TOKEN, model_max_length=model_max_length)
    return HFTokenizer(out)


def write_tokenizer_config(
    out_dir: Path, *, eos_token: str, bos_token: str | None = None, model_max_length: int = 0
) -> Path:
    """A ``tokenizer_config.json`` that makes ``transformers.AutoTokenizer`` load ``tokenizer.json``
    (the beginning of text is the end-of-text token unless ``bos_token`` says otherwise, as in GPT-2)."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "bos_token": bos_token or eos_token,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
    }
    if model_max_length:
        config["model_max_length"] = model_max_length
    path = Path(out_dir) / TOKENIZER_CONFIG
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


BYTE_TOKEN = "<0x{:02X}>"  # byte b's token, as SentencePiece's byte fallback names it


def save_byte_tokenizer(out_dir: str | Path, *, model_max_length: int = 0) -> HFTokenizer:
    """:class:`ByteTokenizer` as a Hugging Face tokenizer in ``out_dir`` (tokenizer.json,
    tokenizer_config.json): token b is byte b (``<0x62>``), every text falls back to its
    UTF-8 bytes, and the end of text is ``<0x00>`` (id 0, the NUL byte). Its ids equal
    ByteTokenizer's for every text but one holding the literal ``<0x00>``, which a special
    token matches as the end of text, as ``transformers`` does with every special token."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as _Tokenizer

    vocab = {BYTE_TOKEN.format(b): b for b in range(ByteTokenizer.vocab_size)}
    tok = _Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    eos = BYTE_TOKEN.format(ByteTokenizer.eos_id)
    tok.add_special_tokens([AddedToken(eos, special=True, normalized=False)])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / TOKENIZER_FILE))
    write_tokenizer_config(out, eos_token=eos, model_max_length=model_max_length)
    return HFTokenizer(out)


TOKENIZER_FILES = (
    TOKENIZER_FILE,
    TOKENIZER_CONFIG,
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def save_tokenizer(source: str | Path, out_dir: str | Path, *, model_max_length: int = 0) -> HFTokenizer:
    """Copy the tokenizer ``source`` (a tokenizer.json, or a directory holding one) into
    ``out_dir`` so that ``transformers.AutoTokenizer`` loads it: a directory's tokenizer files
    as they are, plus a tokenizer_config.json where there is none."""
    tok = HFTokenizer(source)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(source) if Path(source).is_dir() else None
    for name in TOKENIZER_FILES if folder else ():
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
    if folder is None:
        shutil.copyfile(tok.file, out / TOKENIZER_FILE)
    if not (out / TOKENIZER_CONFIG).is_file():
        bos = tok.token(tok.bos_id) if tok.bos_id is not None else None
        write_tokenizer_config(out, eos_token=tok.token(tok.eos_id), bos_token=bos, model_max_length=model_max_length)
    return tok
