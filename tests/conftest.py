"""Shared fixtures: a small corpus turned into a tokenizer and two indexed datasets, once per session."""

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from cplm_dist.data.corpora import stdlib_files, synthetic_copy_documents, write_jsonl
from cplm_dist.data.indexed_data import write_indexed_dataset
from cplm_dist.data.sources import iter_documents
from cplm_dist.data.tokenizer import load_tokenizer, train_sentencepiece

from tests import scheduling
from tests.scheduling import pytest_xdist_make_scheduler  # noqa: F401 (a hook, registered from here)

VOCAB = 512

# One ninja for every process, as in an activated venv: DeepSpeed JIT-builds its shm comm op in
# ~/.cache/torch_extensions, and the launcher tests put the venv's bin first on PATH (mpirun,
# deepspeed). Its ninja (1.13) and the system's (1.11) keep incompatible build logs, so each switch
# between them rebuilt the op from scratch (~45 s each, twice a suite).
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
# The op's build directory belongs to this venv: another checkout's venv (its own paths in the
# build files) sharing ~/.cache/torch_extensions made each rebuild the other's op, and a rebuild
# inside the test that limits file sizes failed in the compiler.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.executable).parent.parent / "torch_extensions"))
# Decoding compiles its step where torch.compile works (cplm_dist.model.static_decode): tens of
# seconds a shape on these CPUs. The suite decodes eager; tests/test_decoding.py compiles, asking for it.
os.environ.setdefault("CPLM_DECODE_COMPILE", "0")


def pytest_configure(config):
    scheduling.register(config)  # CPLM_RECORD_DURATIONS: write each test's seconds (tests/scheduling.py)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the quick tier is `-m "not slow"`
def pytest_collection_modifyitems(config, items):
    seconds = scheduling.recorded()
    scheduling.mark_slow(items, seconds)
    if hasattr(config, "workerinput"):  # an xdist worker: the units longest first (tests/scheduling.py)
        scheduling.order_longest_first(items, seconds)


@dataclass
class SmallData:
    root: Path
    tokenizer: Path
    raw: dict  # name -> jsonl path
    prefixes: dict  # name -> dataset prefix (str)
    documents: dict  # name -> list of the raw documents


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A directory `build(path)` fills once for the whole run: under xdist the workers share it (the
    first to ask builds it while the others wait on its lock; a build that failed is tried again)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        path = tmp_path_factory.mktemp(name)
        build(path)
        return path
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent  # shared by the workers of this run
    path, done = root / name, root / f"{name}.built"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> SmallData:
    docs = {
        "code": [p.read_text(encoding="utf-8") for p in stdlib_files()[:40]],
        "copy": list(synthetic_copy_documents(600, seed=3)),
    }

    def build(root: Path) -> None:
        for name, d in docs.items():
            write_jsonl(d, root / f"{name}.jsonl")
        train_sentencepiece(iter_documents([root / f"{name}.jsonl" for name in docs]), root / "tok.model", vocab_size=VOCAB)
        tokenizer = load_tokenizer(root / "tok.model")
        for name in docs:
            write_indexed_dataset(iter_documents([root / f"{name}.jsonl"]), tokenizer, str(root / name), progress=False)

    root = built_once(tmp_path_factory, "small_data", build)
    raw = {name: root / f"{name}.jsonl" for name in docs}
    return SmallData(root, root / "tok.model", raw, {name: str(root / name) for name in docs}, docs)


def _train(args):
    from cplm_dist.train.driver import main

    return main(args)


@pytest.fixture(scope="session")
def trained(small_data, tmp_path_factory):
    """A run of 6 steps on the small corpus (checkpoints at 3 and 6, max_seq_len 128): what the
    evaluation, generation and lm-eval tests read (one run for all the workers)."""
    from tests.spawn import run_ranks
    from tests.test_train import argv

    def build(root: Path) -> None:
        assert run_ranks(_train, 1, args=(argv(small_data, root / "run", "train.train_steps=6", "train.save_interval=3",
                                                "model.max_seq_len=128", "data.seq_length=64"),)) == [0]

    return built_once(tmp_path_factory, "eval", build) / "run"
