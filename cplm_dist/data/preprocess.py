"""Preprocessing files at cluster scale: work units in parallel, resumable after any crash, one
partition of many.

    summary, stats = preprocess(inputs, tokenizer, "data/web", workers=16, partition=(3, 16), dedup=True)

The inputs become work units (input_files.work_units: a file each, byte ranges of a large
JSON-lines file). Each unit is read, parsed, checked, encoded and written by one worker process
into a piece of its own, `<prefix>.work/<key>.bin/.idx` (+ `.dochash`, `.rejects.jsonl`), published
by renaming when complete and marked done by `<key>.json` written last. A unit's key hashes what
decides its bytes: the input's path, size and modification time, the byte range, the tokenizer, the
text key and the end-of-document setting. When every unit is done the pieces are joined in input
order (merge.join: the same code tools/merge_data.py runs), so the result does not depend on the
number of workers, on the order units finished in, or on how many times the run was restarted:
rerunning the same command after a crash or SIGKILL reuses every completed piece and ends with the
same bytes as an uninterrupted run. Nothing completed is ever deleted: a bad record under
`on_bad="stop"` ends the run with its file and line and leaves every finished piece for the rerun;
the work directory is removed only after the dataset is published. A finished dataset whose
.meta.json records the same job is not redone (a requeued Slurm array task returns at once).

`partition=(i, n)` writes part i of n of the inputs' work units (input_files.partition; JSON-lines
files cut finer where the files are fewer than the parts) to
`<prefix>-0000i-of-0000n`, so N array tasks (or N processes) write N datasets side by side; merge
them with tools/merge_data.py or name them as a glob in data.blend.
"""

from __future__ import annotations

import glob
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from cplm_dist.data.hf_datasets import DatasetInput
from cplm_dist.data.indexed_data import (
    WriteSummary, all_files, check_indexed_dataset, dataset_files, dataset_meta, progress_bar, publish, refuse_existing,
    write_piece,
)
from cplm_dist.data.input_files import Input, Unit, partition as cut, partition_units, work_units
from cplm_dist.data.merge import join
from cplm_dist.data.sources import ON_BAD, ReadStats, read_unit
from cplm_dist.data.tokenizer import Tokenizer, load_tokenizer
from cplm_dist.errors import DataError
from cplm_dist.files import write_text_atomic

FAULT_KILL_AFTER_UNITS = "CPLM_FAULT_KILL_AFTER_UNITS"  # fault injection (tests): SIGKILL this process after N units


@dataclass(frozen=True)
class Options:
    text_key: str = "text"
    on_bad: str = "stop"
    append_eod: bool = True
    dedup: bool = False  # exact-duplicate documents removed (the first occurrence stays)
    split_bytes: int | None = 1 << 30  # a JSON-lines file larger than this is cut into ranges of about this size
    chunk_docs: int = 64


def partition_prefix(prefix: str | Path, partition: tuple[int, int] | None) -> str:
    return str(prefix) if partition is None else f"{prefix}-{partition[0]:05d}-of-{partition[1]:05d}"


def unit_key(unit: Unit, tokenizer: Tokenizer, opts: Options) -> str:
    item = unit.input
    identity = [str(item)] if isinstance(item, DatasetInput) else \
        [str(item.resolve()), item.stat().st_size, item.stat().st_mtime_ns]
    parts = identity + [unit.start, unit.end, unit.first_line, tokenizer.fingerprint, opts.text_key,
                        opts.append_eod, opts.dedup]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


# --- one unit (in a worker process or here) ---------------------------------------------------

_TOKENIZER: Tokenizer | None = None


def _init_worker(spec: tuple[str, str]) -> None:
    global _TOKENIZER
    _TOKENIZER = load_tokenizer(*spec)
    _TOKENIZER.threads = 1  # a process a core


def _run_unit(task: tuple[Unit, str, str, Options]) -> tuple[str, dict]:
    unit, key, work, opts = task
    return key, process_unit(unit, key, Path(work), _TOKENIZER, opts)


def process_unit(unit: Unit, key: str, work: Path, tokenizer: Tokenizer, opts: Options, workers: int = 1) -> dict:
    """Write the unit's piece `work/key.*` (temporary names, renamed when complete, `key.json` last)
    and return its record: counts, skipped records by reason, the unit's name."""
    stats = ReadStats(rejected=[] if opts.on_bad == "skip" else None)
    final, tmp = all_files(work / key), all_files(work / f"{key}.tmp-{os.getpid()}")
    try:
        counts = write_piece(read_unit(unit, opts.text_key, opts.on_bad, stats), tokenizer, tmp, workers=workers,
                             append_eod=opts.append_eod, chunk_docs=opts.chunk_docs, on_bad=opts.on_bad,
                             stats=stats, hashes=opts.dedup)
        for kind in ("bin", "dochash", "rejects", "idx"):
            if tmp[kind].exists():
                os.replace(tmp[kind], final[kind])
    finally:
        for f in tmp.values():
            f.unlink(missing_ok=True)
    record = {"unit": unit.name, **asdict(counts), "read_documents": stats.documents, "read_bytes": stats.bytes,
              "skipped": dict(stats.skipped)}
    write_text_atomic(work / f"{key}.json", json.dumps(record) + "\n")
    return record


# --- the run ----------------------------------------------------------------------------------


def _done(work: Path, key: str, opts: Options) -> dict | None:
    """The record of a completed piece that this run may reuse (a piece that skipped records is
    not reused by a run that stops on them: it is redone, and stops)."""
    marker = work / f"{key}.json"
    if not marker.is_file() or not dataset_files(work / key)["idx"].is_file():
        return None
    try:
        record = json.loads(marker.read_text())
    except ValueError:
        return None
    return None if opts.on_bad == "stop" and record.get("skipped") else record


def _job_of(prefix: str) -> str | None:
    """The job recorded in the .meta.json at `prefix` (None: none there, or not ours)."""
    try:
        return json.loads(dataset_files(prefix)["meta"].read_text()).get("job")
    except (OSError, ValueError, AttributeError):
        return None


def _finished(prefix: str, job: str) -> WriteSummary | None:
    """The summary of the dataset at `prefix` when a run of this very job wrote it."""
    meta_path = dataset_files(prefix)["meta"]
    if not (meta_path.is_file() and dataset_files(prefix)["idx"].is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError:
        return None
    if meta.get("job") != job:
        return None
    check_indexed_dataset(prefix)
    return WriteSummary(prefix, meta["documents"], meta["tokens"], meta["text_bytes"], meta["bin_bytes"], meta["seconds"],
                        meta["max_token_id"], meta.get("duplicates_removed", 0))


def _run_pending(pending: list[tuple[Unit, str]], work: Path, tokenizer: Tokenizer, opts: Options, workers: int,
                 records: dict, bar) -> None:
    """Process the units not yet done, `workers` at a time (a unit each), recording each as it completes."""
    kill_after = int(os.environ.get(FAULT_KILL_AFTER_UNITS, "0") or 0)

    tokens = sum(r["tokens"] for r in records.values())

    def completed(key: str, record: dict) -> None:
        nonlocal tokens
        records[key] = record
        tokens += record["tokens"]
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"{tokens:,} tokens", refresh=False)
        if kill_after and len(records) >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    local = [(u, k) for u, k in pending if isinstance(u.input, DatasetInput)]  # opened here (not picklable cheaply)
    spread = [(u, k) for u, k in pending if not isinstance(u.input, DatasetInput)]
    if workers <= 1 or len(spread) <= 1:
        local, spread = pending, []
    if spread:
        with mp.get_context("spawn").Pool(min(workers, len(spread)), initializer=_init_worker,
                                          initargs=(tokenizer.spec(),)) as pool:
            for key, record in pool.imap_unordered(_run_unit, [(u, k, str(work), opts) for u, k in spread]):
                completed(key, record)
    for unit, key in local:  # one unit at a time, `workers` processes encoding its chunks
        completed(key, process_unit(unit, key, work, tokenizer, opts, workers=workers))


def _join_rejects(pieces: list[Path], out: Path) -> int:
    n = 0
    with open(out, "wb") as dst:
        for p in pieces:
            f = all_files(p)["rejects"]
            if f.is_file():
                data = f.read_bytes()
                n += data.count(b"\n")
                dst.write(data)
    if n == 0:
        out.unlink()
    return n


def preprocess(items: list[Input], tokenizer: Tokenizer, prefix: str | Path, *, opts: Options = Options(),
               workers: int = 1, partition: tuple[int, int] | None = None, overwrite: bool = False,
               progress: bool = True, report=print) -> tuple[WriteSummary, Counter]:
    """Preprocess `items` (or partition i of n of them) into the dataset at `prefix` (see the module's
    docstring); returns its summary and the skipped records by reason."""
    if opts.on_bad not in ON_BAD:
        raise DataError(f"on_bad={opts.on_bad!r} is not one of {list(ON_BAD)}")
    start = time.perf_counter()
    if partition:
        units = cut(partition_units(items, partition[1], opts.split_bytes), *partition)
        items = list(dict.fromkeys(u.input for u in units))
    else:
        units = work_units(items, opts.split_bytes)
    prefix = partition_prefix(prefix, partition)
    keys = [unit_key(u, tokenizer, opts) for u in units]
    job = hashlib.sha256(json.dumps([keys, opts.dedup]).encode()).hexdigest()[:24]
    if not overwrite and (summary := _finished(prefix, job)) is not None:
        report(f"{prefix}: already complete for these inputs ({summary.documents:,} documents); nothing to do")
        return summary, Counter(json.loads(dataset_files(prefix)["meta"].read_text()).get("skipped") or {})
    refuse_existing(prefix, overwrite or _job_of(prefix) == job)  # a run of this job killed while publishing
    work = Path(f"{prefix}.work")
    work.mkdir(parents=True, exist_ok=True)
    # a killed run's unfinished pieces, and its unpublished dataset (temporary names beside the prefix)
    for stale in [*work.glob("*.tmp-*"), *Path(prefix).parent.glob(f"{glob.escape(Path(prefix).name)}.tmp-*")]:
        stale.unlink(missing_ok=True)
    records = {k: r for k in keys if (r := _done(work, k, opts)) is not None}
    pending = [(u, k) for u, k in zip(units, keys) if k not in records]
    if records:
        report(f"{prefix}: continuing: {len(records)} of {len(units)} units already done in {work}")
    bar = progress_bar(progress)
    if bar is not None:
        bar.reset(total=len(units))
        bar.update(len(records))
        bar.unit = " units"
    try:
        _run_pending(pending, work, tokenizer, opts, workers, records, bar)
    except DataError as e:
        if not any(work.glob("*.json")):  # nothing finished: nothing left behind
            shutil.rmtree(work, ignore_errors=True)
            raise
        kept = len(list(work.glob("*.json")))
        raise DataError(f"{e} ({kept} of {len(units)} units completed are kept in {work}; the same command continues "
                        "from them)") from None
    finally:
        if bar is not None:
            bar.close()
    return _assemble(prefix, [work / k for k in keys], [records[k] for k in keys], tokenizer, opts, items, work,
                     start, job, partition)


def _assemble(prefix: str, pieces: list[Path], records: list[dict], tokenizer: Tokenizer, opts: Options,
              items: list[Input], work: Path, start: float, job: str,
              partition: tuple[int, int] | None) -> tuple[WriteSummary, Counter]:
    skipped: Counter = Counter()
    for r in records:
        skipped.update(r["skipped"])
    if sum(r["documents"] for r in records) == 0:
        detail = f" (skipped: {', '.join(f'{n} {why}' for why, n in sorted(skipped.items()))})" if skipped else ""
        shutil.rmtree(work, ignore_errors=True)  # pieces of nothing
        raise DataError(f"no documents to write to {prefix}: the inputs are empty{detail}")
    tmp = all_files(f"{prefix}.tmp-{os.getpid()}")
    try:
        counts = join(pieces, tmp, dedup=opts.dedup)
        rejects = _join_rejects(pieces, tmp["rejects"])
        text_bytes = counts["text_bytes"] if counts["text_bytes"] is not None else sum(r["text_bytes"] for r in records)
        summary = WriteSummary(prefix, counts["documents"], counts["tokens"], text_bytes, tmp["bin"].stat().st_size,
                               time.perf_counter() - start, max(r["max_token_id"] for r in records),
                               counts["duplicates_removed"])
        meta = dataset_meta(summary, tokenizer, opts.append_eod, items, job=job, units=len(pieces),
                            partition=None if partition is None else f"{partition[0]}/{partition[1]}",
                            dedup="exact" if opts.dedup else None, skipped=dict(skipped), rejects=rejects)
        tmp["meta"].write_text(json.dumps(meta, indent=2) + "\n")
        check_indexed_dataset(str(tmp["bin"])[: -len(".bin")])
        publish(tmp, all_files(prefix))
    finally:
        for f in tmp.values():
            f.unlink(missing_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    return summary, skipped
