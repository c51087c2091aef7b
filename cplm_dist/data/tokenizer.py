"""The one tokenizer interface used everywhere: encode/decode, eod, pad, vocab size.

    tok = load_tokenizer("data/quickstart/tokenizer.model")                 # SentencePiece
    tok = load_tokenizer("path/to/hf-tokenizer-dir", backend="huggingface") # tokenizer.json

It also carries what megatron-core's datasets ask of a tokenizer (`eod`, `pad`, `vocab_size`,
`unique_identifiers` for their index cache), so it is handed to GPTDataset as is.
`train_sentencepiece` trains the SentencePiece model that tools/train_tokenizer.py ships.

`encode_exact` is what preprocessing uses: each text's ids only if decoding them gives the text
back exactly and they hold no end-of-document or padding id, else the reason. Texts that no
tokenizer here reproduces: ones that are not Unicode (a lone surrogate); with SentencePiece, any
text holding U+2581 '▁' (its space marker, which always decodes as a space); with a tokenizer
without byte fallback, characters it has no piece for; with a Hugging Face tokenizer, whatever its
normaliser changes, and its end-of-document or padding token written out as text.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterable, Iterator

from cplm_dist.config.notes import say_once
from cplm_dist.errors import DataError
from cplm_dist.files import sha256_file

# SentencePiece ids we fix at training time (and document in the metadata file).
UNK_ID, BOS_ID, EOD_ID, PAD_ID = 0, 1, 2, 3
SPACE_MARKER = "\u2581"  # SentencePiece writes spaces as this; its decoder turns every one back into a space


def _char(c: str) -> str:
    return f"{c!r} (U+{ord(c):04X})"


def not_unicode(text: str, e: UnicodeEncodeError) -> str:
    """Why `text`, which failed to encode as UTF-8 with `e`, is no text at all."""
    return (f"not Unicode text: a lone surrogate U+{ord(text[e.start]):04X} at character {e.start + 1} "
            "(half of a UTF-16 pair, e.g. a JSON \\ud800 escape without its other half)")


def _first_difference(text: str, back: str) -> tuple[int, str]:
    """(index, description) of the first character where `back` differs from `text`."""
    i = next((k for k, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
    want = _char(text[i]) if i < len(text) else "the end of the text"
    got = _char(back[i]) if i < len(back) else "nothing"
    return i, f"{want} at character {i + 1} comes back as {got}"


class Tokenizer:
    """Base: subclasses set vocab_size, eod, pad and implement encode/decode."""

    backend: str
    path: Path
    vocab_size: int
    eod: int
    pad: int
    threads: int = -1  # threads one batch is encoded / decoded on (SentencePiece; -1: every core); worker processes use 1

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode_batch(self, ids: list[list[int]]) -> list[str]:
        return [self.decode(i) for i in ids]

    def piece(self, token_id: int) -> str:
        raise NotImplementedError

    def encode_exact(self, texts: list[str]) -> list[list[int] | str]:
        """Each text's ids, or (a str) why they would not reproduce it: it is not Unicode, the ids
        hold the end-of-document or padding id (the text spells out that token), or decoding them
        does not give the text back exactly."""
        out: list[list[int] | str] = []
        todo: list[int] = []
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                out.append(not_unicode(text, e))
                continue
            out.append([])
            todo.append(i)
        encoded = self.encode_batch([texts[i] for i in todo])
        reserved = self.reserved_ids_from_text()
        for i, ids, back in zip(todo, encoded, self.decode_batch(encoded)):
            text = texts[i]
            hit = reserved.intersection(ids) if reserved else ()
            if hit:
                token = min(hit)
                role = ("end-of-document id, which would end the document there" if token == self.eod
                        else "padding id, which training leaves out of the loss")
                out[i] = f"the tokenizer reads {self.piece(token)!r} in the text as its {role}"
            elif back != text:
                at, what = _first_difference(text, back)
                out[i] = f"the tokenizer does not give it back: {what}{self._why(text, ids, at)}"
            else:
                out[i] = ids
        return out

    def reserved_ids_from_text(self) -> set[int]:
        """The end-of-document and padding ids, where some text can encode to them."""
        return {self.eod, self.pad} - {-1}

    def _why(self, text: str, ids: list[int], at: int) -> str:
        """A backend's explanation of a failed round trip at character `at` ('' if none)."""
        return ""

    @property
    def eos(self) -> int:  # megatron's datasets look for either name
        return self.eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What identifies this tokenizer in megatron's dataset-index cache key."""
        return OrderedDict(backend=self.backend, path=str(self.path), sha256=self.fingerprint, vocab_size=self.vocab_size)

    @property
    def fingerprint(self) -> str:
        if not hasattr(self, "_fingerprint"):
            target = self.path if self.path.is_file() else self.path / "tokenizer.json"
            self._fingerprint = sha256_file(target)
        return self._fingerprint

    def spec(self) -> tuple[str, str]:
        """(path, backend): enough to rebuild this tokenizer in a worker process."""
        return str(self.path), self.backend


class SentencePieceTokenizer(Tokenizer):
    backend = "sentencepiece"

    def __init__(self, path: Path):
        import sentencepiece as spm

        self.path = path
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise DataError(f"tokenizer {path} is not a SentencePiece model ({str(e).splitlines()[0]})") from None
        self.vocab_size = self.sp.get_piece_size()
        self.eod = self.sp.eos_id()
        if self.eod < 0:
            raise DataError(f"tokenizer {path} has no end-of-document (eos) id: retrain it with tools/train_tokenizer.py")
        self.pad = self.sp.pad_id()  # -1 when the model has none: no id is then masked as padding

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, num_threads=self.threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def decode_batch(self, ids: list[list[int]]) -> list[str]:
        return self.sp.decode(ids, num_threads=self.threads) if ids else []

    def piece(self, token_id: int) -> str:
        return self.sp.id_to_piece(token_id)

    def reserved_ids_from_text(self) -> set[int]:
        return {i for i in super().reserved_ids_from_text() if not self.sp.is_control(i)}  # control: never from text

    def _why(self, text: str, ids: list[int], at: int) -> str:
        if at < len(text) and text[at] == SPACE_MARKER:
            return " (U+2581 is SentencePiece's space marker: it always decodes as a space)"
        if self.sp.unk_id() in ids:
            return f" (the tokenizer has no piece for it and no byte fallback: it became {self.piece(self.sp.unk_id())})"
        return ""


class HuggingFaceTokenizer(Tokenizer):
    """A local Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json), read
    with the `tokenizers` library; nothing is fetched from a hub."""

    backend = "huggingface"

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise DataError("data.tokenizer_backend=huggingface needs the `tokenizers` package: pip install tokenizers") from None
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"tokenizer {path}: no tokenizer.json there (give a local Hugging Face tokenizer directory)")
        self.path = path
        try:
            self.tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises a bare Exception on a malformed file
            raise DataError(f"tokenizer {file} is not a Hugging Face tokenizer.json ({str(e).splitlines()[0][:120]}): "
                            "point data.tokenizer at a directory written by save_pretrained") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        config = {}
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if (file.parent / name).is_file():
                config.update(json.loads((file.parent / name).read_text()))

        def token_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return self.tok.token_to_id(value) if isinstance(value, str) else None

        eod = token_id("eos_token")
        if eod is None:
            raise DataError(f"tokenizer {path}: no eos_token in tokenizer_config.json to end documents with")
        self.eod = eod
        pad = token_id("pad_token")
        self.pad = -1 if pad is None else pad

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def decode_batch(self, ids: list[list[int]]) -> list[str]:
        return self.tok.decode_batch(ids, skip_special_tokens=False) if ids else []

    def piece(self, token_id: int) -> str:
        return self.tok.id_to_token(token_id)


def load_tokenizer(path: str | os.PathLike, backend: str = "sentencepiece") -> Tokenizer:
    p = Path(path)
    if not p.exists():
        raise DataError(f"tokenizer {p} does not exist: train one with tools/train_tokenizer.py or fix data.tokenizer")
    if backend == "sentencepiece":
        if p.is_dir() or p.stat().st_size == 0:
            raise DataError(f"tokenizer {p} is not a SentencePiece .model file")
        return SentencePieceTokenizer(p)
    if backend == "huggingface":
        return HuggingFaceTokenizer(p)
    raise DataError(f"tokenizer backend {backend!r} is not one of ['sentencepiece', 'huggingface']")


def check_tokenizer_fits_model(tokenizer: Tokenizer, model_vocab_size: int, divisible_by: int = 128, tp: int = 1) -> None:
    """Refuse, before training starts, a tokenizer that emits ids the model has no row for; say
    once (cplm_dist.config.notes) what a smaller tokenizer leaves unused. No note where the
    difference is Megatron's own padding: model.vocab_size within the tokenizer's size rounded up to
    a multiple of `divisible_by` x `tp` (model.make_vocab_size_divisible_by x parallel.tp) pads to
    the same rows as the tokenizer's size would."""
    size = tokenizer.vocab_size
    if size > model_vocab_size:
        raise DataError(
            f"tokenizer {tokenizer.path} has {size} ids but model.vocab_size={model_vocab_size}: "
            f"set model.vocab_size={size} (or use the tokenizer the model was made for)"
        )
    unit = max(1, divisible_by) * max(1, tp)
    if model_vocab_size > -(-size // unit) * unit:
        say_once(f"tokenizer {tokenizer.path} has {size} ids, model.vocab_size={model_vocab_size}: "
                 f"{model_vocab_size - size} output rows no target uses; set model.vocab_size={size} "
                 f"(rounded up to a multiple of {unit} is fine)")


# ---------------------------------------------------------------------------------------------
# Training a SentencePiece model
# ---------------------------------------------------------------------------------------------


def _lines(documents: Iterable[str], max_lines: int) -> Iterator[str]:
    """SentencePiece learns from lines: documents are split at newlines (newlines themselves are
    encoded through byte fallback); empty lines carry nothing to learn."""
    n = 0
    for doc in documents:
        for line in doc.split("\n"):
            if line.strip():
                yield line
                n += 1
                if n >= max_lines:
                    return


def train_sentencepiece(
    documents: Iterable[str],
    out_path: str | os.PathLike,
    *,
    vocab_size: int,
    model_type: str = "bpe",
    special_tokens: Iterable[str] = (),
    byte_fallback: bool = True,
    max_lines: int = 2_000_000, character_coverage: float = 0.9999, num_threads: int | None = None,
    sources: Iterable[str] = (), sample: Callable[[], dict] | None = None,
) -> dict:
    """Train `out_path` (a .model file) and write `<out_path minus .model>.json` metadata beside it.

    Text is kept verbatim (identity normalisation, no whitespace folding, whitespace-only
    pieces allowed), so code round-trips exactly; ids: unk 0, bos 1, eod 2, pad 3, then the
    extra special tokens (always single pieces). The files appear only when complete. `sample()`,
    called once the lines are read, is the metadata's "sample" (cplm_dist.data.tokenizer_sample)."""
    import sentencepiece as spm

    out_path = Path(out_path)
    if out_path.suffix != ".model":
        raise DataError(f"tokenizer output {out_path} must end in .model")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    meta_path = out_path.with_suffix(".json")
    with tempfile.TemporaryDirectory(dir=out_path.parent, prefix=".tokenizer-tmp-") as tmp:
        # Stream the lines to disk first: reading errors surface here, not inside SentencePiece.
        lines_path, n_lines = os.path.join(tmp, "lines.txt"), 0
        with open(lines_path, "w", encoding="utf-8") as f:
            for line in _lines(documents, max_lines):
                f.write(line.replace("\r", " ") + "\n")
                n_lines += 1
        if n_lines == 0:
            raise DataError("no text to train the tokenizer on: the inputs hold no non-empty lines")
        prefix = os.path.join(tmp, "sp")
        try:
            spm.SentencePieceTrainer.train(
                input=lines_path,
                input_sentence_size=0,  # all lines, in order: deterministic
                model_prefix=prefix,
                vocab_size=vocab_size,
                model_type=model_type,
                byte_fallback=byte_fallback,
                character_coverage=character_coverage,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                add_dummy_prefix=False,
                allow_whitespace_only_pieces=True,
                split_digits=True,
                max_sentence_length=1 << 16,
                unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOD_ID, pad_id=PAD_ID,
                unk_piece="<unk>", bos_piece="<s>", eos_piece="<eod>", pad_piece="<pad>",
                user_defined_symbols=list(special_tokens),
                num_threads=num_threads or os.cpu_count() or 1,
                minloglevel=2,
            )
        except RuntimeError as e:
            raise DataError(f"SentencePiece training failed: {str(e).splitlines()[0]}") from None
        tok = SentencePieceTokenizer(Path(prefix + ".model"))
        meta = {
            "backend": "sentencepiece",
            "model_type": model_type,
            "vocab_size": tok.vocab_size,
            "eod": tok.eod,
            "pad": tok.pad,
            "bos": BOS_ID,
            "unk": UNK_ID,
            "special_tokens": {t: tok.sp.piece_to_id(t) for t in special_tokens},
            "byte_fallback": byte_fallback,
            "training_lines": n_lines,
            "sources": list(sources),
            "sample": sample() if sample is not None else None,
            "sha256": sha256_file(Path(prefix + ".model")),
            "sentencepiece_version": spm.__version__,
        }
        Path(prefix + ".json").write_text(json.dumps(meta, indent=2) + "\n")
        # metadata first, the model last: a present .model always has its metadata beside it
        os.replace(prefix + ".json", meta_path)
        os.replace(prefix + ".model", out_path)
    return meta
