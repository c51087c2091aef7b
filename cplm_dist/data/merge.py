"""Joining indexed datasets in order into one (megatron's merge_datasets, ours), optionally dropping
exact-duplicate documents across them.

    tools/merge_data.py --inputs 'data/web-*-of-00016' --output-prefix data/web [--dedup exact]

The .bin is the parts' .bin files one after another and the .idx their lengths and document
starts, offset: byte for byte what one preprocessing run over the parts' inputs, in the same
order, writes -- preprocessing itself ends by joining its per-unit pieces with `join` below. With
`dedup`, every document whose 16-byte hash (the parts' `.dochash`, written by `--dedup exact`)
was seen earlier, in this part or an earlier one, is left out: the first occurrence in the
global order stays, so parts deduplicated alone and merged equal one deduplicated run. Parts must
agree on the tokenizer, token dtype and end-of-document ids (their .meta.json); anything else is
one line naming the two parts that differ. The output is written under a temporary name, checked,
and renamed; the parts are never changed.
"""

from __future__ import annotations

import glob
import json
import os
import time
from pathlib import Path

import numpy as np

from cplm_dist.data.indexed_data import (
    HASH_RECORD, WriteSummary, all_files, check_indexed_dataset, dataset_files, publish, read_index, refuse_existing,
    write_index,
)
from cplm_dist.errors import DataError

COPY_BLOCK = 16 << 20
AGREE = ("tokenizer_sha256", "dtype", "append_eod", "eod", "vocab_size")


def read_hashes(path: Path, documents: int) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"{path} is missing: --dedup exact needs every part preprocessed with --dedup exact")
    records = np.fromfile(path, dtype=HASH_RECORD)
    if len(records) != documents:
        raise DataError(f"{path} holds {len(records)} document hashes but its dataset {documents} documents: "
                        "re-run tools/preprocess_data.py --dedup exact for it")
    return records


def first_occurrences(hashes: list[np.ndarray]) -> list[np.ndarray]:
    """Per part, a mask of its documents whose hash no earlier document (in this part or an earlier
    one, in order) has."""
    joined = np.concatenate([h["hash"] for h in hashes]) if hashes else np.empty(0, "V16")
    keep = np.zeros(len(joined), dtype=bool)
    if len(joined):
        as_pairs = joined.view(np.dtype([("a", "<u8"), ("b", "<u8")]))
        keep[np.unique(as_pairs, return_index=True)[1]] = True
    return np.split(keep, np.cumsum([len(h) for h in hashes])[:-1])


def _copy_range(src, dst, start: int, length: int) -> None:
    src.seek(start)
    while length > 0:
        block = src.read(min(COPY_BLOCK, length))
        if not block:
            raise DataError(f"{src.name} ends before byte {start + length}: the dataset is truncated")
        dst.write(block)
        length -= len(block)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True in `mask`."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def join(prefixes: list[Path | str], out: dict[str, Path], *, dedup: bool = False) -> dict:
    """Write the datasets at `prefixes`, in order, into the files `out` (dataset_files of a
    temporary prefix), without checks or renames; with `dedup` later duplicates are left out and
    out["dochash"] gets the kept documents' hashes. Returns documents, tokens, text_bytes (None when
    a part has no .dochash), duplicates_removed."""
    arrays = [read_index(dataset_files(p)["idx"]) for p in prefixes]
    dtypes = {a.dtype for a in arrays}
    if len(dtypes) > 1:
        raise DataError(f"the datasets hold tokens of different types ({sorted(np.dtype(d).name for d in dtypes)}): "
                        "they were made with different tokenizers; merge only datasets of one tokenizer")
    dtype = arrays[0].dtype if arrays else np.uint16
    have_hashes = all(all_files(p)["dochash"].is_file() for p in prefixes)
    hashes = [read_hashes(all_files(p)["dochash"], len(a.doc_idx) - 1) for p, a in zip(prefixes, arrays)] \
        if (dedup or have_hashes) else None
    keeps = first_occurrences(hashes) if dedup else [np.ones(len(a.doc_idx) - 1, bool) for a in arrays]
    lengths, doc_idx, removed = [], [np.zeros(1, np.int64)], 0
    itemsize = np.dtype(dtype).itemsize
    with open(out["bin"], "wb") as dst, (open(out["dochash"], "wb") if hashes is not None else open(os.devnull, "wb")) as hf:
        for prefix, a, keep, i in zip(prefixes, arrays, keeps, range(len(arrays))):
            removed += int((~keep).sum())
            if keep.all():  # a part kept whole: its bytes and index as they are (also several sequences a document)
                with open(dataset_files(prefix)["bin"], "rb") as src:
                    _copy_range(src, dst, 0, int(a.lengths.sum(dtype=np.int64)) * itemsize)
                seq_base = sum(len(x) for x in lengths)
                lengths.append(np.asarray(a.lengths))
                doc_idx.append(a.doc_idx[1:] + seq_base)
            else:
                if not np.array_equal(a.doc_idx, np.arange(len(a.lengths) + 1)):
                    raise DataError(f"dataset {prefix} has documents of several sequences: --dedup exact works on "
                                    "datasets of one sequence per document (tools/preprocess_data.py's)")
                starts = np.concatenate([[0], np.cumsum(a.lengths.astype(np.int64))]) * itemsize
                with open(dataset_files(prefix)["bin"], "rb") as src:
                    for s, e in _runs(keep):
                        _copy_range(src, dst, int(starts[s]), int(starts[e] - starts[s]))
                seq_base = sum(len(x) for x in lengths)
                kept = np.asarray(a.lengths)[keep]
                lengths.append(kept)
                doc_idx.append(np.arange(1, len(kept) + 1, dtype=np.int64) + seq_base)
            if hashes is not None:
                hf.write(hashes[i][keep].tobytes())
    lengths_all = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
    write_index(out["idx"], dtype, lengths_all, np.concatenate(doc_idx))
    if hashes is None:
        out["dochash"].unlink(missing_ok=True)
    text_bytes = int(sum(int(h["text_bytes"][k].sum()) for h, k in zip(hashes, keeps))) if hashes is not None else None
    return {"documents": sum(int(k.sum()) for k in keeps), "tokens": int(lengths_all.sum(dtype=np.int64)),
            "text_bytes": text_bytes, "duplicates_removed": removed}


def partitions_of(prefix: str) -> list[str]:
    """The parts `tools/preprocess_data.py --partition I/N --output-prefix PREFIX` writes
    (PREFIX-0000I-of-0000N), sorted; [] when there are none."""
    return sorted(x[: -len(".idx")] for x in glob.glob(f"{glob.escape(prefix)}-[0-9]*-of-[0-9]*.idx"))


def dataset_prefixes(inputs: list[str]) -> list[Path]:
    """Dataset prefixes from what a user gives: prefixes, globs of prefixes (quoted or expanded by the
    shell, so `part-*` may arrive as its .bin/.idx/.meta.json files), or directories (every dataset
    in them), in sorted order within each; each once."""
    found: list[Path] = []
    for raw in inputs:
        p = Path(raw)
        if p.is_dir():
            matches = sorted(str(x)[: -len(".idx")] for x in p.glob("*.idx"))
        else:
            stem = raw
            for ext in (".bin", ".idx", ".meta.json", ".dochash", ".rejects.jsonl"):
                stem = stem.removesuffix(ext) if stem.endswith(ext) else stem
            matches = sorted(x[: -len(".idx")] for x in glob.glob(stem + ".idx")) if glob.has_magic(stem) \
                else [stem] if Path(stem + ".idx").exists() else partitions_of(stem)
        if not matches:
            raise DataError(f"--inputs {raw}: no dataset there (no {raw}.idx, nor a directory or glob of .idx files): "
                            "give the prefixes tools/preprocess_data.py wrote")
        found += [Path(m) for m in matches if Path(m) not in found]
    return found


def _agreed_meta(prefixes: list[Path]) -> tuple[dict, list[dict]]:
    metas = []
    for p in prefixes:
        check_indexed_dataset(p)
        f = dataset_files(p)["meta"]
        metas.append(json.loads(f.read_text()) if f.is_file() else {})
    first = metas[0]
    for p, m in zip(prefixes[1:], metas[1:]):
        for key in AGREE:
            if key in first and key in m and m[key] != first[key]:
                raise DataError(f"{prefixes[0]} and {p} differ in {key} ({first[key]!r} vs {m[key]!r}): merge only "
                                "datasets made with one tokenizer and the same --no-eod setting")
    return first, metas


def merge_datasets(inputs: list[str], output_prefix: str | Path, *, dedup: bool = False,
                   overwrite: bool = False) -> WriteSummary:
    """Merge the datasets `inputs` names (dataset_prefixes) into `output_prefix`, atomically."""
    start = time.perf_counter()
    prefixes = dataset_prefixes(inputs)
    out = Path(output_prefix)
    if out in prefixes:
        raise DataError(f"--output-prefix {out} is one of the inputs: write the merge under another prefix")
    refuse_existing(out, overwrite)
    first, metas = _agreed_meta(prefixes)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = all_files(f"{out}.tmp-{os.getpid()}")
    try:
        counts = join(prefixes, tmp, dedup=dedup)
        text_bytes = counts["text_bytes"] if counts["text_bytes"] is not None else \
            sum(int(m.get("text_bytes", 0)) for m in metas)
        removed = counts["duplicates_removed"] + sum(int(m.get("duplicates_removed", 0)) for m in metas)
        max_id = max(int(m.get("max_token_id", -1)) for m in metas)
        summary = WriteSummary(str(out), counts["documents"], counts["tokens"], text_bytes, tmp["bin"].stat().st_size,
                               time.perf_counter() - start, max_id if max_id >= 0 else 0, removed)
        skipped: dict = {}
        for m in metas:
            for reason, n in (m.get("skipped") or {}).items():
                skipped[reason] = skipped.get(reason, 0) + n
        meta = {**{k: v for k, v in first.items() if k in AGREE + ("tokenizer", "tokenizer_backend")},
                **summary.__dict__, "sources": [s for m in metas for s in m.get("sources", [])],
                "merged_from": [str(p) for p in prefixes], "dedup": "exact" if dedup else first.get("dedup"),
                "skipped": skipped}
        if not first:  # parts made elsewhere (no .meta.json): describe the files only
            meta["dtype"] = str(np.dtype(read_index(tmp["idx"]).dtype).name)
        tmp["meta"].write_text(json.dumps(meta, indent=2) + "\n")
        check_indexed_dataset(str(tmp["bin"])[: -len(".bin")])
        publish(tmp, all_files(out))
        return summary
    finally:
        for f in tmp.values():
            f.unlink(missing_ok=True)
