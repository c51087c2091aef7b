"""Raw documents from local files, streamed one at a time, with bad records handled by policy.

| input | read by | one document is | a record is named by |
|---|---|---|---|
| `.jsonl`, `.ndjson` (also `.gz`, `.zst`) | our line reader | the `text_key` field of a line | `file:line` |
| `.json` | ours: a JSON array of records (read whole), else JSON lines | the `text_key` field of a record | `file:line` (where the record starts) |
| `.csv` | ours (`csv` module, every field a string) | the `text_key` column of a row | `file:line` (where the row starts) |
| `.parquet` | pyarrow, the `text_key` column alone, a row group at a time | the `text_key` column of a row | `file: row N` (from 1) |
| `.arrow` | `datasets` (streaming) | the `text_key` column of a row | `file: row N` (from 1) |
| a `save_to_disk` directory, `--hf-dataset` | `datasets`, offline (hf_datasets.py) | the `text_key` column of a row | `DIR (split S): row N` |
| `.txt`, and any file named on the command line (`.md`, `.py`, ...) | our file reader | the whole file | `file` |

Which files of a directory are read, how compressed files are opened and how inputs become work
units (byte ranges of a large JSON-lines file, read by `read_unit`) is input_files.py's.

JSON, JSON lines and CSV are read by us rather than by `datasets` because its readers can neither
skip a bad record nor say which file and line it was, and they change text: its CSV reader turns
"NA", "null" or "" into missing values and "007" into 7, its JSON reader turns a non-string
field into its JSON spelling and drops lone surrogates.

Every file is UTF-8; a UTF-8 byte-order mark at the start of a file is an encoding signature, not
text, and is dropped. A document is the text exactly as stored, nothing stripped or normalised.
A bad record -- a line that is not JSON, a record without a string `text_key` field, bytes that
are not UTF-8, a CSV row that does not parse or has more or fewer fields than the header, or a
text that is not Unicode (a JSON `\\ud800` escape without its other half, which no UTF-8 file or
tokenizer can hold) -- either stops the run naming its file and line (`on_bad="stop"`) or is
skipped and counted by reason (`on_bad="skip"`). Empty documents carry nothing and are dropped
and counted under either policy. Missing inputs always stop; empty files stop unless skipped.
Directories expand to their data files, sorted, so the document order is fixed; a directory written by
`datasets`' `save_to_disk` (`state.json` + `dataset_info.json`, or `dataset_dict.json`: one split,
`split`) is one input, read by hf_datasets.py, never as files. A dataset's rows follow the same
rules: a null or non-string value is a bad record, a dataset without the `text_key` column is a bad
record naming its columns, an empty dataset is one like an empty file.

Each document is a `Document`: a `str` that also carries `where` it came from, so that later
stages (the tokenizer's round-trip check in indexed_data) can name the record too.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from cplm_dist.data.hf_datasets import DatasetInput, MissingColumn, hub_input, iter_values, offline_datasets
from cplm_dist.data.input_files import (  # noqa: F401  (expand_inputs: the readers' callers import it from here)
    JSONL, Input, Unit, decompression_error, decompression_errors, expand_inputs, name_parts, open_binary,
)
from cplm_dist.data.tokenizer import not_unicode
from cplm_dist.errors import DataError, UsageError

DATASETS_FORMATS = {".arrow": "arrow"}
PARQUET_BATCH_ROWS = 1024
ON_BAD = ("stop", "skip")
BOM = b"\xef\xbb\xbf"
_JSON_SPACE = re.compile(r"[ \t\n\r]*")


class Document(str):
    """A document's text, exactly as read, and `where` it came from ('file:line', 'file: row N', 'file')."""

    where: str

    def __new__(cls, text: str, where: str):
        self = super().__new__(cls, text)
        self.where = where
        return self

    def __reduce__(self):
        return Document, (str(self), self.where)


@dataclass
class ReadStats:
    documents: int = 0
    bytes: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    rejected: list | None = None  # when a list: (reason, message) of each skipped bad record, for a reject file

    def describe_skipped(self) -> str:
        return ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) or "none"


def add_input_arguments(p: argparse.ArgumentParser) -> None:
    """The tools' input options: --input, --hf-dataset / --hf-config, --split, --text-key, --on-bad-record."""
    p.add_argument("--input", nargs="+", default=[], help="files or directories (a datasets save_to_disk "
                   "directory is read as a dataset)")
    p.add_argument("--hf-dataset", metavar="NAME_OR_PATH", help="what datasets.load_dataset takes: a local dataset "
                   "repository or data-file directory, or a hub name already in the local cache (never downloaded)")
    p.add_argument("--hf-config", metavar="NAME", help="the --hf-dataset configuration (load_dataset's name)")
    p.add_argument("--split", help="the split of --hf-dataset and of a saved DatasetDict, e.g. train")
    p.add_argument("--pattern", metavar="GLOB", help="read only the files of an input directory matching GLOB "
                   "(e.g. '*.py', 'shard-*.jsonl.gz'); default: its data files by name (.jsonl[.gz|.zst], .json, "
                   ".csv, .txt, .parquet, .arrow)")
    p.add_argument("--text-key", default="text", help="the field or column holding the text")
    p.add_argument("--on-bad-record", choices=ON_BAD, default="stop")


def inputs_from_args(args: argparse.Namespace, report=None) -> list[Input]:
    return resolve_inputs(args.input, args.split, args.hf_dataset, args.hf_config,
                          pattern=getattr(args, "pattern", None), report=report)


def resolve_inputs(paths: Iterable[str | Path] = (), split: str | None = None, hf_dataset: str | None = None,
                   hf_config: str | None = None, cache_dir: str | None = None, pattern: str | None = None,
                   report=None) -> list[Input]:
    """The tools' inputs: `--input` files and directories, then `--hf-dataset` (opened now, so that
    a bad name, config or split stops before anything is written)."""
    paths = list(paths or ())
    if not paths and not hf_dataset:
        raise UsageError("no input: give --input FILE_OR_DIR ... and/or --hf-dataset NAME_OR_PATH")
    if hf_config and not hf_dataset:
        raise UsageError(f"--hf-config {hf_config} needs --hf-dataset: give the dataset it belongs to")
    items = expand_inputs(paths, split, pattern, report) if paths else []
    if hf_dataset:
        items.append(hub_input(hf_dataset, hf_config, split, cache_dir))
    if split is not None and not any(isinstance(i, DatasetInput) and i.split for i in items):
        raise UsageError(f"--split {split}: no input has splits (files have none, a saved Dataset is read whole): "
                         "drop --split")
    return items


def bad_record(policy: str, stats: ReadStats, reason: str, message: str) -> None:
    """Stop with `message` (which starts with the record's file and line) or count it under `reason`."""
    if policy == "stop":
        raise DataError(f"{message}; fix the input or pass --on-bad-record skip to skip and count such records")
    stats.skipped[reason] += 1
    if stats.rejected is not None:
        stats.rejected.append((reason, message))


def _utf8_error(e: UnicodeDecodeError, line_start: int = 0) -> str:
    return f"not valid UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start - line_start})"


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "a list" if isinstance(value, list) else "an object"


def _json_text(record, text_key: str, where: str, unit: str, policy: str, stats: ReadStats) -> str | None:
    """The record's text, or None after handling a record without a string `text_key` field."""
    if isinstance(record, dict) and isinstance(record.get(text_key), str):
        return record[text_key]
    if isinstance(record, dict) and text_key in record:
        bad_record(policy, stats, f"{unit} whose '{text_key}' is not a string",
                   f"{where}: field '{text_key}' is {_kind(record[text_key])}, not a string")
    else:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        bad_record(policy, stats, f"{unit} without '{text_key}'",
                   f"{where}: no string field '{text_key}' (found {keys}); choose the field with --text-key")
    return None


def _json_error(e: Exception) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})"
    if isinstance(e, RecursionError):
        return "not valid JSON here (nested too deeply to read)"
    return f"not valid JSON here ({str(e).splitlines()[0][:120]})"  # e.g. an integer of over 4300 digits


def _jsonl_lines(f, start: int, end: int | None) -> Iterator[bytes]:
    """The lines of a binary file whose first byte lies in [start, end) (all with end None); `start`
    is a line start (work_units cuts there)."""
    if end is None:
        yield from f
        return
    f.seek(start)
    pos = start
    while pos < end:
        raw = f.readline()
        if not raw:
            return
        pos += len(raw)
        yield raw


def _read_jsonl(path: Path, text_key: str, policy: str, stats: ReadStats, start: int = 0, end: int | None = None,
                first_line: int = 1) -> Iterator[tuple[str, str]]:
    with open_binary(path) as f:
        for lineno, raw in enumerate(_jsonl_lines(f, start, end), start=first_line):
            if lineno == 1 and raw.startswith(BOM):
                raw = raw[len(BOM):]
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad_record(policy, stats, "non-UTF-8 lines", f"{where}: {_utf8_error(e)}")
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
                bad_record(policy, stats, "lines not JSON", f"{where}: {_json_error(e)}")
                continue
            text = _json_text(record, text_key, where, "lines", policy, stats)
            if text is not None:
                yield where, text


def _first_byte(path: Path) -> bytes:
    """The first byte of the file that is neither a byte-order mark nor JSON whitespace."""
    with open_binary(path) as f:
        block = f.read(1 << 16)
        block = block[len(BOM):] if block.startswith(BOM) else block
        while block:
            block = block.lstrip(b" \t\r\n")
            if block:
                return block[:1]
            block = f.read(1 << 16)
    return b""


def _read_bytes(path: Path) -> bytes:
    with open_binary(path) as f:
        return f.read()


def _read_json(path: Path, text_key: str, policy: str, stats: ReadStats) -> Iterator[tuple[str, str]]:
    """A JSON array of records, or (as `datasets` also reads `.json`) JSON lines. An array is read
    whole before any record is yielded, so a broken one is a single bad record, skipped whole."""
    if _first_byte(path) != b"[":
        yield from _read_jsonl(path, text_key, policy, stats)
        return
    raw = _read_bytes(path)
    raw = raw[len(BOM):] if raw.startswith(BOM) else raw
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line, line_start = raw.count(b"\n", 0, e.start) + 1, raw.rfind(b"\n", 0, e.start) + 1
        bad_record(policy, stats, "non-UTF-8 files", f"{path}:{line}: {_utf8_error(e, line_start)}")
        return
    decoder, records = json.JSONDecoder(), []
    pos, line, counted = _JSON_SPACE.match(text, text.index("[") + 1).end(), 1, 0
    more = text[pos:pos + 1] != "]"  # an empty array holds no records
    while more:
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            record, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError) as e:
            at = e.lineno if isinstance(e, json.JSONDecodeError) else line
            bad_record(policy, stats, "files not JSON", f"{path}:{at}: {_json_error(e)}")
            return
        records.append((line, record))
        pos = _JSON_SPACE.match(text, pos).end()
        more = text[pos:pos + 1] == ","
        if not more and text[pos:pos + 1] != "]":
            at = line + text.count("\n", counted, pos)
            bad_record(policy, stats, "files not JSON", f"{path}:{at}: not valid JSON (expected ',' or ']' after a record)")
            return
        pos = _JSON_SPACE.match(text, pos + 1).end() if more else pos
    pos = _JSON_SPACE.match(text, pos + 1).end()
    if pos < len(text):
        at = text.count("\n", 0, pos) + 1
        bad_record(policy, stats, "files not JSON", f"{path}:{at}: not valid JSON (text after the closing ']')")
        return
    for line, record in records:
        where = f"{path}:{line}"
        value = _json_text(record, text_key, where, "records", policy, stats)
        if value is not None:
            yield where, value


def _csv_error(e: csv.Error) -> str:
    if "new-line character seen in unquoted field" in str(e):
        return "not valid CSV (a carriage return outside quotes: quote the field, or end lines with \\n or \\r\\n)"
    return f"not valid CSV ({e})"


def _read_csv(path: Path, text_key: str, policy: str, stats: ReadStats) -> Iterator[tuple[str, str]]:
    """Rows by the `csv` module: every field the exact string between the separators (no missing
    values, no numbers); a row's line is the line it starts on (a quoted field may span lines)."""
    csv.field_size_limit(2**31 - 1)  # one document may be long
    bad_utf8: dict[int, UnicodeDecodeError] = {}

    def lines(f) -> Iterator[str]:
        for n, raw in enumerate(f, start=1):
            if n == 1 and raw.startswith(BOM):
                raw = raw[len(BOM):]
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:  # keep parsing; the row holding this line is bad
                bad_utf8[n] = e
                yield raw.decode("utf-8", "surrogateescape")

    with open_binary(path) as f:
        reader = csv.reader(lines(f), strict=True)
        header, column, last = None, None, 0
        while True:
            first = last + 1
            try:
                row = next(reader)
                problem = None
            except StopIteration:
                return
            except csv.Error as e:
                problem = ("rows not CSV", _csv_error(e))
            last = reader.line_num
            bad_line = next((n for n in range(first, last + 1) if n in bad_utf8), None)
            if bad_line is not None:
                problem, first = ("non-UTF-8 rows", _utf8_error(bad_utf8[bad_line])), bad_line
            if problem is None and not row:
                continue  # a blank line
            if header is None:  # the first row names the columns
                if problem is None and row.count(text_key) != 1:
                    problem = (f"files without a '{text_key}' column",
                               f"the header {row} has {'no' if text_key not in row else 'more than one'} column "
                               f"'{text_key}'; choose one with --text-key")
                if problem is not None:
                    bad_record(policy, stats, problem[0], f"{path}:{first}: {problem[1]}")
                    return
                header, column = row, row.index(text_key)
                continue
            if problem is None and len(row) != len(header):
                problem = ("rows with a wrong number of fields", f"{len(row)} fields but the header has "
                           f"{len(header)} (a separator or quote in an unquoted field?)")
            if problem is not None:
                bad_record(policy, stats, problem[0], f"{path}:{first}: {problem[1]}")
                continue
            yield f"{path}:{first}", row[column]


def _column_text(where: str, value, text_key: str, policy: str, stats: ReadStats) -> str | None:
    """A row's text, or None after handling a value that is not a string (null, a number, bytes)."""
    if isinstance(value, str):
        return value
    kind = "bytes" if isinstance(value, bytes) else _kind(value)
    bad_record(policy, stats, f"rows whose '{text_key}' is not a string",
               f"{where}: column '{text_key}' is {kind}, not a string")
    return None


def _read_dataset(inp: DatasetInput, text_key: str, policy: str, stats: ReadStats) -> Iterator[tuple[str, str]]:
    rows = 0
    try:
        for where, value in iter_values(inp, text_key):
            rows += 1
            text = _column_text(where, value, text_key, policy, stats)
            if text is not None:
                yield where, text
    except MissingColumn as e:
        bad_record(policy, stats, f"datasets without a '{text_key}' column", str(e))
        return
    if rows == 0:
        bad_record(policy, stats, "empty datasets", f"{inp}: the dataset has no rows")


def _read_with_datasets(path: Path, fmt: str, text_key: str, policy: str, stats: ReadStats) -> Iterator[tuple[str, str]]:
    datasets = offline_datasets()
    try:
        ds = datasets.load_dataset(fmt, data_files=str(path), split="train", streaming=True)
        for i, row in enumerate(ds, start=1):
            where = f"{path}: row {i}"
            if text_key in row:
                text = _column_text(where, row[text_key], text_key, policy, stats)
                if text is not None:
                    yield where, text
            else:
                bad_record(policy, stats, f"rows without '{text_key}'",
                           f"{where}: no string column '{text_key}' (columns {sorted(row)}); choose one with --text-key")
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow/datasets raise many types for a bad file
        raise DataError(f"{path}: could not be read as {fmt} ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


def _read_parquet(path: Path, text_key: str, policy: str, stats: ReadStats) -> Iterator[tuple[str, str]]:
    """The `text_key` column of a Parquet file (only that column is read), a row group at a time."""
    import pyarrow.parquet as pq

    row = 0
    try:
        pf = pq.ParquetFile(path)
        if text_key not in pf.schema_arrow.names:
            bad_record(policy, stats, f"files without a '{text_key}' column", f"{path}: no column '{text_key}' "
                       f"(columns {pf.schema_arrow.names}); choose one with --text-key")
            return
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_key]):
            for value in batch.column(0).to_pylist():
                row += 1
                text = _column_text(f"{path}: row {row}", value, text_key, policy, stats)
                if text is not None:
                    yield f"{path}: row {row}", text
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow raises many types for a bad file
        raise DataError(f"{path}: could not be read as parquet at row {row + 1} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200]}): the file is damaged or not Parquet") from None


def _read_whole_file(path: Path, policy: str, stats: ReadStats) -> Iterator[tuple[str, str]]:
    raw = _read_bytes(path)
    if raw.startswith(BOM):
        raw = raw[len(BOM):]
    try:
        yield str(path), raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad_record(policy, stats, "non-UTF-8 files", f"{path}: {_utf8_error(e)}")


def _records(path: Path, text_key: str, policy: str, stats: ReadStats) -> Iterator[tuple[str, str]]:
    suffix = name_parts(path)[0]
    if suffix in JSONL:
        return _read_jsonl(path, text_key, policy, stats)
    if suffix == ".parquet":
        return _read_parquet(path, text_key, policy, stats)
    if suffix == ".json":
        return _read_json(path, text_key, policy, stats)
    if suffix == ".csv":
        return _read_csv(path, text_key, policy, stats)
    if suffix in DATASETS_FORMATS:
        return _read_with_datasets(path, DATASETS_FORMATS[suffix], text_key, policy, stats)
    return _read_whole_file(path, policy, stats)


def _unit_records(unit: Unit, text_key: str, policy: str, stats: ReadStats) -> Iterator[tuple[str, str]]:
    item = unit.input
    if isinstance(item, DatasetInput):
        return _read_dataset(item, text_key, policy, stats)
    if unit.end is not None:
        return _read_jsonl(item, text_key, policy, stats, unit.start, unit.end, unit.first_line)
    return _records(item, text_key, policy, stats)


def read_unit(unit: Unit, text_key: str = "text", on_bad: str = "stop", stats: ReadStats | None = None) -> Iterator[Document]:
    """Every non-empty document of one work unit (input_files.work_units), in order."""
    stats = stats if stats is not None else ReadStats()
    item = unit.input
    if isinstance(item, Path) and item.stat().st_size == 0:
        bad_record(on_bad, stats, "empty files", f"{item}: the file is empty")
        return
    records = _unit_records(unit, text_key, on_bad, stats)
    while True:
        try:
            where, text = next(records)
        except StopIteration:
            return
        except decompression_errors() as e:  # gzip / zstd: a damaged or truncated stream
            if not (isinstance(item, Path) and name_parts(item)[1]):
                raise
            bad_record(on_bad, stats, "damaged compressed files", str(decompression_error(item, e)))
            return
        if not text:
            stats.skipped["empty documents"] += 1
            continue
        try:  # the one check every format's text passes: it is Unicode, so UTF-8 can hold it
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            bad_record(on_bad, stats, "texts that are not Unicode", f"{where}: {not_unicode(text, e)}")
            continue
        stats.documents += 1
        stats.bytes += size
        yield Document(text, where)


def iter_documents(
    paths: Iterable[str | Path | DatasetInput], text_key: str = "text", on_bad: str = "stop",
    stats: ReadStats | None = None, split: str | None = None,
) -> Iterator[Document]:
    """Every non-empty document of the inputs, in order; `stats` counts what was read and skipped.
    `split` is the split of a saved DatasetDict among `paths` (resolve_inputs gives them checked)."""
    if on_bad not in ON_BAD:
        raise DataError(f"on_bad={on_bad!r} is not one of {list(ON_BAD)}")
    stats = stats if stats is not None else ReadStats()
    for item in expand_inputs(paths, split):
        yield from read_unit(Unit(item), text_key, on_bad, stats)
