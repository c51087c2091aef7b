"""The tokenizer files of an export: tokenizer.json and tokenizer_config.json that make
`AutoTokenizer.from_pretrained(DIR)` (no remote code) encode as training did, whatever model_type
config.json names (Llama, GPT-2, Qwen3 or our remote classes).

Without them transformers picks the tokenizer from config.json's model_type: a Qwen3 export gets a
Qwen2Tokenizer (byte-level BPE, other ids, eos 4096 outside a 4096-entry vocabulary), a GPT-2 one
a GPT2Tokenizer that finds no vocab.json. So tokenizer_config.json names the generic fast class
(`tokenizer_class: PreTrainedTokenizerFast`, transformers 5's TokenizersBackend), which reads
tokenizer.json as it is:

- SentencePiece (data.tokenizer_backend=sentencepiece): tokenizer.json is transformers' own
  conversion of the .model file (convert_slow_tokenizer.SpmConverter.build_tokenizer_from_spm_proto,
  which follows the model's normaliser, byte fallback and piece scores, the conversion transformers
  itself runs on a lone tokenizer.model); the control pieces (<unk>, <s>, <eod>, <pad>) are special
  tokens. tokenizer.model is copied beside it for SentencePiece users.
- Hugging Face (tokenizer.json): the run's file with its post-processor taken out, since training
  encoded without special tokens (a Llama-3 style file would otherwise put a bos before every text).

Special tokens: eos is the end-of-document token training ended every document with, pad the
tokenizer's pad (where it has one), and bos the end-of-document token too (GPT-2's convention): a
training document begins after an end-of-document, never after SentencePiece's <s>, so what
lm-eval's HFLM puts before a text with no context (its prefix token, the bos where there is one)
and what `generate()` starts an empty prompt with are what our own evaluation uses. No bos or eos
is added to a text (add_bos_token / add_eos_token false), and decoding keeps spaces as they are
(clean_up_tokenization_spaces false), so code comes back exactly. A SentencePiece model never makes
a control piece from text ("<eod>" written out is five characters), so its export sets
split_special_tokens (transformers then matches no special token in text either); the `tokenizers`
library, which a Hugging Face run's data went through, does match them, so that export does not.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from cplm_dist.data.tokenizer import load_tokenizer

TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # transformers 4's name; 5 maps it to TokenizersBackend
SP_UNKNOWN, SP_CONTROL, SP_USER_DEFINED = 2, 3, 4  # sentencepiece_model.proto's piece types


def write_tokenizer_files(files: dict[str, Path], backend: str, directory: Path, max_length: int) -> dict[str, int]:
    """tokenizer.json and tokenizer_config.json (and a SentencePiece model's tokenizer.model) into
    `directory`, from the run's tokenizer `files` ({name: file}, checkpoint.tokenizer_files);
    returns the {bos,eos,pad}_token_id that config.json and generation_config.json carry."""
    main = next(iter(files.values()))
    tok = load_tokenizer(main, backend)
    if backend == "sentencepiece":
        shutil.copy2(main, directory / "tokenizer.model")
        fast = sentencepiece_to_fast(main)
    else:
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(main))
        fast.post_processor = None  # training's ids: no special tokens around a text
    fast.save(str(directory / "tokenizer.json"))
    special = {"bos_token": tok.piece(tok.eod), "eos_token": tok.piece(tok.eod)}
    if tok.pad >= 0:
        special["pad_token"] = tok.piece(tok.pad)
    if backend == "sentencepiece" and tok.sp.unk_id() >= 0:
        special["unk_token"] = tok.piece(tok.sp.unk_id())
    config = {"tokenizer_class": TOKENIZER_CLASS, **special, "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "split_special_tokens": backend == "sentencepiece",
              "model_max_length": max_length}
    if backend == "huggingface":  # the run's chat template, where its tokenizer has one
        source = main.parent / "tokenizer_config.json"
        template = json.loads(source.read_text()).get("chat_template") if source.is_file() else None
        if template:
            config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids = {"bos_token_id": tok.eod, "eos_token_id": tok.eod, "pad_token_id": tok.pad}
    return {k: v for k, v in ids.items() if v is not None and v >= 0}


def sentencepiece_to_fast(model_file: Path):
    """A `tokenizers.Tokenizer` that encodes as the SentencePiece model at `model_file` does:
    transformers' converter, its unknown and control pieces added as special tokens (skipped by
    decode(skip_special_tokens=True))."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

    proto = SentencePieceExtractor(str(model_file)).proto
    vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    fast = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    control = [piece.piece for piece in proto.pieces if piece.type in (SP_UNKNOWN, SP_CONTROL)]
    user = [piece.piece for piece in proto.pieces if piece.type == SP_USER_DEFINED]
    fast.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in control])
    if user:  # SentencePiece emits them whole from text: tokens, not special ones
        fast.add_tokens([AddedToken(p, special=False, normalized=False) for p in user])
    return fast
