"""Preprocessing into Megatron indexed datasets: exact round trip, every input format, worker
count invariance, atomic output, and one clear line for each kind of bad input; every class of
edge-case text either round-trips exactly or is stopped on / skipped with its file and line."""

import csv
import json
import os
import subprocess
import sys
from dataclasses import dataclass
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


# --- text edge cases: each class round-trips exactly, or is a bad record named by file and line ---

EDGE_TEXTS = {
    "whitespace": [" ", "   ", " leading", "trailing ", "a   b", "\t", "\tx\t\t", " \t \n "],
    "line-ends": ["a\r\nb\r\n", "a\rb\r", "\n", "\n\n\na", "\r\n\r\n", "\r"],
    "unicode-separators": ["a\u2028b", "a\u2029b", "a\x85b", "a\x0bb", "a\x0cb", "\x1c\x1d\x1e\x1f"],
    "control-characters": ["a\x00b", "\x00", "".join(map(chr, range(1, 32))), "\x7f", "\x80\x9f"],
    "non-bmp": ["\U0001f642", "\U0001f469\u200d\U0001f469\u200d\U0001f467", "\U0001d518\U0001d52b", "\U0010ffff", "\U000e0001"],
    "normalisation": ["e\u0301", "\u00e9", "\ufb01", "\u2460", "\uff76\uff9e", "\u212b", "\uff21\uff22", "a\u3000b", "\u1e9b\u0323"],
    "invisible": ["a\u200bb", "a\u200db", "a\ufeffb", "\u202eabc", "a\u00a0b", "\u00ad"],
    "special-tokens-as-text": ["<s>", "</s>", "<unk>", "<pad>", "<eod>", "x<s>y</s>z", "\u2047", "<0x00>", "<0x0A>"],
    "noncharacters": ["\uffff", "\ufffe", "\ufffd", "\ue000"],
    "csv-like": ["NA", "null", "None", "N/A", "nan", "007", "1.50", "True", '"quoted"', "a,b", " padded "],
    "long": ["x" * 100_000, "word " * 20_000, "\U0001f642" * 10_000],
}


def preprocess(paths, tok, prefix, on_bad="stop"):
    stats = ReadStats()
    write_indexed_dataset(iter_documents(paths, on_bad=on_bad, stats=stats), tok, prefix,
                          on_bad=on_bad, stats=stats, progress=False)
    return stats


@pytest.mark.parametrize("kind", sorted(EDGE_TEXTS))
def test_edge_case_texts_round_trip_exactly(tmp_path, small_data, kind):
    """Through JSON lines (escaped and raw), the tokenizer, the .bin/.idx and megatron's reader."""
    texts = EDGE_TEXTS[kind]
    raw = tmp_path / "in.jsonl"
    raw.write_text("".join(json.dumps({"text": t}, ensure_ascii=i % 2 == 0) + "\n" for i, t in enumerate(texts)),
                   encoding="utf-8")
    tok = load_tokenizer(small_data.tokenizer)
    stats = preprocess([raw], tok, tmp_path / "out")
    assert read_back(tmp_path / "out", tok) == texts
    assert not stats.skipped and stats.documents == len(texts)


def _write_format(tmp_path, fmt, texts, bom):
    """`texts` stored as `fmt`; the path to read (a directory for plain text)."""
    sig = b"\xef\xbb\xbf" if bom else b""
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet")
        return tmp_path / "d.parquet"
    if fmt == "txt":
        (tmp_path / "txt").mkdir()
        for i, t in enumerate(texts):
            (tmp_path / "txt" / f"{i:03d}.txt").write_bytes(sig + t.encode("utf-8"))
        return tmp_path / "txt"
    path = tmp_path / f"d.{fmt}"
    if fmt == "jsonl":
        body = "".join(json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n" for i, t in enumerate(texts)).encode()
    elif fmt == "json":
        body = json.dumps([{"text": t} for t in texts], indent=1, ensure_ascii=False).encode()
    else:
        with open(path, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows([["id", "text"], *([i, t] for i, t in enumerate(texts))])
        body = path.read_bytes()
    path.write_bytes(sig + body)
    return path


@pytest.mark.parametrize("fmt,bom", [(f, False) for f in ("jsonl", "json", "csv", "parquet", "txt")]
                         + [(f, True) for f in ("jsonl", "json", "csv", "txt")])
def test_edge_case_texts_are_read_exactly_from_every_format(tmp_path, fmt, bom):
    """Every format gives back the stored strings (CSV fields stay strings: "NA", "007"); a UTF-8
    byte-order mark at the start of a file is dropped, one inside a text is kept."""
    texts = [t for kind in sorted(EDGE_TEXTS) for t in EDGE_TEXTS[kind] if len(t) < 1000]
    docs = list(iter_documents([_write_format(tmp_path, fmt, texts, bom)]))
    assert docs == texts
    if fmt in ("jsonl", "csv"):  # one record a line (CSV: quoted fields may span lines)
        assert docs[0].where.endswith(":2" if fmt == "csv" else ":1") and len({d.where for d in docs}) == len(docs)


@dataclass
class Refused:
    name: str
    file: str
    content: object  # bytes, or a function writing the file
    where: str  # after the path
    message: str  # the whole message; ending in "..." a prefix of it
    reason: str  # the skip count's key
    kept: tuple = ("before", "after")


def _jsonl(bad: bytes) -> bytes:
    return b'{"text": "before"}\n' + bad + b'\n{"text": "after"}\n'


def _csv(bad: bytes) -> bytes:
    return b"id,text\n1,before\n" + bad + b"\n3,after\n"


def _json(bad: bytes) -> bytes:
    return b'[{"text": "before"},\n' + bad + b',\n{"text": "after"}]'


def _parquet_with_null(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["before", None, "after"]}), path)


REFUSED = [
    Refused("lone-surrogate", "s.jsonl", _jsonl(b'{"text": "a\\ud800b"}'), ":2",
            "not Unicode text: a lone surrogate U+D800 at character 2 (half of a UTF-16 pair, e.g. a JSON "
            "\\ud800 escape without its other half)", "texts that are not Unicode"),
    Refused("lone-surrogate-in-json-array", "s.json", _json(b'{"text": "\\udfff"}'), ":2",
            "not Unicode text: a lone surrogate U+DFFF at character 1 (half of a UTF-16 pair, e.g. a JSON "
            "\\ud800 escape without its other half)", "texts that are not Unicode"),
    Refused("sentencepiece-space-marker", "m.jsonl", _jsonl('{"text": "a\u2581b"}'.encode()), ":2",
            "the tokenizer does not give it back: '\u2581' (U+2581) at character 2 comes back as ' ' (U+0020) "
            "(U+2581 is SentencePiece's space marker: it always decodes as a space)", "texts the tokenizer does not reproduce"),
    Refused("space-marker-in-csv", "m.csv", _csv('2,"x \u2581"'.encode()), ":3",
            "the tokenizer does not give it back: '\u2581' (U+2581) at character 3 comes back as ' ' (U+0020) "
            "(U+2581 is SentencePiece's space marker: it always decodes as a space)", "texts the tokenizer does not reproduce"),
    Refused("text-null", "n.jsonl", _jsonl(b'{"text": null}'), ":2", "field 'text' is null, not a string",
            "lines whose 'text' is not a string"),
    Refused("text-number", "n.jsonl", _jsonl(b'{"text": 5}'), ":2", "field 'text' is a number, not a string",
            "lines whose 'text' is not a string"),
    Refused("text-list", "n.jsonl", _jsonl(b'{"text": ["a"]}'), ":2", "field 'text' is a list, not a string",
            "lines whose 'text' is not a string"),
    Refused("text-number-in-json-array", "n.json", _json(b'{"text": 5}'), ":2", "field 'text' is a number, not a string",
            "records whose 'text' is not a string"),
    Refused("text-null-in-parquet", "n.parquet", _parquet_with_null, ": row 2", "column 'text' is null, not a string",
            "rows whose 'text' is not a string"),
    Refused("json-nested-too-deeply", "d.jsonl", _jsonl(b'{"text": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
            ":2", "not valid JSON here (nested too deeply to read)", "lines not JSON"),
    Refused("json-integer-too-long", "d.jsonl", _jsonl(b'{"text": "a", "x": 1' + b"0" * 5000 + b"}"), ":2",
            "not valid JSON here (Exceeds the limit (4300 digits) for integer string conversion...", "lines not JSON"),
    Refused("json-raw-control-character", "c.jsonl", _jsonl(b'{"text": "a\x01b"}'), ":2",
            "not valid JSON (Invalid control character at column 12)", "lines not JSON"),
    Refused("non-utf8-in-csv", "u.csv", _csv(b"2,caf\xe9"), ":3", "not valid UTF-8 (byte 0xe9 at offset 5)", "non-UTF-8 rows"),
    Refused("csv-unquoted-separator", "f.csv", _csv(b"2,hello, world"), ":3",
            "3 fields but the header has 2 (a separator or quote in an unquoted field?)", "rows with a wrong number of fields"),
    Refused("csv-bad-quote", "q.csv", _csv(b'2,"a"b'), ":3", "not valid CSV (',' expected after '\"')", "rows not CSV"),
    Refused("csv-lone-carriage-return", "r.csv", _csv(b"2,a\rb"), ":3",
            "not valid CSV (a carriage return outside quotes: quote the field, or end lines with \\n or \\r\\n)", "rows not CSV"),
    Refused("json-array-broken", "b.json", b'[{"text": "before"},\n{"text": "after"},\n]', ":3",
            "not valid JSON (Expecting value at column 1)", "files not JSON", kept=()),
    Refused("non-utf8-in-json-array", "u.json", b'[{"text": "before"},\n{"text": "caf\xe9"}]', ":2",
            "not valid UTF-8 (byte 0xe9 at offset 13)", "non-UTF-8 files", kept=()),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c.name for c in REFUSED])
def test_texts_that_cannot_round_trip_stop_or_skip_with_file_and_line(tmp_path, small_data, case):
    """One line naming the file and line under stop (nothing written); under skip the record is
    counted and everything else round-trips."""
    tok = load_tokenizer(small_data.tokenizer)
    path = tmp_path / case.file
    case.content(path) if callable(case.content) else path.write_bytes(case.content)
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "other"}\n')
    with pytest.raises(DataError) as stopped:
        preprocess([path, other], tok, tmp_path / "stop")
    line = str(stopped.value)
    head, tail = f"{path}{case.where}: {case.message}", "; fix the input or pass --on-bad-record skip to skip and count such records"
    if case.message.endswith("..."):
        assert line.startswith(head[:-3]) and line.endswith(tail) and "\n" not in line, line
    else:
        assert line == head + tail
    assert not list(tmp_path.glob("stop*"))
    stats = preprocess([path, other], tok, tmp_path / "skip", on_bad="skip")
    assert stats.skipped == {case.reason: 1}
    assert read_back(tmp_path / "skip", tok) == [*case.kept, "other"]


def test_plain_strings_are_checked_too(tmp_path, small_data):
    """write_indexed_dataset given plain strings (no file) names the document by its number."""
    tok = load_tokenizer(small_data.tokenizer)
    with pytest.raises(DataError, match=r"^document 2: the tokenizer does not give it back: '\u2581' \(U\+2581\)"):
        write_indexed_dataset(["fine", "a\u2581b"], tok, tmp_path / "x", progress=False)
    stats = ReadStats()
    write_indexed_dataset(["fine", "\ud800", "", "a\u2581b", " also fine "], tok, tmp_path / "y", progress=False,
                          on_bad="skip", stats=stats, append_eod=False)
    assert stats.skipped == {"texts the tokenizer does not reproduce": 2, "empty documents": 1}
    ds = IndexedDataset(str(tmp_path / "y"))
    assert [tok.decode(ds[i].tolist()) for i in range(len(ds))] == ["fine", " also fine "]
    assert check_indexed_dataset(tmp_path / "y").documents == 2


def test_preprocess_cli_edge_cases_never_give_a_traceback(tmp_path, small_data):
    """Every refused class at once: skip writes the rest (2 workers, so the check runs in the pool)
    and counts each reason; stop ends with one line, exit 2, nothing written."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    for case in REFUSED:
        if not callable(case.content) and "nested" not in case.name:
            (inputs / f"{case.name}-{case.file}").write_bytes(case.content)
    (inputs / "z-edge.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for ts in EDGE_TEXTS.values() for t in ts))
    cmd = [sys.executable, str(REPO / "tools/preprocess_data.py"), "--tokenizer", str(small_data.tokenizer),
           "--no-progress", "--input", str(inputs)]
    skip = subprocess.run(cmd + ["--output-prefix", str(tmp_path / "skip"), "--on-bad-record", "skip", "--workers", "2"],
                          capture_output=True, text=True, timeout=180)
    assert skip.returncode == 0 and "Traceback" not in skip.stderr, skip.stderr
    assert "2 texts the tokenizer does not reproduce" in skip.stdout and "2 texts that are not Unicode" in skip.stdout
    tok = load_tokenizer(small_data.tokenizer)
    back = read_back(tmp_path / "skip", tok)
    assert back[-sum(map(len, EDGE_TEXTS.values())):] == [t for ts in EDGE_TEXTS.values() for t in ts]
    stop = subprocess.run(cmd + ["--output-prefix", str(tmp_path / "stop")], capture_output=True, text=True, timeout=180)
    assert stop.returncode == 2 and "Traceback" not in stop.stderr, stop.stderr
    first = sorted(inputs.iterdir())[0]
    assert stop.stderr.strip().splitlines()[-1].startswith(f"error: {first}:")
    assert not list(tmp_path.glob("stop*"))
