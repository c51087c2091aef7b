"""Which files of the inputs are data, how each is opened, and how they are cut into work units.

| file name ends in | kind (the reader sources.py picks) | opened as |
|---|---|---|
| `.jsonl`, `.ndjson`, `.json`, `.csv`, `.txt` | by the suffix | bytes as stored |
| the same + `.gz` / `.zst` (`x.jsonl.gz`, `x.jsonl.zst`, `x.txt.gz`) | by the suffix before the compression | decompressed while read (gzip; `zstandard`) |
| `.parquet` | Parquet (pyarrow, the text column alone) | as stored (Parquet compresses inside) |
| `.arrow` | Arrow (`datasets`) | as stored |

A file named on the command line is read whatever its name (a `.py` file is one document). A
directory is walked in sorted order and gives only the files of the kinds above, or with `pattern`
(a glob such as `*.py` or `shard-*.jsonl.gz`, matched against the path below the directory) the files
that match it; everything else (a README, a `_SUCCESS` marker, hidden files, `.crc` checksums) is
skipped and counted, and one line per directory says how many files it skipped and why.

`work_units` cuts the inputs into the units preprocessing works, resumes and parallelises on: one
per input file, except that an uncompressed JSON-lines file larger than `split_bytes` becomes
several byte ranges, each starting at a line start and knowing its first line's number (found in
one pass over the file's bytes). `partition(units, i, n)` is contiguous part i of n of them,
balanced by size (`partition_units` cuts JSON-lines files finer where the files are fewer than the
parts): parts written side by side and merged in order equal one run over them all.
"""

from __future__ import annotations

import fnmatch
import gzip
import io
import os
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from cplm_dist.data.hf_datasets import DatasetInput, saved_input, saved_kind
from cplm_dist.errors import DataError, UsageError

COMPRESSIONS = (".gz", ".zst")
TEXT_KINDS = (".jsonl", ".ndjson", ".json", ".csv", ".txt")  # may be compressed
WHOLE_KINDS = (".parquet", ".arrow")  # compress inside
JSONL = (".jsonl", ".ndjson")
Input = Path | DatasetInput


def name_parts(path: Path) -> tuple[str, str | None]:
    """(kind suffix, compression or None): `a.jsonl.zst` -> ('.jsonl', '.zst'), `a.txt` -> ('.txt', None)."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        return (suffixes[-2] if len(suffixes) > 1 else ""), suffixes[-1]
    return (suffixes[-1] if suffixes else ""), None


def data_kind(path: Path) -> str | None:
    """The kind a directory reads the file as, or None when it is not a data file."""
    kind, compression = name_parts(path)
    if kind in TEXT_KINDS or (kind in WHOLE_KINDS and compression is None):
        return kind
    return None


@contextmanager
def open_binary(path: Path) -> Iterator[io.BufferedIOBase]:
    """The file's bytes, decompressed when its name ends in .gz or .zst (read as a stream)."""
    compression = name_parts(path)[1]
    if compression == ".gz":
        with gzip.open(path, "rb") as f:
            yield f
    elif compression == ".zst":
        with open(path, "rb") as raw:
            yield io.BufferedReader(_ZstdFrames(raw), buffer_size=1 << 20)
    else:
        with open(path, "rb") as f:
            yield f


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a .zst file of one or more frames (zstd's CLI, pzstd), raising
    zstandard.ZstdError when the file ends inside a frame: zstandard's stream_reader ends quietly
    there, which would pass a truncated copy off as a shorter file."""

    def __init__(self, raw):
        import zstandard

        self._raw, self._zstd, self._out, self._in_frame = raw, zstandard, b"", False
        self._d = zstandard.ZstdDecompressor().decompressobj()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            chunk = self._raw.read(1 << 20)
            if not chunk:
                if self._in_frame:
                    raise self._zstd.ZstdError("the file ends inside a frame")
                return 0
            while chunk:
                self._out += self._d.decompress(chunk)
                self._in_frame = not self._d.eof
                chunk = self._d.unused_data if self._d.eof else b""
                if self._d.eof:  # the next frame, if any, starts in what is left
                    self._d = self._zstd.ZstdDecompressor().decompressobj()
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n


def decompression_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged or truncated gzip / zstd stream raises (a BadGzipFile is an OSError)."""
    import zlib

    import zstandard

    return EOFError, OSError, zlib.error, zstandard.ZstdError


def decompression_error(path: Path, e: Exception) -> DataError:
    """A damaged or truncated compressed file, in one line."""
    kind = {".gz": "gzip", ".zst": "zstd"}.get(name_parts(path)[1] or "", "compressed")
    return DataError(f"{path}: not a complete {kind} stream ({type(e).__name__}: {str(e).splitlines()[0][:160]}): "
                     "the file is damaged or was cut short; copy it again")


def _skip_reason(child: Path, relative: str, pattern: str | None) -> str | None:
    if child.name.startswith("."):
        return "hidden"
    if pattern is not None:
        return None if fnmatch.fnmatch(relative, pattern) or fnmatch.fnmatch(child.name, pattern) else \
            f"not matching --pattern {pattern}"
    return None if data_kind(child) else "not a data file (.jsonl[.gz|.zst], .json, .csv, .txt, .parquet, .arrow)"


def _walk(directory: Path, root: Path, split: str | None, pattern: str | None, skipped: Counter) -> list[Input]:
    if saved_kind(directory):
        return [saved_input(directory, split)]
    found: list[Input] = []
    for child in sorted(directory.iterdir()):
        if child.is_dir() and not child.is_symlink():
            if child.name.startswith("."):
                skipped["hidden"] += 1
            else:
                found += _walk(child, root, split, pattern, skipped)
        elif child.is_file():
            reason = _skip_reason(child, str(child.relative_to(root)), pattern)
            if reason is None:
                found.append(child)
            else:
                skipped[reason] += 1
    return found


def expand_inputs(paths: Iterable[str | Path | DatasetInput], split: str | None = None, pattern: str | None = None,
                  report: Callable[[str], None] | None = None) -> list[Input]:
    """Files, and datasets (a save_to_disk directory: a DatasetDict's `split`), in order; a
    directory gives its data files (or those matching `pattern`), and `report` gets one line per
    directory that skipped files."""
    files: list[Input] = []
    for raw in paths:
        if isinstance(raw, DatasetInput):
            files.append(raw)
            continue
        p = Path(raw)
        if p.is_dir():
            skipped: Counter = Counter()
            found = _walk(p, p, split, pattern, skipped)
            if skipped and report is not None:
                report(f"{p}: {len(found)} inputs; skipped {sum(skipped.values())} files ("
                       + ", ".join(f"{n} {why}" for why, n in sorted(skipped.items())) + ")")
            if not found:
                why = f" ({sum(skipped.values())} skipped: {', '.join(sorted(skipped))})" if skipped else ""
                raise DataError(f"input directory {p} holds no files to read{why}"
                                + ("; choose them with --pattern GLOB" if skipped else ""))
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"input {p} does not exist: check the path")
    if not files:
        raise DataError("no input files given")
    return files


# --- work units -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One piece of work: a whole input, or bytes [start, end) of a JSON-lines file, whose first
    line is line `first_line` of the file."""

    input: Input
    start: int = 0
    end: int | None = None
    first_line: int = 1

    @property
    def name(self) -> str:
        return str(self.input) if self.end is None else f"{self.input} [bytes {self.start}-{self.end})"


def splittable(item: Input) -> bool:
    return isinstance(item, Path) and name_parts(item) in ((".jsonl", None), (".ndjson", None))


def _line_ranges(path: Path, split_bytes: int) -> list[Unit]:
    """Byte ranges of about `split_bytes`, each beginning at a line start, with their first line numbers."""
    units, start, line = [], 0, 1
    size = path.stat().st_size
    with open(path, "rb") as f:
        while start < size:
            target = min(size, start + split_bytes)
            f.seek(start)
            newlines = f.read(target - start).count(b"\n")
            end = target
            if target < size:  # extend to the end of the line the target falls in
                f.seek(target - 1)
                if f.read(1) != b"\n":
                    rest = f.readline()
                    end = target + len(rest)
                    newlines += rest.endswith(b"\n")
            units.append(Unit(path, start, end, line))
            line += newlines
            start = end
    return units


def work_units(items: list[Input], split_bytes: int | None = None) -> list[Unit]:
    """The inputs as units, in order (see the module's docstring)."""
    out: list[Unit] = []
    for item in items:
        if split_bytes and splittable(item) and item.stat().st_size > split_bytes:
            out += _line_ranges(item, split_bytes)
        else:
            out.append(Unit(item))
    return out


def parse_partition(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N), 0 <= I < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise UsageError(f"--partition {text}: give I/N with 0 <= I < N (e.g. 0/16; a Slurm array uses "
                         "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)")
    return i, n


def size_of(item: Input | Unit) -> int:
    """Bytes on disk of an input, or of a unit's range (1 for a dataset input: its size is unknown)."""
    if isinstance(item, Unit):
        return (item.end - item.start) if item.end is not None else size_of(item.input)
    return os.path.getsize(item) if isinstance(item, Path) else 1


def partition_units(items: list[Input], count: int, split_bytes: int | None) -> list[Unit]:
    """The inputs as work units, enough of them for `count` parts: where the files are fewer than
    the parts, JSON-lines files are cut into ranges of about total / (2 x count) bytes."""
    units = work_units(items, split_bytes)
    if len(units) < count:
        total = sum(size_of(i) for i in items if splittable(i))
        finer = max(1, total // (2 * count))
        units = work_units(items, min(split_bytes or finer, finer))
    return units


def partition(items: list, index: int, count: int) -> list:
    """Contiguous part `index` of `count` of `items` (inputs or work units, in their order): part k
    ends at the first item where the running size reaches (k+1)/count of the total, every part
    holding at least one item; the parts in order are the inputs."""
    n = len(items)
    if count > n:
        raise UsageError(f"--partition .../{count}: the inputs make {n} work units, fewer than {count} parts "
                         f"(compressed or columnar files are not cut); use at most {n} partitions, or give more, "
                         "smaller files")
    prefix = [0]
    for item in items:
        prefix.append(prefix[-1] + max(1, size_of(item)))
    bounds = [0]
    for k in range(1, count):
        last = n - (count - k)  # leave one item for each later part
        bounds.append(next((j for j in range(bounds[-1] + 1, last + 1) if prefix[j] * count >= k * prefix[-1]), last))
    bounds.append(n)
    return items[bounds[index]:bounds[index + 1]]
