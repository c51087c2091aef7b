"""Preprocessing into Megatron indexed datasets: exact round trip, every input format, worker
count invariance, atomic output, and one clear line for each kind of bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cplm_dist.data.indexed_data import check_indexed_dataset, dataset_files, write_indexed_dataset
from cplm_dist.data.sources import ReadStats, iter_documents
from cplm_dist.data.tokenizer import load_tokenizer
from cplm_dist.errors import DataError
from cplm_dist.megatron_compat import parallel_state  # noqa: F401  (megatron's import warnings filtered)
from megatron.core.datasets.indexed_dataset import IndexedDataset

REPO = Path(__file__).resolve().parent.parent


def read_back(prefix, tokenizer):
    """Every document of an indexed dataset, detokenized, EOD stripped."""
    ds = IndexedDataset(str(prefix))
    out = []
    for i in range(len(ds)):
        ids = ds[i].tolist()
        assert ids[-1] == tokenizer.eod
        out.append(tokenizer.decode(ids[:-1]))
    return out


def test_round_trip_equals_input(small_data):
    tok = load_tokenizer(small_data.tokenizer)
    for name, docs in small_data.documents.items():
        assert read_back(small_data.prefixes[name], tok) == docs
        summary = check_indexed_dataset(small_data.prefixes[name], vocab_size=512)
        assert summary.documents == len(docs) and summary.dtype == "uint16" and summary.max_token_id < 512


def test_workers_give_identical_bytes(tmp_path, small_data):
    tok = load_tokenizer(small_data.tokenizer)
    for workers in (1, 2):
        write_indexed_dataset(iter_documents([small_data.raw["copy"]]), tok, tmp_path / f"w{workers}",
                              workers=workers, chunk_docs=16, progress=False)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"w1.{ext}").read_bytes() == (tmp_path / f"w2.{ext}").read_bytes()


def test_every_input_format_reads_the_same_documents(tmp_path, small_data):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = small_data.documents["copy"][:30]
    pq.write_table(pa.table({"content": docs}), tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps([{"content": d} for d in docs]))
    with open(tmp_path / "d.jsonl", "w") as f:
        f.writelines(json.dumps({"content": d, "id": i}) + "\n" for i, d in enumerate(docs))
    txt = tmp_path / "txt"
    txt.mkdir()
    for i, d in enumerate(docs):
        (txt / f"{i:03d}.txt").write_text(d)
    for source in ("d.parquet", "d.json", "d.jsonl", "txt"):
        assert list(iter_documents([tmp_path / source], text_key="content")) == docs, source


def bad_jsonl(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"text": "fine one"}\n{"text": broken\n{"body": "no text"}\n{"text": "caf\xe9 latin-1"}\n\n{"text": "fine two"}\n')
    return p


def test_bad_records_stop_with_file_and_line(tmp_path):
    p = bad_jsonl(tmp_path)
    with pytest.raises(DataError, match=rf"^{p}:2: not valid JSON .*--on-bad-record skip"):
        list(iter_documents([p]))
    p.write_bytes(b'{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=rf"^{p}:2: no string field 'text' \(found \['body'\]\); choose the field with --text-key"):
        list(iter_documents([p]))
    p.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"^{p}:2: not valid UTF-8 \(byte 0xe9 at offset 13\)"):
        list(iter_documents([p]))
    t = tmp_path / "latin1.txt"
    t.write_bytes(b"caf\xe9")
    with pytest.raises(DataError, match=rf"^{t}: not valid UTF-8"):
        list(iter_documents([t]))


def test_bad_records_skip_and_count(tmp_path):
    stats = ReadStats()
    (tmp_path / "empty.jsonl").write_bytes(b"")
    docs = list(iter_documents([bad_jsonl(tmp_path), tmp_path / "empty.jsonl"], on_bad="skip", stats=stats))
    assert docs == ["fine one", "fine two"]
    assert stats.skipped == {"lines not JSON": 1, "lines without 'text'": 1, "non-UTF-8 lines": 1, "empty files": 1}


def test_missing_and_empty_inputs(tmp_path):
    with pytest.raises(DataError, match=r"input .*nope.jsonl does not exist"):
        list(iter_documents([tmp_path / "nope.jsonl"]))
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty.jsonl: the file is empty"):
        list(iter_documents([tmp_path / "empty.jsonl"]))
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match=r"input directory .* holds no files"):
        list(iter_documents([tmp_path / "d"]))
    broken = tmp_path / "x.parquet"
    broken.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match=r"x.parquet: could not be read as parquet"):
        list(iter_documents([broken]))


def corrupt_copies(tmp_path, prefix):
    """(name, prefix) of damaged copies of a good dataset."""
    files = dataset_files(prefix)
    bin_bytes, idx_bytes = files["bin"].read_bytes(), files["idx"].read_bytes()
    cases = {
        "truncated-bin": (bin_bytes[:-10], idx_bytes),
        "truncated-idx": (bin_bytes, idx_bytes[:-8]),
        "bad-header": (bin_bytes, b"XXXXXXXXX" + idx_bytes[9:]),
        "extra-bin": (bin_bytes + b"\0\0", idx_bytes),
    }
    for name, (b, i) in cases.items():
        (tmp_path / f"{name}.bin").write_bytes(b)
        (tmp_path / f"{name}.idx").write_bytes(i)
    (tmp_path / "no-idx.bin").write_bytes(bin_bytes)
    return {name: str(tmp_path / name) for name in [*cases, "no-idx"]}


def test_corrupt_datasets_are_detected_when_opened(tmp_path, small_data):
    bad = corrupt_copies(tmp_path, small_data.prefixes["copy"])
    expected = {
        "truncated-bin": r"\.bin is \d+ bytes but the index describes \d+ \(truncated",
        "extra-bin": r"\.bin is \d+ bytes but the index describes",
        "truncated-idx": r"\.idx is \d+ bytes, expected \d+ \(truncated or corrupt\)",
        "bad-header": r"is not a Megatron index \(bad header\)",
        "no-idx": r"no-idx\.idx is missing",
    }
    for name, pattern in expected.items():
        with pytest.raises(DataError, match=pattern):
            check_indexed_dataset(bad[name])
    with pytest.raises(DataError, match=r"holds token id \d+ but model.vocab_size=100: it was made with another tokenizer"):
        check_indexed_dataset(small_data.prefixes["copy"], vocab_size=100)


def test_meta_must_describe_the_files_and_name_the_tokenizer(tmp_path, small_data):
    """Another dataset's .bin/.idx under an old .meta.json, or data made with another tokenizer,
    are refused by name before anything reads them."""
    code, copy = dataset_files(small_data.prefixes["code"]), dataset_files(small_data.prefixes["copy"])
    for kind in ("bin", "idx"):
        (tmp_path / f"mixed.{kind}").write_bytes(code[kind].read_bytes())
    (tmp_path / "mixed.meta.json").write_bytes(copy["meta"].read_bytes())
    with pytest.raises(DataError, match=r"mixed\.meta\.json describes another dataset .* copied or mixed files"):
        check_indexed_dataset(tmp_path / "mixed")
    tok = load_tokenizer(small_data.tokenizer)
    check_indexed_dataset(small_data.prefixes["copy"], tokenizer_sha256=tok.fingerprint)
    with pytest.raises(DataError, match=r"was made with another tokenizer .* point data.tokenizer at the one it was made with"):
        check_indexed_dataset(small_data.prefixes["copy"], tokenizer_sha256="0" * 64)

def test_existing_output_is_never_replaced_without_overwrite(tmp_path, small_data):
    tok = load_tokenizer(small_data.tokenizer)
    prefix = tmp_path / "out"
    write_indexed_dataset(["first version"], tok, prefix, progress=False)
    before = {k: f.read_bytes() for k, f in dataset_files(prefix).items()}
    with pytest.raises(DataError, match=r"already exists: choose another --output-prefix or pass --overwrite"):
        write_indexed_dataset(["second"], tok, prefix, progress=False)
    assert {k: f.read_bytes() for k, f in dataset_files(prefix).items()} == before


def test_interrupted_run_leaves_the_previous_dataset_and_no_partial_files(tmp_path, small_data):
    tok = load_tokenizer(small_data.tokenizer)
    prefix = tmp_path / "out"
    write_indexed_dataset(["the previous dataset"], tok, prefix, progress=False)
    before = {k: f.read_bytes() for k, f in dataset_files(prefix).items()}

    def documents():
        yield from small_data.documents["copy"][:100]
        raise KeyboardInterrupt  # the user hits Ctrl-C midway

    with pytest.raises(KeyboardInterrupt):
        write_indexed_dataset(documents(), tok, prefix, overwrite=True, chunk_docs=8, progress=False)
    assert {k: f.read_bytes() for k, f in dataset_files(prefix).items()} == before
    assert sorted(os.listdir(tmp_path)) == ["out.bin", "out.idx", "out.meta.json"]
    assert read_back(prefix, tok) == ["the previous dataset"]


def test_preprocess_cli(tmp_path, small_data):
    cmd = [sys.executable, str(REPO / "tools/preprocess_data.py"), "--tokenizer", str(small_data.tokenizer), "--no-progress"]
    ok = subprocess.run(cmd + ["--input", str(small_data.raw["copy"]), "--output-prefix", str(tmp_path / "c"), "--workers", "2"],
                        capture_output=True, text=True, timeout=180)
    assert ok.returncode == 0, ok.stderr
    assert "600 documents" in ok.stdout and "tokens/s" in ok.stdout
    assert np.array_equal(np.fromfile(tmp_path / "c.bin", np.uint16), np.fromfile(small_data.prefixes["copy"] + ".bin", np.uint16))
    bad = subprocess.run(cmd + ["--input", str(bad_jsonl(tmp_path)), "--output-prefix", str(tmp_path / "b")],
                         capture_output=True, text=True, timeout=180)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith(f"error: {tmp_path / 'bad.jsonl'}:2: not valid JSON")
    assert not any(p.name.startswith("b.") for p in tmp_path.iterdir())
