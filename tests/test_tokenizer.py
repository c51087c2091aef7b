"""Tokenizer training and the one tokenizer interface (SentencePiece, and Hugging Face from a
local directory); bad tokenizers are refused with one clear line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cplm_dist.config import load_config
from cplm_dist.data.corpora import synthetic_copy_documents
from cplm_dist.data.gpt_data import tokenizer_for
from cplm_dist.data.tokenizer import check_tokenizer_fits_model, load_tokenizer, train_sentencepiece
from cplm_dist.errors import DataError

REPO = Path(__file__).resolve().parent.parent
TRICKY = "def f(x):\n\tif x:  # ünïcødé 漢字 🙂\n        return x\r\n\n\n  trailing   spaces  \n"


def test_sentencepiece_round_trip_is_exact_and_metadata_is_written(small_data):
    tok = load_tokenizer(small_data.tokenizer)
    assert tok.vocab_size == 512 and tok.eod == 2 and tok.pad == 3
    for doc in small_data.documents["code"][:10] + small_data.documents["copy"][:50] + [TRICKY]:
        assert tok.decode(tok.encode(doc)) == doc
    meta = json.loads(small_data.tokenizer.with_suffix(".json").read_text())
    assert meta["vocab_size"] == 512 and meta["eod"] == 2 and meta["sha256"] == tok.fingerprint
    assert meta["training_lines"] > 1000


def test_unigram_and_special_tokens(tmp_path):
    out = tmp_path / "uni.model"
    docs = list(synthetic_copy_documents(300, seed=1))
    meta = train_sentencepiece(docs, out, vocab_size=400, model_type="unigram", special_tokens=["<|sep|>"])
    tok = load_tokenizer(out)
    sep = meta["special_tokens"]["<|sep|>"]
    assert sep == 4 and tok.encode("a<|sep|>b").count(sep) == 1
    assert tok.decode(tok.encode(docs[0])) == docs[0]


def test_huggingface_backend_from_local_directory(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="the huggingface backend needs `tokenizers` (dev extra)")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(list(synthetic_copy_documents(200)), trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<|endoftext|>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<pad>"}))
    tok = load_tokenizer(tmp_path, "huggingface")
    assert (tok.eod, tok.pad, tok.vocab_size) == (1, 2, 400)
    assert tok.decode(tok.encode(TRICKY)) == TRICKY


def test_bad_tokenizers_are_refused(tmp_path, small_data):
    with pytest.raises(DataError, match=r"tokenizer .*nope.model does not exist"):
        load_tokenizer(tmp_path / "nope.model")
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(DataError, match=r"is not a SentencePiece model"):
        load_tokenizer(junk)
    with pytest.raises(DataError, match=r"no tokenizer.json there"):
        load_tokenizer(tmp_path, "huggingface")
    with pytest.raises(DataError, match=r"has 512 ids but model.vocab_size=300: set model.vocab_size=512"):
        check_tokenizer_fits_model(load_tokenizer(small_data.tokenizer), 300)
    cfg = load_config("tiny", [f"data.tokenizer={small_data.tokenizer}", "model.vocab_size=256"])
    with pytest.raises(DataError, match=r"model.vocab_size=256"):
        tokenizer_for(cfg)
    with pytest.raises(DataError, match=r"no text to train the tokenizer on"):
        train_sentencepiece(["", "   "], tmp_path / "empty.model", vocab_size=100)
    assert not (tmp_path / "empty.model").exists()
    pytest.importorskip("tokenizers")
    broken = tmp_path / "hf"
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(DataError, match=r"tokenizer\.json is not a Hugging Face tokenizer.json .*save_pretrained"):
        load_tokenizer(broken, "huggingface")


def test_train_tokenizer_cli(tmp_path, small_data):
    out = tmp_path / "cli.model"
    ok = subprocess.run([sys.executable, str(REPO / "tools/train_tokenizer.py"), "--input", str(small_data.raw["copy"]),
                         "--vocab-size", "400", "--output", str(out)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert out.exists() and "vocabulary of 400" in ok.stdout
    bad = subprocess.run([sys.executable, str(REPO / "tools/train_tokenizer.py"), "--input", str(tmp_path / "missing.jsonl"),
                          "--output", str(tmp_path / "other.model")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [f"error: input {tmp_path / 'missing.jsonl'} does not exist: check the path"]
    # an existing tokenizer is never replaced without --overwrite: datasets made with it would stop matching
    before = out.read_bytes()
    again = subprocess.run([sys.executable, str(REPO / "tools/train_tokenizer.py"), "--input", str(small_data.raw["code"]),
                            "--vocab-size", "300", "--output", str(out)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already exists" in again.stderr and "--overwrite" in again.stderr
    assert out.read_bytes() == before
