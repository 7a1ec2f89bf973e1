"""Documents of a corpus: text files, JSONL (a ``text`` field per line) and Parquet (a
``text`` column), one file or a directory of shards.

- ``.txt``, ``.md`` (and ``.gz`` of either): the whole file is one document.
- ``.jsonl`` (and ``.jsonl.gz``): one JSON object per line, its ``text`` field one document.
- ``.parquet``: one document per row of the ``text`` column (read in batches, with pyarrow).

A directory is read recursively, its files in sorted order, so every trainer and every run
sees the same documents in the same order.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterator

TEXT_FIELD = "text"
TEXT_SUFFIXES = (".txt", ".md", ".txt.gz", ".md.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
DATA_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
PARQUET_BATCH_ROWS = 1024


def data_files(path: str | Path) -> list[Path]:
    """The data files of ``path`` (a file, or a directory read recursively, sorted);
    ValueError naming SWARM_CORPUS when there are none."""
    path = Path(path)
    if path.is_file():
        if not _kind(path):
            raise ValueError(
                f"{path}: unknown data format; a corpus file ends in one of {', '.join(DATA_SUFFIXES)} "
                "(setting SWARM_CORPUS)"
            )
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p))
        if not files:
            raise ValueError(f"{path} holds no data files ({', '.join(DATA_SUFFIXES)}) (setting SWARM_CORPUS)")
        return files
    raise ValueError(f"corpus {str(path)!r} does not exist (setting SWARM_CORPUS)")


def is_document_data(path: str | Path) -> bool:
    """True for JSONL, Parquet or a directory: data that is read as documents, not as one text."""
    path = Path(path)
    return path.is_dir() or _kind(path) in ("jsonl", "parquet")


def iter_documents(path: str | Path) -> Iterator[str]:
    """Every document of ``path``, in order."""
    for file in data_files(path):
        yield from _READERS[_kind(file)](file)


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    for kind, suffixes in (("text", TEXT_SUFFIXES), ("jsonl", JSONL_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
        if name.endswith(suffixes):
            return kind
    return None


def _open_text(path: Path):
    return (
        gzip.open(path, "rt", encoding="utf-8", errors="replace")
        if path.name.endswith(".gz")
        else open(path, encoding="utf-8", errors="replace")
    )


def _read_text(path: Path) -> Iterator[str]:
    with _open_text(path) as f:
        text = f.read()
    if text:
        yield text


def _read_jsonl(path: Path) -> Iterator[str]:
    with _open_text(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[TEXT_FIELD]
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f"{path}:{number}: not a JSON object with a {TEXT_FIELD!r} string (setting SWARM_CORPUS)"
                ) from None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{number}: {TEXT_FIELD!r} is not a string (setting SWARM_CORPUS)")
            if text:
                yield text


def _read_parquet(path: Path) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends for a file that is not Parquet
        raise ValueError(f"{path} is not a Parquet file: {exc} (setting SWARM_CORPUS)") from None
    if TEXT_FIELD not in f.schema_arrow.names:
        raise ValueError(
            f"{path} has no {TEXT_FIELD!r} column (columns: {f.schema_arrow.names}) (setting SWARM_CORPUS)"
        )
    for batch in f.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[TEXT_FIELD]):
        for text in batch.column(0).to_pylist():
            if text:
                yield text


_READERS = {"text": _read_text, "jsonl": _read_jsonl, "parquet": _read_parquet}
