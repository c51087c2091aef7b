"""Raw documents from local files, streamed one at a time, with bad records handled by policy.

| input | read by | one document is |
|---|---|---|
| `.jsonl`, `.ndjson` | our line reader | the `text_key` field of a line |
| `.json`, `.parquet`, `.csv`, `.arrow` | `datasets` (streaming) | the `text_key` column of a row |
| anything else (`.txt`, `.md`, `.py`, ...) | our file reader | the whole file |

JSON lines are read by us rather than by `datasets` because its json builder can neither skip a
bad line nor say which file and line it was. A bad record (a line that is not JSON, lacks the
text field, or is not UTF-8) either stops the run with file and line (`on_bad="stop"`) or is
skipped and counted (`on_bad="skip"`). Missing inputs always stop; empty files stop unless skipped.
Directories expand to their files, sorted, so the document order is fixed.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from cplm_dist.errors import DataError

JSONL = {".jsonl", ".ndjson"}
DATASETS_FORMATS = {".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
ON_BAD = ("stop", "skip")


@dataclass
class ReadStats:
    documents: int = 0
    bytes: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count

    def describe_skipped(self) -> str:
        return ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) or "none"


def expand_inputs(paths: Iterable[str | Path]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
            if not found:
                raise DataError(f"input directory {p} holds no files")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"input {p} does not exist: check the path")
    if not files:
        raise DataError("no input files given")
    return files


def _bad(policy: str, stats: ReadStats, reason: str, message: str) -> None:
    if policy == "stop":
        raise DataError(f"{message}; fix the input or pass --on-bad-record skip to skip and count such records")
    stats.skipped[reason] += 1


def _utf8_error(e: UnicodeDecodeError) -> str:
    return f"not valid UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})"


def _read_jsonl(path: Path, text_key: str, policy: str, stats: ReadStats) -> Iterator[str]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                _bad(policy, stats, "non-UTF-8 lines", f"{where}: {_utf8_error(e)}")
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                _bad(policy, stats, "lines not JSON", f"{where}: not valid JSON ({e.msg} at column {e.colno})")
                continue
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                _bad(policy, stats, f"lines without '{text_key}'",
                     f"{where}: no string field '{text_key}' (found {keys}); choose the field with --text-key")
                continue
            yield text


def _read_with_datasets(path: Path, fmt: str, text_key: str, policy: str, stats: ReadStats) -> Iterator[str]:
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(fmt, data_files=str(path), split="train", streaming=True)
        for i, row in enumerate(ds):
            text = row.get(text_key)
            if not isinstance(text, str):
                _bad(policy, stats, f"rows without '{text_key}'",
                     f"{path}: row {i} has no string column '{text_key}' (columns {sorted(row)}); choose one with --text-key")
                continue
            yield text
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow/datasets raise many types for a bad file
        raise DataError(f"{path}: could not be read as {fmt} ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


def _read_whole_file(path: Path, policy: str, stats: ReadStats) -> Iterator[str]:
    raw = path.read_bytes()
    try:
        yield raw.decode("utf-8")
    except UnicodeDecodeError as e:
        _bad(policy, stats, "non-UTF-8 files", f"{path}: {_utf8_error(e)}")


def iter_documents(
    paths: Iterable[str | Path], text_key: str = "text", on_bad: str = "stop", stats: ReadStats | None = None
) -> Iterator[str]:
    """Every non-empty document of the inputs, in order; `stats` counts what was read and skipped."""
    if on_bad not in ON_BAD:
        raise DataError(f"on_bad={on_bad!r} is not one of {list(ON_BAD)}")
    stats = stats if stats is not None else ReadStats()
    for path in expand_inputs(paths):
        if path.stat().st_size == 0:
            _bad(on_bad, stats, "empty files", f"{path}: the file is empty")
            continue
        suffix = path.suffix.lower()
        if suffix in JSONL:
            docs = _read_jsonl(path, text_key, on_bad, stats)
        elif suffix in DATASETS_FORMATS:
            docs = _read_with_datasets(path, DATASETS_FORMATS[suffix], text_key, on_bad, stats)
        else:
            docs = _read_whole_file(path, on_bad, stats)
        for text in docs:
            if not text:
                stats.skipped["empty documents"] += 1
                continue
            stats.documents += 1
            stats.bytes += len(text.encode("utf-8"))
            yield text
