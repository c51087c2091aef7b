"""Preprocessing at cluster scale: compressed and columnar shards, directories that hold other
files, partitions merged back byte for byte, a SIGKILL'd run continued to the same bytes, bad
records kept out (a reject file) without losing finished work, and exact-duplicate removal across
partitions (cplm_dist/data/preprocess.py, merge.py, input_files.py; tools/preprocess_data.py,
tools/merge_data.py; launch/submit_preprocess.sh)."""

import gzip
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cplm_dist.data.indexed_data import dataset_files, read_index
from cplm_dist.data.input_files import partition, work_units
from cplm_dist.data.sources import ReadStats, iter_documents, read_unit
from cplm_dist.data.tokenizer import load_tokenizer
from cplm_dist_tools.merge_data import main as merge_main
from cplm_dist_tools.preprocess_data import main as preprocess_main

REPO = Path(__file__).resolve().parent.parent


def jsonl_bytes(docs) -> bytes:
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


@pytest.fixture(scope="module")
def shards(small_data, tmp_path_factory):
    """A directory as a data vendor ships it: .jsonl, .jsonl.gz, .jsonl.zst and .parquet shards
    (the last repeating 20 documents of the first), a README and a _SUCCESS marker."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs = small_data.documents["copy"][:240]
    root = tmp_path_factory.mktemp("shards")
    raw = root / "raw"
    raw.mkdir()
    (raw / "00.jsonl").write_bytes(jsonl_bytes(docs[:60]))
    (raw / "01.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(docs[60:120])))
    (raw / "02.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(docs[120:180])))
    pq.write_table(pa.table({"text": docs[180:] + docs[:20]}), raw / "03.parquet", row_group_size=16)
    (raw / "README").write_text("this dataset's card, not a document\n")
    (raw / "_SUCCESS").write_bytes(b"")
    return raw, docs[:180] + docs[180:] + docs[:20]


def run(small_data, out, *args, expect=0, **env):
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), *map(str, args), "--tokenizer",
           str(small_data.tokenizer), "--output-prefix", str(out), "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **env, "OMP_NUM_THREADS": "1"})
    assert r.returncode == expect, r.stderr[-2000:]
    return r


def decoded(prefix, tok):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    return [tok.decode(ds[i].tolist()[:-1]) for i in range(len(ds))]


def same_bytes(a, b):
    for ext in ("bin", "idx"):
        assert Path(f"{a}.{ext}").read_bytes() == Path(f"{b}.{ext}").read_bytes(), ext


@pytest.fixture(scope="module")
def whole(shards, small_data, tmp_path_factory):
    """One uninterrupted run over the directory, one worker, and its --dedup exact twin."""
    raw, _ = shards
    out = tmp_path_factory.mktemp("whole")
    r = run(small_data, out / "all", "--input", raw)
    assert preprocess_main(["--input", str(raw), "--tokenizer", str(small_data.tokenizer), "--output-prefix",
                            str(out / "dedup"), "--dedup", "exact", "--no-progress"]) == 0
    return out, r


def test_a_vendor_directory_reads_its_data_files_only(shards, small_data, whole, capsys):
    raw, docs = shards
    out, r = whole
    assert "skipped 2 files (2 not a data file" in r.stderr  # the README and _SUCCESS, said once
    assert decoded(out / "all", load_tokenizer(small_data.tokenizer)) == docs
    meta = json.loads(dataset_files(out / "all")["meta"].read_text())
    assert meta["documents"] == len(docs) and len(meta["sources"]) == 4
    dedup = json.loads(dataset_files(out / "dedup")["meta"].read_text())
    assert dedup["duplicates_removed"] == 20 and dedup["documents"] == len(docs) - 20
    assert decoded(out / "dedup", load_tokenizer(small_data.tokenizer)) == docs[:-20]
    # --pattern picks files by glob instead of by kind
    assert preprocess_main(["--input", str(raw), "--pattern", "*.gz", "--tokenizer", str(small_data.tokenizer),
                            "--output-prefix", str(out / "gz"), "--no-progress"]) == 0
    assert "skipped 5 files (5 not matching --pattern *.gz)" in capsys.readouterr().err
    assert decoded(out / "gz", load_tokenizer(small_data.tokenizer)) == docs[60:120]


def test_partitions_merged_equal_one_run_byte_for_byte(shards, small_data, whole, tmp_path):
    raw, _ = shards
    out, _ = whole
    for i in range(3):  # a Slurm array's tasks, each one part (the last on two workers)
        assert preprocess_main(["--input", str(raw), "--tokenizer", str(small_data.tokenizer), "--output-prefix",
                                str(tmp_path / "web"), "--partition", f"{i}/3", "--workers", str(1 + i // 2),
                                "--dedup", "exact", "--no-progress"]) == 0
    parts = sorted(p.name for p in tmp_path.glob("web-*-of-00003.idx"))
    assert parts == [f"web-{i:05d}-of-00003.idx" for i in range(3)]
    # the prefix the array wrote under stands for its parts, in the merge and in a blend
    assert merge_main(["--inputs", str(tmp_path / "web"), "--output-prefix", str(tmp_path / "merged")]) == 0
    same_bytes(tmp_path / "merged", out / "all")  # kept whole: duplicates are across parts
    from cplm_dist.config import load_config
    from cplm_dist.data.blend import resolve_blend
    cfg = load_config("tiny", [f"data.blend=[{{path: {tmp_path / 'web'}, weight: tokens}}]"])
    resolve_blend(cfg)
    assert [(Path(e.path).name, e.source) for e in cfg.data.blend] == \
        [(f"web-{i:05d}-of-00003", str(tmp_path / "web")) for i in range(3)]
    # the shell's expansion (.bin/.idx/.meta.json names) merges the same, and --dedup exact drops
    # the later copies across parts, as one deduplicated run does
    names = [str(p) for p in sorted(tmp_path.glob("web-*"))]
    assert merge_main(["--inputs", *names, "--output-prefix", str(tmp_path / "merged-dedup"), "--dedup", "exact"]) == 0
    same_bytes(tmp_path / "merged-dedup", out / "dedup")
    meta = json.loads(dataset_files(tmp_path / "merged-dedup")["meta"].read_text())
    assert meta["duplicates_removed"] == 20
    assert meta["text_bytes"] == json.loads(dataset_files(out / "dedup")["meta"].read_text())["text_bytes"]
    # a requeued task whose part is complete returns at once, changing nothing
    before = (tmp_path / "web-00001-of-00003.bin").stat().st_mtime_ns
    again = run(small_data, tmp_path / "web", "--input", raw, "--partition", "1/3", "--dedup", "exact")
    assert "already complete" in again.stdout + again.stderr
    assert (tmp_path / "web-00001-of-00003.bin").stat().st_mtime_ns == before


def test_a_sigkilled_run_continues_to_the_same_bytes(shards, small_data, whole, tmp_path):
    raw, _ = shards
    out, _ = whole
    args = ("--input", raw, "--workers", "2", "--split-mb", "0.004")  # the .jsonl cut in ranges: 7 units
    killed = run(small_data, tmp_path / "k", *args, expect=-9, CPLM_FAULT_KILL_AFTER_UNITS="2")
    assert not dataset_files(tmp_path / "k")["idx"].exists()
    assert len(list((tmp_path / "k.work").glob("*.json"))) >= 2, killed.stderr[-500:]
    again = run(small_data, tmp_path / "k", *args)
    assert "continuing:" in again.stdout + again.stderr
    same_bytes(tmp_path / "k", out / "all")
    assert not (tmp_path / "k.work").exists()
    # killed while publishing: the old index gone, its .meta.json already this job's, a temporary left
    dataset_files(tmp_path / "k")["idx"].unlink()
    (tmp_path / "k.tmp-99999999.bin").write_bytes(b"partial")
    run(small_data, tmp_path / "k", *args)
    same_bytes(tmp_path / "k", out / "all")
    assert sorted(p.name for p in tmp_path.glob("k*")) == ["k.bin", "k.idx", "k.meta.json"]


def test_line_ranges_know_their_lines_and_partitions_cover_the_inputs(tmp_path):
    lines = [json.dumps({"text": f"document {i} " + "x" * (i % 13)}) for i in range(200)]
    lines[137] = "{not json"
    f = tmp_path / "big.jsonl"
    f.write_text("\n".join(lines) + "\n")
    units = work_units([f], split_bytes=700)
    assert len(units) > 5 and units[0].start == 0 and units[-1].end == f.stat().st_size
    assert all(a.end == b.start for a, b in zip(units, units[1:]))
    stats = ReadStats()
    wheres = [d.where for u in units for d in read_unit(u, on_bad="skip", stats=stats)]
    assert wheres == [f"{f}:{n}" for n in range(1, 201) if n != 138] and stats.skipped["lines not JSON"] == 1
    items = []
    for i, size in enumerate([900, 10, 10, 10, 3000, 40, 500]):
        items.append(tmp_path / f"{i}.jsonl")
        items[-1].write_bytes(b"x" * size)
    for n in (1, 3, 7):
        assert sum((partition(items, i, n) for i in range(n)), []) == items


def test_one_file_in_three_partitions_merges_to_what_the_writer_wrote(small_data, tmp_path):
    """Fewer files than parts: the .jsonl is cut by lines; the merged parts are, byte for byte, the
    dataset megatron's builder wrote from the same file (tests/conftest.py's small_data)."""
    for i in range(3):
        assert preprocess_main(["--input", str(small_data.raw["copy"]), "--tokenizer", str(small_data.tokenizer),
                                "--output-prefix", str(tmp_path / "p"), "--partition", f"{i}/3", "--no-progress"]) == 0
    assert merge_main(["--inputs", str(tmp_path / "p"), "--output-prefix", str(tmp_path / "m")]) == 0
    same_bytes(tmp_path / "m", small_data.prefixes["copy"])


def test_a_bad_record_stops_naming_it_and_keeps_finished_units(shards, small_data, whole, tmp_path):
    raw, docs = shards
    out, _ = whole
    bad = tmp_path / "raw"
    bad.mkdir()
    for p in raw.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    (bad / "04.jsonl").write_bytes(jsonl_bytes(["fine"]) + b'{"text": 3}\n' + jsonl_bytes(["also fine"]))
    stop = run(small_data, tmp_path / "s", "--input", bad, expect=2)
    last = stop.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {bad / '04.jsonl'}:2: field 'text' is a number") and "units completed are kept" in last
    assert len(list((tmp_path / "s.work").glob("*.json"))) == 4 and not dataset_files(tmp_path / "s")["idx"].exists()
    skip = run(small_data, tmp_path / "s", "--input", bad, "--on-bad-record", "skip")
    assert "continuing: 4 of 5 units" in skip.stdout + skip.stderr
    assert decoded(tmp_path / "s", load_tokenizer(small_data.tokenizer)) == docs + ["fine", "also fine"]
    rejects = [json.loads(x) for x in (tmp_path / "s.rejects.jsonl").read_text().splitlines()]
    assert [r["record"].split(":")[1] for r in rejects] == ["2"]
    meta = json.loads(dataset_files(tmp_path / "s")["meta"].read_text())
    assert meta["rejects"] == 1 and meta["skipped"] == {"lines whose 'text' is not a string": 1}


def test_damaged_shards_and_mismatched_merges_are_one_line(shards, small_data, whole, tmp_path):
    raw, _ = shards
    out, _ = whole
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "a.jsonl.gz").write_bytes((raw / "01.jsonl.gz").read_bytes()[:-40])  # a copy cut short
    r = run(small_data, tmp_path / "d", "--input", cut, expect=2)
    assert "not a complete gzip stream" in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.glob("d*"))  # nothing finished: nothing left
    (cut / "b.jsonl.zst").write_bytes((raw / "02.jsonl.zst").read_bytes()[:-40])  # zstd ends quietly: not here
    stats = ReadStats()
    list(iter_documents([cut], on_bad="skip", stats=stats))
    assert stats.skipped["damaged compressed files"] == 2
    # parts of another tokenizer (a dataset of 512-entry uint16 ids vs none) cannot merge
    other = tmp_path / "other"
    (tmp_path / "other.bin").write_bytes(np.arange(10, dtype=np.int32).tobytes())
    from cplm_dist.data.indexed_data import write_index
    write_index(tmp_path / "other.idx", np.int32, np.array([10], np.int32), np.array([0, 1]))
    assert read_index(tmp_path / "other.idx").lengths.tolist() == [10]
    with pytest.raises(Exception, match="different types|differ in"):
        from cplm_dist.data.merge import merge_datasets
        merge_datasets([str(out / "all"), str(other)], tmp_path / "m")
    assert merge_main(["--inputs", str(tmp_path / "nothing-*"), "--output-prefix", str(tmp_path / "m")]) == 2
    assert merge_main(["--inputs", str(out / "all"), "--output-prefix", str(out / "all")]) == 2


def test_the_array_submission_checks_before_it_queues(shards, small_data, tmp_path):
    raw, _ = shards
    base = ["bash", str(REPO / "launch" / "submit_preprocess.sh"), "--time", "01:00:00", "--cpus-per-task", "4"]
    tail = ["--", "--input", str(raw), "--tokenizer", str(small_data.tokenizer), "--output-prefix", str(tmp_path / "w"),
            "--dedup", "exact"]
    env = {**os.environ, "PYTHON": sys.executable}
    ok = subprocess.run(base + ["--parts", "2", "--max-running", "1", "--merge", "--dry-run"] + tail,
                        capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0, ok.stderr
    array, merge = ok.stdout.strip().splitlines()
    assert "--array 0-1%1" in array and "preprocess.sbatch" in array and "--cpus-per-task 4" in array
    assert "afterok" in merge and "merge_data" in merge and "w-\\\\\\*-of-00002" in merge and "exact" in merge
    too_many = subprocess.run(base + ["--parts", "99", "--dry-run"] + tail, capture_output=True, text=True, timeout=120, env=env)
    assert too_many.returncode == 2 and "fewer than 99 parts" in too_many.stderr


def preprocess_dry_run(*options):
    """launch/submit_preprocess.sh ... --dry-run; PYTHON=true skips the inputs' check (the test
    above has it): what is read here is the sbatch lines."""
    env = {**os.environ, "PYTHON": "true"}
    return subprocess.run(["bash", str(REPO / "launch" / "submit_preprocess.sh"), "--parts", "4", "--time", "01:00:00",
                           *options, "--dry-run", "--", "--input", "raw/", "--tokenizer", "tok.model", "--output-prefix",
                           "data/web"], capture_output=True, text=True, timeout=60, env=env)


def test_the_array_submission_passes_other_sbatch_options_through():
    """As launch/submit.sh (launch/sbatch_options.sh, shared): options the script does not take
    reach sbatch as given (`--opt=v`, `--opt v`, a bare flag), on the array and the merge job, a
    --dependency on the array only; its own options take `--opt=v` too; short options, those it
    sets itself and stray words are one line, exit 2."""
    proc = preprocess_dry_run("--parts=8", "--qos=high", "--constraint", "cpu", "--exclusive", "--reservation=R",
                              "--dependency", "afterok:7", "--merge")
    assert proc.returncode == 0, proc.stderr
    array, merge = [shlex.split(line) for line in proc.stdout.splitlines()]
    script = next(i for i, w in enumerate(array) if w.endswith("preprocess.sbatch"))
    assert array[script - 6:script] == ["--constraint", "cpu", "--exclusive", "--reservation=R", "--dependency", "afterok:7"]
    assert array[array.index("--array") + 1] == "0-7" and array[array.index("--qos") + 1] == "high"
    assert merge[merge.index("--wrap") - 2:merge.index("--wrap")] == ["--dependency", "afterok:<array job>"]
    assert ["--constraint", "cpu", "--exclusive", "--reservation=R"] == merge[merge.index("--constraint"):][:4]
    assert merge.count("--dependency") == 1 and merge[merge.index("--qos") + 1] == "high"
    for options, message in [(["-q", "high"], "error: short option -q: give sbatch options in their long form"),
                             (["--array=0-3"], "error: --array is set by launch/submit_preprocess.sh: use --parts N"),
                             (["--output", "x.log"], "error: --output is set by launch/submit_preprocess.sh"),
                             (["--wrap", "hostname"], "error: --wrap does not fit launch/submit_preprocess.sh"),
                             (["stray"], "error: unexpected argument 'stray' before --")]:
        refused = preprocess_dry_run(*options)
        assert refused.returncode == 2 and not refused.stdout and refused.stderr.startswith(message), refused.stderr


def test_an_array_job_on_a_real_slurm_writes_the_parts_and_merges_them(shards, small_data, whole, tmp_path,
                                                                       tmp_path_factory):
    """launch/submit_preprocess.sh on Debian's slurmctld/slurmd (tests/slurm_cluster.py): two array
    tasks each write their partition, the dependent merge job joins them into the bytes of one run."""
    from tests.slurm_cluster import LocalSlurm, ensure_slurm

    reason = ensure_slurm()
    if reason:
        pytest.skip(reason)
    raw, _ = shards
    out, _ = whole
    slurm = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()  # a short path: slurmd's sockets live in it
    try:
        cmd = ["bash", str(REPO / "launch" / "submit_preprocess.sh"), "--parts", "2", "--time", "00:05:00", "--merge",
               "--wait", "--log-dir", str(tmp_path / "logs"), "--", "--input", str(raw), "--tokenizer",
               str(small_data.tokenizer), "--output-prefix", str(tmp_path / "web"), "--dedup", "exact"]
        env = {**os.environ, **slurm.env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
        logs = {p.name: p.read_text() for p in (tmp_path / "logs").glob("*.out")}
        assert proc.returncode == 0, (proc.stderr[-1500:], logs)
    finally:
        slurm.stop()
    assert sorted(logs) == ["cplm-preprocess-1_0.out", "cplm-preprocess-1_1.out", "cplm-preprocess-merge-2.out"]
    assert "task 1/2" in logs["cplm-preprocess-1_1.out"]
    same_bytes(tmp_path / "web", out / "dedup")
