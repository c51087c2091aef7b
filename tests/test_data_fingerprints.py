"""Data fingerprints: a checkpoint records the content fingerprint of every dataset of its blend
(complete.json's optional `data_fingerprints`), and a resume over data that changed since is
refused with one line (exit 2, nothing written) unless --allow-data-change; a checkpoint saved
without them resumes with a warning and the next one records them. The fingerprint reads a bounded
number of sampled blocks whatever the dataset's size. Evaluation refuses a checkpoint whose carried
tokenizer is not the one it was saved with. docs/reliability.md lists them.

One 2-step training run (a checkpoint at step 2) in a directory of its own, with the datasets
beside it under relative paths (data/code, data/copy): each test works on a copy of that directory,
so that it can change "the same" dataset (data.blend is the same path) without touching the
others' data."""

import json
import os
import shutil
from pathlib import Path

import pytest

from cplm_dist.data import indexed_data
from cplm_dist.data.indexed_data import (FINGERPRINT_BLOCK_BYTES, FINGERPRINT_BLOCKS, FINGERPRINT_INDEX_BYTES,
                                         content_fingerprint, fingerprint_reads)
from tests.spawn import run_ranks
from tests.test_train import argv, snapshot

NAMES = ("code", "copy")
BLEND = "data.blend=[" + ", ".join(f"{{path: data/{n}, weight: 0.5}}" for n in NAMES) + "]"
STEP2 = Path("run") / "checkpoints" / "step-00000002"
STEP3 = Path("run") / "checkpoints" / "step-00000003"


# --- the fingerprint ------------------------------------------------------------------------------------


def _pair(root: Path, bin_bytes: int, idx_bytes: int, sparse: bool = False) -> str:
    """A .bin/.idx pair of these sizes (random bytes, or holes: content_fingerprint reads, it does not parse)."""
    prefix = root / "big"
    for suffix, size in ((".bin", bin_bytes), (".idx", idx_bytes)):
        with open(f"{prefix}{suffix}", "wb") as f:
            if sparse:
                f.truncate(size)
            else:
                f.write(os.urandom(size))
    return str(prefix)


def _flip(path: str | Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_the_fingerprint_sees_a_block_of_a_large_bin_and_the_middle_of_the_index(tmp_path):
    prefix = _pair(tmp_path, 8 << 20, 4 << 20)  # larger than what the fingerprint reads of either
    before = content_fingerprint(prefix)
    assert content_fingerprint(prefix) == before  # deterministic
    middle_block, _ = fingerprint_reads(8 << 20, FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK_BYTES)[FINGERPRINT_BLOCKS // 2]
    for path, offset in ((f"{prefix}.bin", middle_block + 1234), (f"{prefix}.idx", (4 << 20) // 2)):
        _flip(path, offset)
        assert content_fingerprint(prefix) != before, (path, offset)
        _flip(path, offset)  # restored: the same fingerprint again
        assert content_fingerprint(prefix) == before


def test_the_fingerprint_reads_a_bounded_number_of_blocks_whatever_the_size(tmp_path, monkeypatch):
    """A 1 TiB .bin (a sparse file) and an 8 MiB .idx: exactly 32 blocks of 64 KiB of the .bin (the
    first at 0, the last ending at its end) and three MiB of the index are read."""
    size = 1 << 40
    prefix = _pair(tmp_path, size, 8 << 20, sparse=True)
    reads = {".bin": [], ".idx": []}

    class Counting:
        def __init__(self, path, mode):
            self.f, self.kind = open(path, mode), Path(path).suffix

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, offset):
            self.at = offset
            return self.f.seek(offset)

        def read(self, n):
            data = self.f.read(n)
            reads[self.kind].append((self.at, len(data)))
            return data

    monkeypatch.setattr(indexed_data, "open", Counting, raising=False)
    before = content_fingerprint(prefix)
    block = FINGERPRINT_BLOCK_BYTES
    assert len(reads[".bin"]) == FINGERPRINT_BLOCKS == 32 and {n for _, n in reads[".bin"]} == {block} == {64 << 10}
    assert sum(n for _, n in reads[".bin"]) == 2 << 20
    assert reads[".bin"][0][0] == 0 and reads[".bin"][-1][0] == size - block  # first and last blocks
    assert reads[".idx"] == [(0, 1 << 20), ((8 << 20) // 2 - (1 << 19), 1 << 20), ((8 << 20) - (1 << 20), 1 << 20)]
    assert FINGERPRINT_INDEX_BYTES == 1 << 20
    monkeypatch.undo()
    _flip(f"{prefix}.bin", size - 1)  # the last byte is in the last block
    assert content_fingerprint(prefix) != before
    _flip(f"{prefix}.bin", size - 1)
    _flip(f"{prefix}.bin", size // 2 + 7 * block)  # between two sampled blocks: sampled, not hashed whole
    assert content_fingerprint(prefix) == before


# --- a run and its resumes ---------------------------------------------------------------------------------


def _main_in(cwd, entry, args, log_dir):
    """`entry`'s main(args) run in `cwd`, its stdout and stderr into log_dir/{out,err} (as a
    subprocess's would be): the exit code a CLI would give."""
    import sys

    if os.environ.get("TORCH_EXTENSIONS_DIR"):  # DeepSpeed's built ops: where they are, not below `cwd`
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.abspath(os.environ["TORCH_EXTENSIONS_DIR"])
    os.chdir(cwd)
    for fd, name in ((1, "out"), (2, "err")):
        f = open(Path(log_dir) / name, "w")
        os.dup2(f.fileno(), fd)
    try:
        if entry == "train":
            from cplm_dist.train.driver import main
        else:
            from cplm_dist_tools.generate import main
        return main(args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


class Result:
    def __init__(self, code, log_dir):
        self.returncode = code
        self.stdout, self.stderr = ((log_dir / n).read_text() for n in ("out", "err"))


def run_in(cwd: Path, args: list, entry: str = "train") -> Result:
    log_dir = cwd.parent / f"log-{len(list(cwd.parent.glob('log-*')))}"
    log_dir.mkdir()
    return Result(run_ranks(_main_in, 1, args=(str(cwd), entry, args, str(log_dir)), timeout=240)[0], log_dir)


def run_args(small_data, steps: int, *extra) -> list:
    return argv(small_data, "run", f"train.train_steps={steps}", "train.save_interval=2", "train.tensorboard=false",
                BLEND, *extra)


@pytest.fixture(scope="module")
def base(small_data, tmp_path_factory):
    """work/: data/{code,copy}.* (copies of the session's datasets) and run/, trained 2 steps."""
    work = tmp_path_factory.mktemp("fingerprints") / "work"
    (work / "data").mkdir(parents=True)
    for name in NAMES:
        for suffix in (".bin", ".idx", ".meta.json"):
            shutil.copyfile(small_data.prefixes[name] + suffix, work / "data" / (name + suffix))
    result = run_in(work, run_args(small_data, 2))
    assert result.returncode == 0, result.stderr[-3000:]
    return work


def copy_of(base: Path, tmp_path: Path) -> Path:
    work = tmp_path / "work"
    shutil.copytree(base, work)
    return work


def manifest_of(step_dir: Path) -> dict:
    return json.loads((step_dir / "complete.json").read_text())


def change_a_sampled_block(prefix: Path) -> None:
    """Another token id in the middle block the fingerprint reads (the size kept; ids < the vocabulary)."""
    import numpy as np

    path = Path(f"{prefix}.bin")
    offsets = fingerprint_reads(path.stat().st_size, FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK_BYTES)
    offset, length = offsets[len(offsets) // 2]  # the whole file, for one not larger than the blocks together
    at = offset + length // 2
    at -= at % 2  # a uint16 token
    tokens = np.memmap(path, dtype=np.uint16, mode="r+")
    tokens[at // 2] = (int(tokens[at // 2]) + 1) % 500
    tokens.flush()
    del tokens


def test_a_checkpoint_records_the_fingerprint_of_every_dataset_of_its_blend(base):
    recorded = manifest_of(base / STEP2)["data_fingerprints"]
    assert recorded == {f"data/{n}": content_fingerprint(base / "data" / n) for n in NAMES}


def test_a_resume_over_changed_data_is_refused_with_one_line_nothing_written(small_data, base, tmp_path):
    work = copy_of(base, tmp_path)
    change_a_sampled_block(work / "data" / "code")
    before = snapshot(work)
    result = run_in(work, run_args(small_data, 3) + ["--resume", "auto"])
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: dataset data/code changed since step 2 was saved ({Path('run/checkpoints/step-00000002')}): its contents "
        "differ from the fingerprint in its complete.json; restore the data the run was trained on, or resume with "
        "--allow-data-change to accept it")
    assert snapshot(work) == before


def test_allow_data_change_resumes_names_the_dataset_and_records_its_new_fingerprint(small_data, base, tmp_path):
    work = copy_of(base, tmp_path)
    change_a_sampled_block(work / "data" / "code")
    result = run_in(work, run_args(small_data, 3) + ["--resume", "auto", "--allow-data-change"])
    assert result.returncode == 0, result.stderr[-3000:]
    warned = [line for line in result.stderr.splitlines() if "--allow-data-change: resuming" in line]
    assert len(warned) == 1 and "dataset data/code changed since step 2 was saved" in warned[0], result.stderr[-3000:]
    assert "data/copy" not in warned[0]
    old, new = manifest_of(work / STEP2)["data_fingerprints"], manifest_of(work / STEP3)["data_fingerprints"]
    assert new["data/code"] == content_fingerprint(work / "data" / "code") != old["data/code"]
    assert new["data/copy"] == old["data/copy"]


def test_a_checkpoint_without_data_fingerprints_resumes_with_a_warning_and_records_them(small_data, base, tmp_path):
    from cplm_dist.checkpoint.manifest import read_manifest

    work = copy_of(base, tmp_path)
    manifest = manifest_of(work / STEP2)
    recorded = manifest.pop("data_fingerprints")
    (work / STEP2 / "complete.json").write_text(json.dumps(manifest))  # as a checkpoint saved before them
    assert read_manifest(work / STEP2).data_fingerprints is None and read_manifest(work / STEP2).to_json().keys() == manifest.keys()
    result = run_in(work, run_args(small_data, 3) + ["--resume", "auto"])
    assert result.returncode == 0, result.stderr[-3000:]
    warned = [line for line in result.stderr.splitlines() if "has no data fingerprints" in line]
    assert len(warned) == 1 and warned[0].endswith("recording them from now on"), result.stderr[-3000:]
    assert manifest_of(work / STEP3)["data_fingerprints"] == recorded


# --- evaluation and the tokenizer a checkpoint carries -------------------------------------------------------


def test_evaluation_refuses_a_replaced_carried_tokenizer_with_one_line(small_data, base, tmp_path):
    """Another SentencePiece model of the same vocabulary size (it would load, fit the model and
    give other token ids) in place of the one the checkpoint carries: one line, exit 2."""
    from cplm_dist.data.sources import iter_documents
    from cplm_dist.data.tokenizer import train_sentencepiece

    work = copy_of(base, tmp_path)
    step2 = work / STEP2
    carried = step2 / "tokenizer.model"
    assert manifest_of(step2)["files"]["tokenizer.model"]["bytes"] == carried.stat().st_size  # hashed with the weights
    other = tmp_path / "other.model"
    train_sentencepiece(iter_documents([small_data.raw["copy"]]), other, vocab_size=512)
    assert other.read_bytes() != carried.read_bytes()
    shutil.copyfile(other, carried)
    result = run_in(work, ["--checkpoint", str(step2), "--prompt", "x", "--max-new-tokens", "2"], entry="generate")
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {carried}: the tokenizer this checkpoint carries is not the one it was saved with "
                           "(sha256 "), last
    assert last.endswith("its token ids would not be the model's; restore the run's data.tokenizer there, or use an "
                         "earlier step (--checkpoint <run>/checkpoints/step-*)"), last
