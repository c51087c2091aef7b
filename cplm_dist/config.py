"""One typed config tree, loaded from YAML, overridden from the command line, validated at load.

    cfg = load_config("configs/models/tiny.yaml", ["model.num_layers=4", "copy.mix=joint"])

A YAML file may start from another with `base: <path or name>` (resolved next to the file, then
in the shipped `configs/`); its own keys override the base's. Every error is a `ConfigError`
whose message is one line naming the field, the value and what would be valid; entry points turn
it into exit code 2.

The tree grows with the project (data, train, ... sections join as they land); each section is a
dataclass and `Config` is their root. Parallel sizes that depend on the launch (dp = world / tp)
are checked when the world is known, in `cplm_dist.parallel`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml

from cplm_dist.errors import ConfigError

# The shipped configs: the repository's configs/ in a checkout (and an editable install); an
# installed wheel carries them as package data in cplm_dist/configs.
_PACKAGE_DIR = Path(__file__).resolve().parent
CONFIG_DIR = next((d for d in (_PACKAGE_DIR / "configs", _PACKAGE_DIR.parent / "configs") if d.is_dir()),
                  _PACKAGE_DIR.parent / "configs")

FLOAT32_MAX = 3.4028234663852886e38  # parameters and optimizer states are float32: larger numbers cannot work
MixMode = Literal["gate", "joint", "sentinel"]
PasteMode = Literal["next", "self"]
CopyImpl = Literal["auto", "chunked", "dense", "flex"]
OptimImpl = Literal["auto", "fused", "foreach"]
LossImpl = Literal["dense", "chunked"]
TokenizerBackend = Literal["sentencepiece", "huggingface"]
Schedule = Literal["cosine", "wsd", "constant"]
Precision = Literal["fp32", "bf16"]
GradAccumDtype = Literal["fp32", "bf16"]
Arch = Literal["llama", "gpt2"]


# ---------------------------------------------------------------------------------------------
# The tree
# ---------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Llama-style decoder shapes (the size table in docs/copy_head.md)."""

    name: str = "tiny"
    # the backbone: llama (RMSNorm, SwiGLU, RoPE, no biases) or gpt2 (LayerNorm with bias, GELU MLP,
    # learned absolute positions, biases); the copy head and the loss are the same for both
    arch: Arch = "llama"
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 8
    num_kv_heads: int = 4
    ffn_hidden_size: int = 256
    vocab_size: int = 512
    max_seq_len: int = 2048
    tie_embeddings: bool = True
    init_from: str | None = None  # a local HF LlamaForCausalLM directory: a fresh run starts from its weights (cplm_dist.hf_llama)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Output projections (attention out, MLP down) start at init_std / sqrt(2 * num_layers).
    scaled_init: bool = True
    # Megatron pads the vocabulary to a multiple of this times tp; padded ids never get mass.
    make_vocab_size_divisible_by: int = 128

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class CopyConfig:
    """The Copy-Paste head (docs/copy_head.md)."""

    enabled: bool = True
    num_heads: int = 1  # H_c
    head_dim: int = 64  # d_c
    paste: PasteMode = "next"
    mix: MixMode = "gate"
    rope: bool = False  # rotary position on the copy q/k
    init_std: float = 0.02
    gate_bias_init: float = 0.0  # gate mix: sigmoid(0) = half the mass to the LM head at init
    # auto: flex (fused FlexAttention kernels) training on CUDA, chunked elsewhere; chunked: scores
    # recomputed in backward per row block; dense: the reference (docs/copy_head.md)
    impl: CopyImpl = "auto"
    chunk_size: int = 256  # query rows per block of the chunked path


@dataclass
class LossConfig:
    """How the LM side of the loss is computed (cplm_dist.vocab_parallel); the value is the same."""

    impl: LossImpl = "dense"  # chunked: logits made and differentiated `chunk_rows` rows at a time, none kept
    chunk_rows: int = 1024  # rows (tokens) per block of the chunked path (1024 x 49152 fp32: 201 MB)


@dataclass
class BlendEntry:
    """One Megatron indexed dataset (path prefix of its .bin/.idx) and its sampling weight."""

    path: str
    weight: float = 1.0


@dataclass
class DataConfig:
    """Training data: a weighted blend of indexed datasets read through megatron-core's
    GPTDataset / BlendedMegatronDatasetBuilder (cplm_dist.data)."""

    blend: list[BlendEntry] = field(default_factory=list)
    tokenizer: str | None = None  # a SentencePiece .model, or a Hugging Face tokenizer directory
    tokenizer_backend: TokenizerBackend = "sentencepiece"
    split: str = "98,2,0"  # train, valid, test weights of every dataset in the blend (Megatron's)
    seq_length: int = 512
    seed: int = 1234  # data order only, so matched runs can differ in init but not in data
    cache_dir: str | None = None  # megatron's index cache; default: <first dataset's dir>/index-cache
    eod_mask_loss: bool = False  # do not train on predicting the token after an end-of-document
    num_workers: int = 2  # DataLoader worker processes per rank


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel size; dp = world_size / tp
    # Megatron sequence parallelism (tp > 1): norms, residuals and the copy head's queries on
    # sequence shards between the tp regions (docs/parallelism.md); a no-op at tp = 1
    sequence_parallel: bool = False
    # pipeline stages (DeepSpeed's 1F1B pipeline engine, docs/parallelism.md): the layers split by
    # parameters over pp stages; dp = world_size / (tp x pp); needs train.zero_stage <= 1
    pp: int = 1


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule (cplm_dist.optim)."""

    lr: float = 3e-4
    min_lr: float = 3e-5  # floor of the cosine / WSD decay
    schedule: Schedule = "cosine"
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # wsd: the last fraction of train_steps decays to min_lr
    weight_decay: float = 0.1
    decay_embeddings: bool = False  # norms and biases are never decayed; embeddings only if true
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0  # global gradient-norm clipping (0 = off)
    impl: OptimImpl = "auto"  # AdamW's kernels: auto = fused on CUDA (one kernel per step), foreach on CPU


@dataclass
class TrainConfig:
    """The run: batch arithmetic, precision, ZeRO, logging, evaluation and checkpoints."""

    micro_batch_size: int = 4  # sequences per rank per forward
    global_batch_size: int = 32  # sequences per optimizer step = micro x accumulation x dp
    train_steps: int = 1000
    precision: Precision = "bf16"
    zero_stage: int = 1
    activation_checkpointing: bool = False  # recompute each transformer layer in backward
    compile: bool = False  # torch.compile each transformer layer (regional: one graph, reused by every layer)
    # DeepSpeed ZeRO communication (docs/performance.md, "ZeRO settings"); null = on for CUDA, off on CPU/gloo
    overlap_comm: bool | None = None  # reduce (stage 1-2) / gather (stage 3) on a side stream during backward
    contiguous_gradients: bool = True  # copy gradients into one buffer as they are produced (less fragmentation)
    reduce_bucket_size: int = 500_000_000  # elements per gradient reduction
    allgather_bucket_size: int = 500_000_000  # elements per parameter all-gather after the step (stage 1-2)
    stage3_prefetch_bucket_size: int = 50_000_000  # elements of upcoming parameters ZeRO-3 gathers ahead
    # dtype gradients accumulate (over micro-batches) and are reduced in; null: the parameters'
    # (DeepSpeed's default). fp32 with bf16 (ZeRO-1 only): DeepSpeed's BF16_Optimizer, as Megatron
    # accumulates (docs/training.md, "Gradient accumulation in fp32")
    grad_accum_dtype: GradAccumDtype | None = None
    out_dir: str = "runs/default"  # checkpoints/ and logs/ go here
    log_interval: int = 10
    eval_interval: int = 200  # validation loss every this many steps (and at the end)
    eval_batches: int = 10  # micro-batches per rank in one validation pass
    save_interval: int = 500
    keep_last: int = 3  # checkpoints kept (older ones are deleted after a newer one is complete)
    max_bad_steps: int = 5  # consecutive non-finite steps before the run stops
    collective_timeout_minutes: float = 10.0  # a collective waiting longer ends the job (a hung or lost rank)
    exit_at_step: int | None = None  # save and exit once this step is done (a time-sliced job; Megatron's --exit-interval)
    inject_nonfinite_at: list[int] = field(default_factory=list)  # fault injection (tests): NaN loss at these steps
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "cplm_dist"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    copy: CopyConfig = field(default_factory=CopyConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 1234  # model initialisation


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def resolve_config_path(name: str | Path, relative_to: Path | None = None) -> Path:
    """A path as given, next to `relative_to`, or a shipped config by name (`tiny`, `cplm-135m`)."""
    name = str(name)
    candidates = [Path(name)]
    if relative_to is not None:
        candidates.append(relative_to / name)
    for sub in ("", "models"):
        base = CONFIG_DIR / sub
        candidates += [base / name, base / f"{name}.yaml"]
    for c in candidates:
        if c.is_file():
            return c
    shipped = sorted(p.stem for p in CONFIG_DIR.rglob("*.yaml"))
    raise ConfigError(f"config '{name}' not found: give a YAML path or one of {shipped}")


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config {path}: 'base' chain loops back to itself")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except ConfigError as e:
        raise ConfigError(f"config {path} {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config {path}: not UTF-8 text (byte {e.start}): save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"config {path}: cannot be read ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config {path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: top level must be a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    return _merge(_read_yaml(resolve_config_path(base, path.parent), seen + (path,)), data)


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: key '{key}' is given twice: keep one")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _merge(base: dict, over: Mapping) -> dict:
    """`over` on top of `base`; an empty section (`model:` with nothing under it) changes nothing."""
    out = dict(base)
    for k, v in over.items():
        if v is None and isinstance(out.get(k), dict):
            continue
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """`model.num_layers=4` -> (["model", "num_layers"], 4); the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}' must look like section.field=value (e.g. model.num_layers=4)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    data = _merge({}, data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{part}' is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def load_config(path_or_name: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read YAML (or start from the defaults when None), apply dotted overrides, validate."""
    data = {} if path_or_name is None else _read_yaml(resolve_config_path(path_or_name))
    cfg = from_dict(apply_overrides(data, overrides))
    validate(cfg)
    return cfg


def from_dict(data: Mapping, cls: type = Config, prefix: str = "") -> Any:
    """Build a dataclass tree from plain data, refusing unknown keys and wrongly typed values."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f"; valid keys: {sorted(known)}"
            raise ConfigError(f"unknown key '{prefix}{key}'{hint}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = from_dict(value if value is not None else {}, hint, f"{prefix}{key}.")
        else:
            kwargs[key] = _check_type(f"{prefix}{key}", value, hint)
    missing = [f.name for f in known.values()
               if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} lacks required key '{prefix}{missing[0]}'")
    return cls(**kwargs)


def _check_type(name: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{name}={value!r} is not valid: choose one of {list(typing.get_args(hint))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(name, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{name}={value!r} has the wrong type")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}={value!r} must be a list")
        (item,) = typing.get_args(hint)[:1] or (Any,)
        if dataclasses.is_dataclass(item):
            return [from_dict(v, item, f"{name}[{i}].") for i, v in enumerate(value)]
        return [_check_type(f"{name}[{i}]", v, item) for i, v in enumerate(value)]
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}={value!r} must be an integer")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}={value!r} must be a number")
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            raise ConfigError(f"{name}={value!r} must be a finite number (within float32's range, |x| < 3.4e38)")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}={value!r} must be a string")
        return value
    return value


def to_dict(cfg: Any) -> dict:
    """The resolved tree as plain data (for checkpoints, logs and `--print-config`)."""
    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(cfg: Config) -> None:
    """Cross-field checks; each failure is one line naming the field, the value and the fix."""
    m, c, tp = cfg.model, cfg.copy, cfg.parallel.tp
    positive = {
        "model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size,
        "model.num_heads": m.num_heads, "model.num_kv_heads": m.num_kv_heads,
        "model.ffn_hidden_size": m.ffn_hidden_size, "model.vocab_size": m.vocab_size,
        "model.max_seq_len": m.max_seq_len, "model.make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
        "copy.num_heads": c.num_heads, "copy.head_dim": c.head_dim, "copy.chunk_size": c.chunk_size,
        "parallel.tp": tp, "parallel.pp": cfg.parallel.pp,
    }
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name}={value} must be a positive integer")
    for name, value in {"model.norm_eps": m.norm_eps, "model.init_std": m.init_std,
                        "model.rope_theta": m.rope_theta, "copy.init_std": c.init_std}.items():
        if not value > 0:
            raise ConfigError(f"{name}={value} must be > 0")
    if m.hidden_size % m.num_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} must be divisible by model.num_heads={m.num_heads} "
            f"(valid head counts: {_divisors(m.hidden_size)[:12]}...)"
        )
    if m.head_dim % 2:
        raise ConfigError(f"model.hidden_size/num_heads = {m.head_dim} must be even for rotary embeddings")
    if c.rope and c.head_dim % 2:
        raise ConfigError(f"copy.head_dim={c.head_dim} must be even when copy.rope=true")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads} "
            f"(valid: {_divisors(m.num_heads)})"
        )
    validate_data(cfg)
    validate_train(cfg)
    check_tp_divides(m, tp)
    validate_pipeline(cfg)
    if m.arch == "gpt2" and m.init_from:
        raise ConfigError("model.init_from reads a HF Llama, which model.arch=gpt2 is not: drop model.init_from "
                          "or use model.arch=llama")
    if cfg.parallel.sequence_parallel and tp > 1 and cfg.data.seq_length % tp:
        raise ConfigError(
            f"data.seq_length={cfg.data.seq_length} is not divisible by parallel.tp={tp}, which "
            f"parallel.sequence_parallel=true needs (each tp rank holds seq_length/tp positions): "
            f"make seq_length a multiple of {tp} or set parallel.sequence_parallel=false")


def validate_pipeline(cfg: Config) -> None:
    """What DeepSpeed's pipeline engine needs at parallel.pp > 1."""
    pp, t = cfg.parallel.pp, cfg.train
    if pp == 1:
        return
    if cfg.model.num_layers < pp:
        raise ConfigError(f"parallel.pp={pp} exceeds model.num_layers={cfg.model.num_layers}: every stage needs a "
                          f"transformer layer; use parallel.pp <= {cfg.model.num_layers}")
    if t.zero_stage > 1:
        raise ConfigError(f"train.zero_stage={t.zero_stage} with parallel.pp={pp}: DeepSpeed's pipeline engine accumulates "
                          "gradients across micro-batches itself, which ZeRO-2/3 would shard away; use train.zero_stage=1 "
                          "(it shards the optimizer states over dp)")
    if cfg.model.init_from:
        raise ConfigError(f"model.init_from with parallel.pp={pp}: starting from a HF Llama is wired for pp=1 only; "
                          "drop model.init_from or train at parallel.pp=1")
    if t.precision == "bf16" and t.zero_stage == 0:
        raise ConfigError(f"train.precision=bf16 with train.zero_stage=0 at parallel.pp={pp}: DeepSpeed's bf16 optimizer "
                          "would clip with a norm that misses later stages' replicated parameters; use train.zero_stage=1")


def check_tp_divides(m: ModelConfig, tp: int) -> None:
    """The heads, kv heads and MLP width split evenly over `tp` ranks (training, and loading a
    checkpoint at another tp)."""
    for name, value in (("model.num_heads", m.num_heads), ("model.num_kv_heads", m.num_kv_heads),
                        ("model.ffn_hidden_size", m.ffn_hidden_size)):
        if value % tp:
            valid = [d for d in _divisors(m.num_kv_heads) if m.ffn_hidden_size % d == 0]
            raise ConfigError(f"{name}={value} is not divisible by parallel.tp={tp} (valid tp for this model: {valid})")


def parse_split(split: str) -> list[float]:
    """Megatron's split string "98,2,0" -> normalised [train, valid, test] fractions."""
    try:
        parts = [float(p) for p in split.split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(f"data.split={split!r} must be up to three non-negative weights, e.g. '98,2,0'")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def validate_data(cfg: Config) -> None:
    d = cfg.data
    if d.seq_length < 1:
        raise ConfigError(f"data.seq_length={d.seq_length} must be a positive integer")
    if d.seq_length > cfg.model.max_seq_len:
        raise ConfigError(
            f"data.seq_length={d.seq_length} exceeds model.max_seq_len={cfg.model.max_seq_len}: "
            "lower one or raise the other"
        )
    if d.num_workers < 0:
        raise ConfigError(f"data.num_workers={d.num_workers} must be >= 0")
    for i, entry in enumerate(d.blend):
        if not entry.weight > 0:
            raise ConfigError(f"data.blend[{i}].weight={entry.weight} must be > 0 (drop the entry instead)")
    parse_split(d.split)


def validate_train(cfg: Config) -> None:
    t, o = cfg.train, cfg.optim
    for name, value in {"train.micro_batch_size": t.micro_batch_size, "train.global_batch_size": t.global_batch_size,
                        "train.train_steps": t.train_steps, "train.log_interval": t.log_interval,
                        "train.eval_interval": t.eval_interval, "train.eval_batches": t.eval_batches,
                        "train.save_interval": t.save_interval, "train.keep_last": t.keep_last,
                        "train.max_bad_steps": t.max_bad_steps}.items():
        if value < 1:
            raise ConfigError(f"{name}={value} must be a positive integer")
    for name, value in (("train.reduce_bucket_size", t.reduce_bucket_size),
                        ("train.allgather_bucket_size", t.allgather_bucket_size),
                        ("train.stage3_prefetch_bucket_size", t.stage3_prefetch_bucket_size)):
        if value < 1:
            raise ConfigError(f"{name}={value} must be a positive number of elements (DeepSpeed's default: 5e8, 5e8, 5e7)")
    if t.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"train.zero_stage={t.zero_stage} is not valid: choose one of [0, 1, 2, 3]")
    if cfg.loss.chunk_rows < 1:
        raise ConfigError(f"loss.chunk_rows={cfg.loss.chunk_rows} must be a positive integer")
    if cfg.loss.impl == "chunked" and t.zero_stage == 3:
        raise ConfigError("loss.impl=chunked with train.zero_stage=3: ZeRO-3 gathers the LM-head weight only inside "
                          "its module's forward, which the chunked loss bypasses; use loss.impl=dense or zero_stage<=2")
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size={t.micro_batch_size}"
        )
    if not 0 < o.lr or not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"optim.lr={o.lr} and optim.min_lr={o.min_lr} must satisfy 0 <= min_lr <= lr, lr > 0")
    if o.warmup_steps < 0 or o.warmup_steps > t.train_steps:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be between 0 and train.train_steps={t.train_steps}")
    if not 0 <= o.decay_fraction <= 1:
        raise ConfigError(f"optim.decay_fraction={o.decay_fraction} must be within [0, 1]")
    if o.weight_decay < 0 or o.clip_grad < 0:
        raise ConfigError("optim.weight_decay and optim.clip_grad must be >= 0")
    for name, value in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        if not 0 <= value < 1:
            raise ConfigError(f"{name}={value} must be within [0, 1) (e.g. 0.9, 0.95)")
    if not o.eps > 0:
        raise ConfigError(f"optim.eps={o.eps} must be > 0 (e.g. 1e-8)")
    if not t.collective_timeout_minutes > 0:
        raise ConfigError(f"train.collective_timeout_minutes={t.collective_timeout_minutes} must be > 0")
    if not str(t.out_dir).strip():
        raise ConfigError("train.out_dir is empty: name the directory the run writes to")
    decay_start = t.train_steps - int(round(o.decay_fraction * t.train_steps))
    if o.schedule == "wsd" and o.warmup_steps > decay_start:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} overlaps the WSD decay, which starts at step {decay_start} "
                          f"(optim.decay_fraction={o.decay_fraction} of train.train_steps={t.train_steps}): "
                          "lower one of them")
    if t.precision == "fp32" and t.grad_accum_dtype == "bf16":
        raise ConfigError("train.grad_accum_dtype=bf16 with train.precision=fp32: fp32 parameters accumulate fp32 "
                          "gradients; drop train.grad_accum_dtype or train in train.precision=bf16")
    if t.precision == "bf16" and t.grad_accum_dtype == "fp32" and t.zero_stage != 1:
        raise ConfigError(f"train.grad_accum_dtype=fp32 with train.precision=bf16 at train.zero_stage={t.zero_stage}: "
                          "DeepSpeed accumulates bf16 gradients in fp32 only in its ZeRO-1 bf16 optimizer; use "
                          "train.zero_stage=1 or drop train.grad_accum_dtype")
    if t.precision == "bf16" and t.zero_stage == 0 and cfg.parallel.tp > 1 and o.clip_grad > 0:
        raise ConfigError("train.precision=bf16 with train.zero_stage=0 at parallel.tp>1 and optim.clip_grad>0: DeepSpeed's "
                          "bf16 stage-0 optimizer clips with a norm that misses the other tp ranks' shards; use "
                          "train.zero_stage=1 (it also shards the optimizer states)")


def batch_layout(cfg: Config, dp_size: int) -> int:
    """Gradient-accumulation steps from micro x accumulation x dp = global, or a ConfigError with the numbers."""
    t = cfg.train
    per_step = t.micro_batch_size * dp_size
    if t.global_batch_size % per_step:
        lower = (t.global_batch_size // per_step) * per_step
        valid = [v for v in (lower, lower + per_step) if v > 0]
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not micro_batch_size={t.micro_batch_size} x "
            f"dp={dp_size} (={per_step}) x an integer accumulation: use one of {valid} or change micro_batch_size"
        )
    return t.global_batch_size // per_step
