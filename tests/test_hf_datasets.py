"""Hugging Face `datasets` inputs for preprocessing and tokenizer training: a save_to_disk Dataset or
DatasetDict given as --input, --hf-dataset of a local repository or a hub name in the local cache
(offline: a connection attempt fails the test). Their tokens equal those of the same texts as JSON
lines; bad values follow the JSON lines rules; anything unreadable is one line, exit 2, nothing
written or replaced."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cplm_dist.data.corpora import write_jsonl
from cplm_dist.data.hf_datasets import BATCH_ROWS, offline_datasets
from cplm_dist.data.indexed_data import dataset_files
from cplm_dist.data.sources import ReadStats, iter_documents
from cplm_dist.data.tokenizer import load_tokenizer
from cplm_dist.errors import DataError
from tests.test_preprocess import EDGE_TEXTS, read_back
from cplm_dist_tools.preprocess_data import main as preprocess_main
from cplm_dist_tools.train_tokenizer import main as train_tokenizer_main

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """A private HF_HOME (datasets' cache and the hub cache, as the variables would set them: both
    are read when datasets is imported) and no network: any connection attempt fails the test."""
    home = tmp_path / "hf_home"
    for var, path in {"HF_HOME": home, "HF_DATASETS_CACHE": home / "datasets", "HF_HUB_CACHE": home / "hub"}.items():
        monkeypatch.setenv(var, str(path))
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "0")  # restored afterwards; the reader sets them itself
    datasets = offline_datasets()
    from huggingface_hub import constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", home / "datasets" / "downloads")
    monkeypatch.setattr(datasets.config, "EXTRACTED_DATASETS_PATH", home / "datasets" / "downloads" / "extracted")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    attempts = []

    def refuse(self, address, *args):
        attempts.append(address)
        raise OSError(f"a test tried to connect to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    yield home
    assert attempts == [], f"the network was touched: {attempts}"


def texts_for(small_data, n=200):
    """More rows than one batch: copy documents and every short edge-case class of text."""
    texts = small_data.documents["copy"][:n] + [t for k in sorted(EDGE_TEXTS) for t in EDGE_TEXTS[k] if len(t) < 1000]
    assert len(texts) > BATCH_ROWS
    return texts


def preprocess(small_data, out, *inputs, expect=0):
    rc = preprocess_main([*map(str, inputs), "--tokenizer", str(small_data.tokenizer), "--output-prefix", str(out),
                          "--no-progress"])
    assert rc == expect
    return rc


def assert_same_tokens(a, b):
    for ext in ("bin", "idx"):
        assert Path(f"{a}.{ext}").read_bytes() == Path(f"{b}.{ext}").read_bytes(), ext


def test_saved_dataset_writes_the_tokens_of_the_same_jsonl(tmp_path, small_data, hf_home, capsys):
    """--input of a save_to_disk directory (3 shards, more rows than a batch, 2 workers): the same
    .bin/.idx bytes as the texts as JSON lines; its JSON files are not read as records."""
    import datasets

    texts = texts_for(small_data)
    write_jsonl(texts, tmp_path / "t.jsonl")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"id": list(range(len(texts))), "text": texts}).save_to_disk(str(saved), num_shards=3)
    preprocess(small_data, tmp_path / "j", "--input", tmp_path / "t.jsonl")
    preprocess(small_data, tmp_path / "d", "--input", saved, "--workers", "2")
    assert f"{len(texts)} documents" in capsys.readouterr().out
    assert_same_tokens(tmp_path / "j", tmp_path / "d")
    assert read_back(tmp_path / "d", load_tokenizer(small_data.tokenizer)) == texts
    assert json.loads(dataset_files(tmp_path / "d")["meta"].read_text())["sources"] == [str(saved)]
    docs = list(iter_documents([saved]))
    assert docs == texts and docs[0].where == f"{saved}: row 1" and docs[-1].where == f"{saved}: row {len(texts)}"


def test_dataset_dict_split_and_a_dataset_inside_a_directory(tmp_path, small_data, capsys):
    """A DatasetDict's split by --split; without it, or with a split it lacks: one line listing its
    splits, nothing written. A saved dataset inside an --input directory is one input, in path order."""
    import datasets

    docs = small_data.documents["copy"]
    dd = tmp_path / "corpus" / "b_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:20]}),
                          "validation": datasets.Dataset.from_dict({"text": docs[20:25]})}).save_to_disk(str(dd))
    preprocess(small_data, tmp_path / "v", "--input", dd, "--split", "validation")
    assert read_back(tmp_path / "v", load_tokenizer(small_data.tokenizer)) == docs[20:25]
    capsys.readouterr()
    for extra, line in [([], f"error: {dd} has splits train, validation: choose one with --split"),
                        (["--split", "test"],
                         f"error: {dd} has no split 'test' (splits: train, validation): choose one with --split")]:
        preprocess(small_data, tmp_path / "x", "--input", dd, *extra, expect=2)
        assert capsys.readouterr().err.splitlines() == [line]
    assert not list(tmp_path.glob("x*"))
    write_jsonl(docs[30:32], tmp_path / "corpus" / "a.jsonl")
    write_jsonl(docs[32:33], tmp_path / "corpus" / "c" / "d.jsonl")
    got = list(iter_documents([tmp_path / "corpus"], split="train"))
    assert got == docs[30:32] + docs[:20] + docs[32:33]
    assert got[2].where == f"{dd} (split train): row 1"


def test_bad_values_follow_the_jsonl_rules(tmp_path):
    """Null or non-string values stop naming the row, or are skipped and counted; a missing column
    names the columns there; an empty dataset is like an empty file. The same policy as JSON lines."""
    import datasets

    def saved(name, columns):
        datasets.Dataset.from_dict(columns).save_to_disk(str(tmp_path / name))
        return tmp_path / name

    tail = "; fix the input or pass --on-bad-record skip to skip and count such records"
    null, number = saved("null", {"text": ["before", None, "after"]}), saved("num", {"text": [1, 2]})
    other, empty = saved("other", {"content": ["x"], "id": [1]}), saved("empty", {"text": []})
    cases = [(null, f"{null}: row 2: column 'text' is null, not a string"),
             (number, f"{number}: row 1: column 'text' is a number, not a string"),
             (other, f"{other}: no column 'text' (columns ['content', 'id']); choose one with --text-key"),
             (empty, f"{empty}: the dataset has no rows")]
    for path, message in cases:
        with pytest.raises(DataError) as stopped:
            list(iter_documents([path]))
        assert str(stopped.value) == message + tail
    jsonl = tmp_path / "null.jsonl"
    jsonl.write_text('{"text": "before"}\n{"text": null}\n{"text": "after"}\n')
    with pytest.raises(DataError, match=rf"^{jsonl}:2: field 'text' is null, not a string; fix the input"):
        list(iter_documents([jsonl]))
    stats = ReadStats()
    assert list(iter_documents([null, number, other, empty], on_bad="skip", stats=stats)) == ["before", "after"]
    assert stats.skipped == {"rows whose 'text' is not a string": 3, "datasets without a 'text' column": 1,
                             "empty datasets": 1}
    assert list(iter_documents([other], text_key="content")) == ["x"]


def local_repo(root: Path, docs) -> Path:
    """A dataset repository as on the hub: two configs in the README's YAML, jsonl data files."""
    root.mkdir(parents=True)
    write_jsonl(docs[:40], root / "prose" / "train-00000.jsonl")
    write_jsonl(docs[40:80], root / "prose" / "train-00001.jsonl")
    write_jsonl(docs[80:90], root / "prose" / "test-00000.jsonl")
    write_jsonl(["def f():\n    return 1\n"], root / "code" / "train.jsonl")
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: prose\n  data_files:\n  - split: train\n    path: prose/train-*.jsonl\n"
        "  - split: test\n    path: prose/test-*.jsonl\n- config_name: code\n  data_files:\n  - split: train\n"
        "    path: code/train.jsonl\n---\n# a tiny corpus\n")
    return root


def test_hf_dataset_local_repository_and_data_file_folder(tmp_path, small_data, hf_home, capsys):
    """--hf-dataset DIR --hf-config C --split S as load_dataset takes it; a plain folder of jsonl
    files; tokens equal to the same texts as JSON lines."""
    docs = small_data.documents["copy"]
    repo = local_repo(tmp_path / "repo", docs)
    write_jsonl(docs[:80], tmp_path / "train.jsonl")
    preprocess(small_data, tmp_path / "j", "--input", tmp_path / "train.jsonl")
    preprocess(small_data, tmp_path / "r", "--hf-dataset", repo, "--hf-config", "prose", "--split", "train")
    assert_same_tokens(tmp_path / "j", tmp_path / "r")
    folder = tmp_path / "folder"
    shutil.copytree(repo / "prose", folder)
    got = list(iter_documents(resolve(folder, None, "test")))
    assert got == docs[80:90] and got[0].where == f"hf:{folder} (split test): row 1"
    capsys.readouterr()
    preprocess(small_data, tmp_path / "x", "--hf-dataset", repo, "--split", "train", expect=2)
    assert "Config name is missing" in capsys.readouterr().err
    assert not list(tmp_path.glob("x*")) and (hf_home / "datasets").is_dir()


def resolve(name, config, split):
    from cplm_dist.data.sources import resolve_inputs

    return resolve_inputs([], split, str(name), config)


def hub_snapshot(hub_cache: Path, repo_id: str, files: Path) -> None:
    """`files` as `hf download` leaves a dataset repository in the hub cache."""
    entry = hub_cache / f"datasets--{repo_id.replace('/', '--')}"
    shutil.copytree(files, entry / "snapshots" / "0123abc")
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("0123abc")


def test_hub_names_are_read_from_the_local_cache_offline(tmp_path, small_data, hf_home, monkeypatch, capsys):
    """A name load_dataset prepared once (here from a local repository, offline) and a snapshot in
    the hub cache are read by name with the hub offline; a name in neither: one line saying how to
    get it there. The CLI sets the offline variables before datasets is imported (a fresh process)."""
    docs = small_data.documents["copy"]
    repo = local_repo(tmp_path / "src" / "cplm_tiny_corpus", docs)
    expected = docs[80:90]
    assert list(iter_documents(resolve(repo, "prose", "test"))) == expected  # prepares the cache
    monkeypatch.chdir(tmp_path)  # no directory of that name here: a hub name
    assert list(iter_documents(resolve("cplm_tiny_corpus", "prose", "test"))) == expected
    cached = hf_home / "datasets" / "cplm_tiny_corpus"
    cached.rename(hf_home / "datasets" / "someone___cplm_tiny_corpus")  # the layout of a hub download
    got = list(iter_documents(resolve("someone/cplm_tiny_corpus", "prose", "test")))
    assert got == expected and got[0].where == "hf:someone/cplm_tiny_corpus (config prose, split test): row 1"
    hub_snapshot(hf_home / "hub", "someone/snapshot_only", repo)
    assert list(iter_documents(resolve("someone/snapshot_only", "prose", "test"))) == expected
    capsys.readouterr()
    preprocess(small_data, tmp_path / "x", "--hf-dataset", "someone/missing", "--split", "train", expect=2)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: dataset 'someone/missing' is not in the local cache (")
    assert "datasets.load_dataset('someone/missing')" in err[0] and "hf download someone/missing" in err[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"HF_HOME": str(hf_home)}
    run = subprocess.run([sys.executable, str(REPO / "tools/train_tokenizer.py"), "--hf-dataset",
                          "someone/snapshot_only", "--hf-config", "prose", "--split", "train", "--vocab-size", "400",
                          "--output", str(tmp_path / "tok.model")],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert run.returncode == 0 and "from 80 documents" in run.stdout, run.stderr


def test_train_tokenizer_on_a_saved_dataset_equals_jsonl(tmp_path, small_data):
    """The same vocabulary, piece for piece and score for score, as from the texts as JSON lines."""
    import datasets

    docs = small_data.documents["copy"][:150]
    write_jsonl(docs, tmp_path / "t.jsonl")
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "saved"))
    common = ["--vocab-size", "400", "--model-type", "unigram"]
    for source, model in ((tmp_path / "t.jsonl", "j.model"), (tmp_path / "saved", "d.model")):
        assert train_tokenizer_main(["--input", str(source), "--output", str(tmp_path / model), *common]) == 0
    import sentencepiece as spm

    def pieces(path):  # the model file also records its trainer's temporary input path
        sp = spm.SentencePieceProcessor(model_file=str(path))
        return [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]

    assert pieces(tmp_path / "j.model") == pieces(tmp_path / "d.model")


def test_unreadable_inputs_are_one_line_and_replace_nothing(tmp_path, small_data, hf_home, capsys):
    """Not a dataset, an empty directory, a damaged save (truncated Arrow, half a save, a broken
    dataset_dict.json, a listed split gone), flags that do not fit: exit 2, one line, and the
    dataset already at the output prefix is left as it was (--overwrite)."""
    import datasets

    good = tmp_path / "good"
    datasets.Dataset.from_dict({"text": small_data.documents["copy"][:50]}).save_to_disk(str(good))
    datasets.DatasetDict({"train": datasets.load_from_disk(str(good))}).save_to_disk(str(tmp_path / "dd"))
    preprocess(small_data, tmp_path / "out", "--input", good)
    before = {k: f.read_bytes() for k, f in dataset_files(tmp_path / "out").items()}

    def damaged(name, damage):
        shutil.copytree(good, tmp_path / name)
        damage(tmp_path / name)
        return tmp_path / name

    arrow = "data-00000-of-00001.arrow"
    truncated = damaged("truncated", lambda p: os.truncate(p / arrow, os.path.getsize(p / arrow) // 2))
    half = damaged("half", lambda p: (p / "state.json").unlink())
    broken_dict = shutil.copytree(tmp_path / "dd", tmp_path / "broken_dict")
    (broken_dict / "dataset_dict.json").write_text("{")
    gone = shutil.copytree(tmp_path / "dd", tmp_path / "gone")
    shutil.rmtree(gone / "train")
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "weights.bin").write_bytes(b"\0" * 8)
    cases = [
        (["--input", tmp_path / "empty"], f"input directory {tmp_path / 'empty'} holds no files"),
        (["--hf-dataset", tmp_path / "empty", "--split", "train"], "could not be opened (EmptyDatasetError"),
        (["--hf-dataset", tmp_path / "junk", "--split", "train"], "could not be opened (DataFilesNotFoundError"),
        (["--hf-dataset", tmp_path / "nowhere", "--split", "train"], "no such directory (and not a hub name"),
        (["--input", truncated], f"{truncated} could not be opened ("),
        (["--input", half], f"{half} holds dataset_info.json but no state.json: not a complete datasets save_to_disk"),
        (["--input", broken_dict, "--split", "train"], "dataset_dict.json cannot be read (JSONDecodeError"),
        (["--input", gone, "--split", "train"], f"{gone} (split train) could not be opened (FileNotFoundError"),
        (["--input", good, "--split", "train"], "--split train: no input has splits"),
        (["--input", good, "--hf-config", "c"], "--hf-config c needs --hf-dataset"),
        ([], "no input: give --input"),
    ]
    for argv, fragment in cases:
        capsys.readouterr()
        preprocess(small_data, tmp_path / "out", *argv, "--overwrite", expect=2)
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and fragment in err[0], (argv, err)
        assert {k: f.read_bytes() for k, f in dataset_files(tmp_path / "out").items()} == before, argv
    assert sorted(p.name for p in tmp_path.glob("out*")) == ["out.bin", "out.idx", "out.meta.json"]
