"""Megatron indexed datasets (.bin tokens + .idx index): written atomically, checked when opened.

Writing goes through megatron-core's `IndexedDatasetBuilder` (one sequence per document, EOD
appended), with documents encoded by a pool of worker processes in bounded windows, so neither
the corpus nor its tokens are ever held in memory whole. The workers also decode each document's
ids: only a document that comes back exactly is written (`Tokenizer.encode_exact`); any other is
a bad record named by its file and line, stopped on or skipped by sources.py's policy. The three
files -- `<prefix>.meta.json` (ours: tokenizer, counts, largest id), `<prefix>.bin`, `<prefix>.idx`
-- are written under a temporary name and renamed when complete, the .idx last: an interrupted run
leaves either the previous dataset or no `.idx`, never a half-written pair that looks valid.

`check_indexed_dataset` validates a prefix before training reads it (megatron's reader would
only fail, or silently read garbage, when a bad sample is reached mid-run): header, sizes of both
files, monotone offsets and document bounds, and token ids against the model's vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import struct
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from cplm_dist.data.sources import ON_BAD, ReadStats, bad_record
from cplm_dist.data.tokenizer import Tokenizer, load_tokenizer
from cplm_dist.errors import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"  # megatron's .idx magic
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
HEADER_BYTES = 9 + 8 + 1 + 8 + 8


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 65536 else np.int32


@dataclass
class WriteSummary:
    prefix: str
    documents: int
    tokens: int
    text_bytes: int
    bin_bytes: int
    seconds: float
    max_token_id: int
    duplicates_removed: int = 0  # --dedup exact

    @property
    def docs_per_s(self) -> float:
        return self.documents / max(self.seconds, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def line(self) -> str:
        return (f"{self.prefix}: {self.documents:,} documents, {self.tokens:,} tokens, "
                f"{self.text_bytes / 1e6:.1f} MB text -> {self.bin_bytes / 1e6:.1f} MB .bin, {self.seconds:.1f}s "
                f"({self.docs_per_s:,.0f} docs/s, {self.tokens_per_s:,.0f} tokens/s)"
                + (f", {self.duplicates_removed:,} duplicate documents removed" if self.duplicates_removed else ""))


# --- worker side ------------------------------------------------------------------------------

_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(spec: tuple[str, str]) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = load_tokenizer(*spec)
    _WORKER_TOKENIZER.threads = 1  # a process a core


def _encode_chunk(texts: list[str]) -> list[list[int] | str]:
    return _WORKER_TOKENIZER.encode_exact(texts)


def _chunks(documents: Iterable[str], size: int) -> Iterator[tuple[list[str], list[str]]]:
    """(texts, wheres) of `size` documents at a time; a document's where is its `Document.where`
    (file and line) or, for a plain str, its number in `documents`."""
    texts: list[str] = []
    wheres: list[str] = []
    for n, doc in enumerate(documents, start=1):
        texts.append(doc if type(doc) is str else str(doc))
        wheres.append(getattr(doc, "where", None) or f"document {n}")
        if len(texts) == size:
            yield texts, wheres
            texts, wheres = [], []
    if texts:
        yield texts, wheres


def _encoded(documents: Iterable[str], tokenizer: Tokenizer, workers: int,
             chunk_docs: int) -> Iterator[tuple[list[str], list[str], list[list[int] | str]]]:
    """(texts, wheres, ids or why not) per chunk, in input order; with workers > 1 at most
    4 * workers chunks in flight, the reader never waiting for a whole window."""
    chunks = _chunks(documents, chunk_docs)
    if workers <= 1:
        for texts, wheres in chunks:
            yield texts, wheres, tokenizer.encode_exact(texts)
        return
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tokenizer.spec(),)) as pool:
        pending: deque = deque()  # a sliding window: a new chunk goes out as soon as the oldest is back
        for texts, wheres in chunks:
            pending.append((texts, wheres, pool.apply_async(_encode_chunk, (texts,))))
            if len(pending) >= 4 * workers:
                texts, wheres, result = pending.popleft()
                yield texts, wheres, result.get()
        while pending:
            texts, wheres, result = pending.popleft()
            yield texts, wheres, result.get()


# --- writing ----------------------------------------------------------------------------------


def dataset_files(prefix: str | Path) -> dict[str, Path]:
    """The three files of every dataset."""
    prefix = str(prefix)
    return {"meta": Path(prefix + ".meta.json"), "bin": Path(prefix + ".bin"), "idx": Path(prefix + ".idx")}


def all_files(prefix: str | Path) -> dict[str, Path]:
    """dataset_files and the optional ones preprocessing writes beside them: `dochash` (a record per
    document, for --dedup exact and its merges) and `rejects` (the bad records skipped)."""
    return {**dataset_files(prefix), "dochash": Path(f"{prefix}.dochash"), "rejects": Path(f"{prefix}.rejects.jsonl")}


HASH_RECORD = np.dtype([("hash", "V16"), ("text_bytes", "<u8")])  # a document's record in a .dochash file


def hash_record(text: str) -> bytes:
    """A document's .dochash record: its exact-duplicate key (16 bytes of BLAKE2b over its UTF-8
    text) and its text's length in bytes (so a merge that drops duplicates can count what is left)."""
    data = text.encode("utf-8")
    return hashlib.blake2b(data, digest_size=16).digest() + len(data).to_bytes(8, "little")


@dataclass
class PieceCounts:
    """What write_piece wrote."""

    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    max_token_id: int = -1
    rejects: int = 0


def write_piece(documents: Iterable[str], tokenizer: Tokenizer, files: dict[str, Path], *, workers: int = 1,
                append_eod: bool = True, chunk_docs: int = 64, on_bad: str = "stop", stats: ReadStats | None = None,
                hashes: bool = False, bar=None) -> PieceCounts:
    """Tokenize `documents` into files["bin"] / files["idx"] (and files["dochash"] with `hashes`, and
    each skipped bad record as a JSON line in files["rejects"] when `stats.rejected` is a list): no
    checks, no renames -- the callers write under temporary names and publish. Each document written
    decodes to exactly its text; any other stops naming its file and line (`on_bad="stop"`) or is
    skipped and counted; empty ones are dropped. An input with no documents gives an empty piece."""
    from cplm_dist.megatron_compat import IndexedDatasetBuilder

    stats = stats if stats is not None else ReadStats()
    counts = PieceCounts()
    builder = IndexedDatasetBuilder(str(files["bin"]), dtype=token_dtype(tokenizer.vocab_size))
    hash_file = open(files["dochash"], "wb") if hashes else None
    reject_file = open(files["rejects"], "w", encoding="utf-8") if stats.rejected is not None else None
    start = time.perf_counter()
    try:
        for texts, wheres, encoded in _encoded(documents, tokenizer, workers, chunk_docs):
            for text, where, ids in zip(texts, wheres, encoded):
                if not text:
                    stats.skipped["empty documents"] += 1
                    continue
                if isinstance(ids, str):
                    bad_record(on_bad, stats, "texts the tokenizer does not reproduce", f"{where}: {ids}")
                    continue
                arr = np.asarray(ids + [tokenizer.eod] if append_eod else ids, dtype=np.int64)
                counts.max_token_id = max(counts.max_token_id, int(arr.max()))
                builder.add_document(arr, [len(arr)])
                counts.tokens += len(arr)
                counts.documents += 1
                counts.text_bytes += len(text.encode("utf-8"))
                if hash_file is not None:
                    hash_file.write(hash_record(text))
            if reject_file is not None and stats.rejected:
                reject_file.writelines(json.dumps({"reason": r, "record": m}, ensure_ascii=False) + "\n"
                                       for r, m in stats.rejected)
                counts.rejects += len(stats.rejected)
                stats.rejected.clear()
            if bar is not None:
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.update(len(encoded))
                bar.set_postfix_str(f"{counts.documents / elapsed:,.0f} docs/s, {counts.tokens / elapsed:,.0f} tokens/s",
                                    refresh=False)
        builder.finalize(str(files["idx"]))
    finally:
        for f in (builder.data_file, hash_file, reject_file):
            if f is not None and not f.closed:
                f.close()
    return counts


def dataset_meta(summary: WriteSummary, tokenizer: Tokenizer, append_eod: bool, sources: Iterable[str],
                 **extra) -> dict:
    """The .meta.json of a dataset written here."""
    return {**asdict(summary), "tokenizer": str(tokenizer.path), "tokenizer_backend": tokenizer.backend,
            "tokenizer_sha256": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
            "append_eod": append_eod, "dtype": np.dtype(token_dtype(tokenizer.vocab_size)).name,
            "sources": [str(s) for s in sources], **extra}


def publish(tmp: dict[str, Path], final: dict[str, Path]) -> None:
    """Rename a checked dataset written under `tmp` names to `final`: the old index goes first and
    the new one comes last, so that no moment pairs an old .idx with a new .bin."""
    final["idx"].unlink(missing_ok=True)
    for kind in ("dochash", "rejects"):
        if tmp[kind].exists():
            os.replace(tmp[kind], final[kind])
        else:
            final[kind].unlink(missing_ok=True)
    os.replace(tmp["meta"], final["meta"])
    os.replace(tmp["bin"], final["bin"])
    os.replace(tmp["idx"], final["idx"])


def refuse_existing(prefix: str | Path, overwrite: bool) -> None:
    if any(f.exists() for f in dataset_files(prefix).values()) and not overwrite:
        raise DataError(f"dataset {prefix} already exists: choose another --output-prefix or pass --overwrite")


def write_indexed_dataset(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    prefix: str | Path,
    *,
    workers: int = 1,
    append_eod: bool = True,
    overwrite: bool = False,
    chunk_docs: int = 64,
    progress: bool = True,
    sources: Iterable[str] = (),
    on_bad: str = "stop",
    stats: ReadStats | None = None,
) -> WriteSummary:
    """Tokenize `documents` into `<prefix>.bin/.idx` (+ `.meta.json`), atomically, in this process
    (`workers` encode). Each document written decodes to exactly its text; any other
    (`Tokenizer.encode_exact`) stops the run naming its file and line (`on_bad="stop"`) or is skipped
    and counted in `stats`; empty ones are dropped. Files on disk are preprocessed resumably, in
    parallel over files, by cplm_dist.data.preprocess."""
    if on_bad not in ON_BAD:
        raise DataError(f"on_bad={on_bad!r} is not one of {list(ON_BAD)}")
    stats = stats if stats is not None else ReadStats()
    refuse_existing(prefix, overwrite)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    final, tmp = all_files(prefix), all_files(f"{prefix}.tmp-{os.getpid()}")
    bar = progress_bar(progress)
    start = time.perf_counter()
    try:
        counts = write_piece(documents, tokenizer, tmp, workers=workers, append_eod=append_eod, chunk_docs=chunk_docs,
                             on_bad=on_bad, stats=stats, bar=bar)
        if counts.documents == 0:
            skipped = f" (skipped: {stats.describe_skipped()})" if stats.skipped else ""
            raise DataError(f"no documents to write to {prefix}: the inputs are empty{skipped}")
        summary = WriteSummary(str(prefix), counts.documents, counts.tokens, counts.text_bytes, tmp["bin"].stat().st_size,
                               time.perf_counter() - start, counts.max_token_id)
        tmp["meta"].write_text(json.dumps(dataset_meta(summary, tokenizer, append_eod, sources), indent=2) + "\n")
        check_indexed_dataset(str(tmp["bin"])[: -len(".bin")])
        publish(tmp, final)
        return summary
    finally:
        if bar is not None:
            bar.close()
        for f in tmp.values():
            f.unlink(missing_ok=True)


def progress_bar(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(unit=" docs", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


# --- the index, as arrays ---------------------------------------------------------------------


@dataclass
class IndexArrays:
    dtype: type
    lengths: np.ndarray  # int32, tokens per sequence
    doc_idx: np.ndarray  # int64, the sequence each document starts at, and the count at the end


def read_index(idx_path: str | Path) -> IndexArrays:
    """The arrays of a Megatron v1 .idx (memory-mapped; checked by check_indexed_dataset, not here)."""
    with open(idx_path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:9] != INDEX_HEADER:
        raise DataError(f"{idx_path} is not a Megatron index (bad header); rebuild it with tools/preprocess_data.py")
    _, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    return IndexArrays(DTYPES[code], np.frombuffer(raw, np.int32, n_seq, HEADER_BYTES),
                       np.frombuffer(raw, np.int64, n_doc, HEADER_BYTES + 12 * n_seq))


def write_index(idx_path: str | Path, dtype: type, lengths: np.ndarray, doc_idx: np.ndarray) -> None:
    """A Megatron v1 .idx, the bytes megatron's _IndexWriter writes for the same arrays, at numpy speed."""
    lengths = np.ascontiguousarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    code = next(c for c, t in DTYPES.items() if t == dtype)
    with open(idx_path, "wb") as f:
        f.write(INDEX_HEADER + struct.pack("<QBQQ", 1, code, len(lengths), len(doc_idx)))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(np.ascontiguousarray(doc_idx, dtype=np.int64).tobytes())


# --- checking ---------------------------------------------------------------------------------


FINGERPRINT_BLOCKS = 32  # blocks of the .bin a content fingerprint reads, evenly spread, first and last included
FINGERPRINT_BLOCK_BYTES = 64 << 10
FINGERPRINT_INDEX_BYTES = 1 << 20  # each of the first, middle and last MiB of the .idx


def fingerprint_reads(size: int, blocks: int, block: int) -> list[tuple[int, int]]:
    """(offset, length) of what a content fingerprint reads of a file of `size` bytes: `blocks`
    blocks of `block` bytes at deterministic, evenly spread offsets, the first at 0 and the last
    ending at the end; the whole file when it is not larger than those blocks together. Never
    more than blocks x block bytes, whatever the size."""
    if size <= blocks * block:
        return [(0, size)]
    last = size - block
    return [(i * last // (blocks - 1), block) for i in range(blocks)]


def content_fingerprint(prefix: str | Path) -> str:
    """A cheap identity of the dataset's contents, not its path or times (sha256, hex): the sizes
    of .bin/.idx; FINGERPRINT_BLOCKS blocks of FINGERPRINT_BLOCK_BYTES of the .bin, evenly spread
    from its first byte to its last (the whole .bin when it is not larger: 2 MiB); the first,
    middle and last MiB of the index; and the .meta.json (which a rebuild always changes). Reads
    are bounded, at most 5 MiB and the .meta.json whatever the dataset's size, so a change
    between the sampled blocks of a large .bin is not seen: it tells a rebuilt, replaced,
    truncated or edited-in-place dataset from the one recorded (a checkpoint's manifest records
    it for every dataset of the blend), it is not a hash of every byte. gpt_data.py names
    megatron's index cache by it too."""
    files = dataset_files(prefix)
    h = hashlib.sha256()
    sizes = {kind: files[kind].stat().st_size for kind in ("bin", "idx")}
    for kind in ("bin", "idx"):
        h.update(str(sizes[kind]).encode())
    windows = {"bin": fingerprint_reads(sizes["bin"], FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK_BYTES),
               "idx": fingerprint_reads(sizes["idx"], 3, FINGERPRINT_INDEX_BYTES)}
    for kind in ("bin", "idx"):
        with open(files[kind], "rb") as f:
            for offset, length in windows[kind]:
                f.seek(offset)
                h.update(f.read(length))
    if files["meta"].is_file():
        h.update(files["meta"].read_bytes())
    return h.hexdigest()


@dataclass
class IndexSummary:
    prefix: str
    sequences: int
    documents: int
    tokens: int
    dtype: str
    max_token_id: int | None  # from .meta.json when present
    append_eod: bool | None = None  # each document ends with the end-of-document id (.meta.json; None: unknown)


def check_indexed_dataset(prefix: str | Path, vocab_size: int | None = None,
                          tokenizer_sha256: str | None = None) -> IndexSummary:
    """Validate `<prefix>.bin/.idx` (and `.meta.json` if present: it must describe these files and,
    given `tokenizer_sha256`, name that tokenizer); DataError names what is wrong."""
    files = dataset_files(prefix)
    redo = "rebuild it with tools/preprocess_data.py"
    for kind in ("idx", "bin"):
        if not files[kind].is_file():
            raise DataError(f"dataset {prefix}: {files[kind]} is missing ({redo}, or fix data.blend)")
    idx_size, bin_size = files["idx"].stat().st_size, files["bin"].stat().st_size
    with open(files["idx"], "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:9] != INDEX_HEADER:
        raise DataError(f"dataset {prefix}: {files['idx']} is not a Megatron index (bad header); {redo}")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in DTYPES:
        raise DataError(f"dataset {prefix}: {files['idx']} has version {version} / dtype code {code}, not a Megatron v1 index; {redo}")
    expected = HEADER_BYTES + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if idx_size != expected:
        raise DataError(f"dataset {prefix}: {files['idx']} is {idx_size} bytes, expected {expected} (truncated or corrupt); {redo}")
    raw = np.memmap(files["idx"], dtype=np.uint8, mode="r")
    lengths = np.frombuffer(raw, np.int32, n_seq, HEADER_BYTES)
    pointers = np.frombuffer(raw, np.int64, n_seq, HEADER_BYTES + 4 * n_seq)
    doc_idx = np.frombuffer(raw, np.int64, n_doc, HEADER_BYTES + 12 * n_seq)
    itemsize = np.dtype(DTYPES[code]).itemsize
    tokens = int(lengths.sum(dtype=np.int64))
    if (n_doc < 1 or doc_idx[0] != 0 or doc_idx[-1] != n_seq or np.any(np.diff(doc_idx) < 0)
            or np.any(lengths < 0)
            or (n_seq and (pointers[0] != 0 or np.any(pointers[1:] != pointers[:-1] + lengths[:-1].astype(np.int64) * itemsize)))):
        raise DataError(f"dataset {prefix}: {files['idx']} is internally inconsistent (corrupt); {redo}")
    if bin_size != tokens * itemsize:
        raise DataError(f"dataset {prefix}: {files['bin']} is {bin_size} bytes but the index describes "
                        f"{tokens * itemsize} (truncated, or .bin and .idx from different runs); {redo}")
    if tokens == 0:
        raise DataError(f"dataset {prefix} holds no tokens; {redo} from non-empty inputs")
    max_id = append_eod = None
    if files["meta"].is_file():
        try:
            meta = json.loads(files["meta"].read_text())
            max_id = int(meta["max_token_id"])
            described = (int(meta["documents"]), int(meta["tokens"]), int(meta["bin_bytes"]), str(meta["dtype"]))
        except (ValueError, KeyError, TypeError):
            raise DataError(f"dataset {prefix}: {files['meta']} is unreadable; {redo}") from None
        found = (n_doc - 1, tokens, bin_size, np.dtype(DTYPES[code]).name)
        if described != found:
            raise DataError(f"dataset {prefix}: {files['meta']} describes another dataset (documents, tokens, bytes, "
                            f"dtype {described} but the files hold {found}: copied or mixed files); {redo}")
        append_eod = meta.get("append_eod")
        made_with = meta.get("tokenizer_sha256")
        if tokenizer_sha256 and made_with and made_with != tokenizer_sha256:
            raise DataError(f"dataset {prefix} was made with another tokenizer ({meta.get('tokenizer')}, sha256 "
                            f"{made_with[:12]}...) than data.tokenizer (sha256 {tokenizer_sha256[:12]}...): point "
                            "data.tokenizer at the one it was made with, or re-run tools/preprocess_data.py")
    if vocab_size is not None:
        if max_id is None:  # a dataset made elsewhere: read the ids once
            data = np.memmap(files["bin"], dtype=DTYPES[code], mode="r")
            max_id = int(data.max())
        if max_id >= vocab_size:
            raise DataError(f"dataset {prefix} holds token id {max_id} but model.vocab_size={vocab_size}: "
                            "it was made with another tokenizer; re-run tools/preprocess_data.py with data.tokenizer")
    return IndexSummary(str(prefix), n_seq, n_doc - 1, tokens, np.dtype(DTYPES[code]).name, max_id,
                        None if append_eod is None else bool(append_eod))


def split_token_counts(prefix: str | Path, bookends: list[tuple[float, float] | None]) -> list[tuple[int, int]]:
    """(sequences, tokens) each split of a checked dataset gets, for megatron's split bookends
    (fractions of the sequences, rounded as megatron rounds them); (0, 0) for an absent split."""
    idx = dataset_files(prefix)["idx"]
    with open(idx, "rb") as f:
        _, _, n_seq, _ = struct.unpack("<QBQQ", f.read(HEADER_BYTES)[9:])
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=HEADER_BYTES, shape=(n_seq,))
    out = []
    for ends in bookends:
        if ends is None:
            out.append((0, 0))
            continue
        beg, end = int(round(ends[0] * float(n_seq))), int(round(ends[1] * float(n_seq)))
        out.append((end - beg, int(lengths[beg:end].sum(dtype=np.int64))))
    return out
