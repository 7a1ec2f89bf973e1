"""``swarm tokenizer train``: a byte-level BPE tokenizer trained on a corpus, for from-scratch runs;
``swarm tokenizer bytes``: the byte-level presets' tokenizer as a Hugging Face directory.

    swarm tokenizer train --model llama-tiny --out runs/tok                # the bundled corpus, the preset's vocabulary
    swarm tokenizer train --corpus DATA --vocab-size 8192 --out DIR
    swarm tokenizer bytes --out DIR [--model tiny]

Reads the documents of ``--corpus`` (a text file, JSONL, Parquet or a directory of them,
as the trainer does; default: the bundled Shakespeare), trains a byte-level BPE with
Hugging Face ``tokenizers`` (``<|endoftext|>`` is id 0 and separates documents) and
writes ``DIR/tokenizer.json`` and ``DIR/tokenizer_config.json``. Then run with
``SWARM_TOKENIZER=DIR`` (``swarm up --tokenizer DIR``). ``bytes`` writes the 256-byte
tokenizer of the ``gpt`` presets (``shared.tokenizer.save_byte_tokenizer``) where a tool
wants a Hugging Face tokenizer (``AutoTokenizer``): lm-evaluation-harness' ``tokenizer=DIR``,
``swarm export --format hf --tokenizer DIR``. Exit status: 0 written, 2 bad arguments or data.
"""

from __future__ import annotations

import argparse
import sys
import time

from services.trainer.data import BUNDLED_CORPUS
from services.trainer.documents import iter_documents
from shared.model import PRESETS
from shared.tokenizer import ByteTokenizer, save_byte_tokenizer, train_bpe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="swarm tokenizer", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a byte-level BPE on a corpus")
    train.add_argument(
        "--corpus",
        default="",
        help="text file, JSONL, Parquet or a directory of them (default: the bundled Shakespeare corpus)",
    )
    train.add_argument(
        "--vocab-size",
        type=int,
        default=0,
        help="tokens in the vocabulary, <|endoftext|> included (default: the vocabulary of --model)",
    )
    train.add_argument(
        "--model",
        default="",
        choices=["", *sorted(n for n, c in PRESETS.items() if c.vocab_size > 256)],
        help="a preset whose vocabulary size to train for",
    )
    train.add_argument("--out", required=True, help="directory to write tokenizer.json and tokenizer_config.json into")
    byte = sub.add_parser("bytes", help="the byte-level presets' tokenizer as a Hugging Face tokenizer directory")
    byte.add_argument(
        "--model",
        default="",
        choices=["", *sorted(n for n, c in PRESETS.items() if c.vocab_size == ByteTokenizer.vocab_size)],
        help="a byte-level preset whose context length the tokenizer states (model_max_length)",
    )
    byte.add_argument("--out", required=True, help="directory to write tokenizer.json and tokenizer_config.json into")
    args = p.parse_args(argv)
    if args.command == "bytes":
        tok = save_byte_tokenizer(args.out, model_max_length=PRESETS[args.model].block_size if args.model else 0)
        print(f"swarm tokenizer: wrote {tok.file} ({tok.vocab_size} byte tokens, end of text id {tok.eos_id})")
        return 0
    vocab_size = args.vocab_size or (PRESETS[args.model].vocab_size if args.model else 0)
    if not vocab_size:
        p.error("give --vocab-size or --model")
    if args.model and vocab_size > PRESETS[args.model].vocab_size:
        p.error(f"--vocab-size {vocab_size} exceeds the vocabulary of {args.model} ({PRESETS[args.model].vocab_size})")
    started = time.perf_counter()
    try:
        tok = train_bpe(
            iter_documents(args.corpus or BUNDLED_CORPUS),
            vocab_size,
            args.out,
            model_max_length=PRESETS[args.model].block_size if args.model else 0,
        )
    except ValueError as exc:
        print(f"swarm tokenizer: {exc}", file=sys.stderr)
        return 2
    print(
        f"swarm tokenizer: wrote {tok.file} ({tok.vocab_size} tokens, end of text id {tok.eos_id}) in "
        f"{time.perf_counter() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
