"""Tokenizer training and the one tokenizer interface (SentencePiece, and Hugging Face from a
local directory); bad tokenizers are refused with one clear line; `encode_exact` names every
text a tokenizer would not give back."""

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
    # a checkpoint carries it (tokenizer.json and its config), and loads it from the copy
    from cplm_dist.checkpoint import Layout, Manifest, carry_tokenizer, tokenizer_files
    from cplm_dist.checkpoint.loading import _self_contained

    cfg = load_config("tiny", [f"data.tokenizer={tmp_path}", "data.tokenizer_backend=huggingface"])
    step = tmp_path / "run" / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    carry_tokenizer(cfg, step)
    assert sorted(p.name for p in step.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    manifest = Manifest(step, 1, Layout(1, 1, 1, 0), {}, {}, tokenizer_files=tuple(tokenizer_files(cfg)))
    cfg.data.tokenizer = "elsewhere/tokenizer"
    carried = load_tokenizer(_self_contained(cfg, manifest).data.tokenizer, "huggingface")
    assert carried.encode(TRICKY) == tok.encode(TRICKY) and carried.eod == tok.eod


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


def _sentencepiece_without_byte_fallback(small_data, tmp_path) -> Path:
    """The session tokenizer with its byte pieces removed (as --no-byte-fallback trains it): no training."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    model.ParseFromString(small_data.tokenizer.read_bytes())
    model.trainer_spec.byte_fallback = False
    kept = [p for p in model.pieces if p.type != pb.ModelProto.SentencePiece.BYTE]
    del model.pieces[:]
    model.pieces.extend(kept)
    out = tmp_path / "no-byte-fallback.model"
    out.write_bytes(model.SerializeToString())
    return out


def _byte_level_hf(tmp_path, nfkc: bool = False) -> Path:
    """A byte-level Hugging Face tokenizer built from its alphabet (no training), with an
    end-of-document and a padding token, optionally an NFKC normaliser."""
    pytest.importorskip("tokenizers", reason="the huggingface backend needs `tokenizers` (dev extra)")
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    hf = HF(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|endoftext|>", "<pad>"])
    if nfkc:
        hf.normalizer = normalizers.NFKC()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<pad>"}))
    return tmp_path


NOT_GIVEN_BACK = {
    # class: (tokenizer, text, why)
    "sentencepiece-space-marker": ("sentencepiece", "a\u2581b",
        "the tokenizer does not give it back: '\u2581' (U+2581) at character 2 comes back as ' ' (U+0020) "
        "(U+2581 is SentencePiece's space marker: it always decodes as a space)"),
    "lone-surrogate": ("sentencepiece", "ok \udc80",
        "not Unicode text: a lone surrogate U+DC80 at character 4 (half of a UTF-16 pair, e.g. a JSON "
        "\\ud800 escape without its other half)"),
    "no-byte-fallback": ("sentencepiece-no-byte-fallback", "a \u6f22",
        "the tokenizer does not give it back: '\u6f22' (U+6F22) at character 3 comes back as ' ' (U+0020) "
        "(the tokenizer has no piece for it and no byte fallback: it became <unk>)"),
    "hf-end-of-document-as-text": ("huggingface", "a<|endoftext|>b",
        "the tokenizer reads '<|endoftext|>' in the text as its end-of-document id, which would end the document there"),
    "hf-padding-as-text": ("huggingface", "x<pad>",
        "the tokenizer reads '<pad>' in the text as its padding id, which training leaves out of the loss"),
    "hf-lone-surrogate": ("huggingface", "\ud800",
        "not Unicode text: a lone surrogate U+D800 at character 1 (half of a UTF-16 pair, e.g. a JSON "
        "\\ud800 escape without its other half)"),
    "hf-normaliser": ("huggingface-nfkc", "x\ufb01",
        "the tokenizer does not give it back: '\ufb01' (U+FB01) at character 2 comes back as 'f' (U+0066)"),
}


@pytest.mark.parametrize("kind", sorted(NOT_GIVEN_BACK))
def test_encode_exact_says_why_a_text_would_not_come_back(tmp_path, small_data, kind):
    backend, text, why = NOT_GIVEN_BACK[kind]
    if backend == "sentencepiece":
        tok = load_tokenizer(small_data.tokenizer)
    elif backend == "sentencepiece-no-byte-fallback":
        tok = load_tokenizer(_sentencepiece_without_byte_fallback(small_data, tmp_path))
    else:
        tok = load_tokenizer(_byte_level_hf(tmp_path, nfkc=backend.endswith("nfkc")), "huggingface")
    fine = "def f(x): return x  # ok"
    out = tok.encode_exact([fine, text, fine])
    assert out[1] == why
    assert out[0] == out[2] == tok.encode(fine) and tok.decode(out[0]) == fine


SHARD_WORDS = ("zebra", "quokka", "narwhal", "axolotl")


def _shards(root: Path) -> list[Path]:
    """Four shards, each with its own word (what a tokenizer learnt from the first shard would miss)."""
    out = []
    for i, word in enumerate(SHARD_WORDS):
        path = root / f"part-{i:05d}.jsonl"
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps({"text": f"{word} {k} {word}s\n{word}{word}"}) + "\n" for k in range(60)))
        out.append(path)
    return out


def test_the_tokenizer_sample_draws_from_every_shard_under_its_seed(tmp_path):
    """--sample-docs 40 over 4 shards: 10 documents from each (from each one's first 40 records),
    the same ones under the same seed and others under another; the trained vocabulary holds every
    shard's word and the metadata says what each shard gave. --sample-docs 0 reads in order, so a
    --max-lines cut leaves the later shards out."""
    from cplm_dist.data.tokenizer_sample import sample_documents
    from cplm_dist_tools.train_tokenizer import main

    shards = _shards(tmp_path / "parts")
    first, again, other = (sample_documents([tmp_path / "parts"], 40, seed) for seed in (7, 7, 8))
    assert first.per_source == {str(s): 10 for s in shards}
    assert [d.where for d in first.documents] == [d.where for d in again.documents] != [d.where for d in other.documents]
    assert max(int(d.where.rsplit(":", 1)[1]) for d in first.documents) <= 40  # each share from its shard's head
    out = tmp_path / "tok.model"
    assert main(["--input", str(tmp_path / "parts"), "--vocab-size", "320", "--sample-docs", "40", "--seed", "7",
                 "--max-lines", "40", "--output", str(out)]) == 0
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["sample"] == {"documents": 40, "seed": 7, "read_factor": 4, "per_source": {str(s): 10 for s in shards}}
    tok = load_tokenizer(out)
    assert all(tok.sp.piece_to_id(word) != tok.sp.unk_id() for word in SHARD_WORDS)
    in_order = tmp_path / "in-order.model"
    assert main(["--input", str(tmp_path / "parts"), "--vocab-size", "280", "--sample-docs", "0", "--max-lines", "40",
                 "--output", str(in_order)]) == 0
    per_source = json.loads(in_order.with_suffix(".json").read_text())["sample"]["per_source"]
    assert per_source[str(shards[0])] == 20 and per_source[str(shards[3])] == 0  # 2 lines a document


def test_a_smaller_tokenizer_is_allowed_and_its_unused_rows_said_once(small_data, capsys):
    """512 ids under model.vocab_size=1000: one note naming the 488 rows and the fix, once per process;
    none where the difference is Megatron's padding (within 512 rounded up to 128 x tp)."""
    tok = load_tokenizer(small_data.tokenizer)
    for _ in range(2):
        check_tokenizer_fits_model(tok, 1000)
    assert capsys.readouterr().err.splitlines() == [
        f"note: tokenizer {small_data.tokenizer} has 512 ids, model.vocab_size=1000: 488 output rows no target uses; "
        "set model.vocab_size=512 (rounded up to a multiple of 128 is fine)"]
    check_tokenizer_fits_model(tok, 512)
    check_tokenizer_fits_model(tok, 1024, divisible_by=128, tp=8)  # 512 pads to 1024 at tp 8 anyway
    assert capsys.readouterr().err == ""
