"""Hugging Face directories <-> CPLM, for every backbone: reading a `save_pretrained` directory
(`model.init_from`: check_hf_dir, read_hf, initialise_from_hf; sharded or not) and writing an
export (tools/export_hf.py: write_hf_dir: the weights as save_pretrained writes them, sharded past
a size with model.safetensors.index.json; config.json, generation_config.json and, copy on, the
remote-code files; the tokenizer's files: tokenizer_files.py). What maps a family's config and
weights is its record's adapter (`hf_adapter(m)`: `backbone(m).hf`, or for a sparse model its
mixture-of-experts adapter `backbone(m).hf.sparse`; cplm_dist.config.backbones.hf_adapter);
nothing here names a family.

Import: a transformers model saved with `save_pretrained` (config.json and *.safetensors) whose
model_type is the run's backbone's initialises the backbone at any tp; the copy head starts fresh.
Export: copy off, the adapter's stock class (loads without remote code); copy on, its remote class
(cplm_dist/interop/hf/remote, every file copied beside the weights and named in config.json's
auto_map) for `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`, whose logits are
the mixture's log-probabilities.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cplm_dist.config import CopyConfig, ModelConfig
from cplm_dist.config.backbones import BACKBONES, hf_adapter
from cplm_dist.errors import HFImportError

__all__ = ["DEFAULT_MAX_SHARD", "HFImportError", "REMOTE_CODE", "REMOTE_FILES", "SHARD_INDEX", "check_hf_dir", "families",
           "generation_config", "initialise_from_hf", "parse_size", "read_hf", "transformers_config", "write_configs",
           "write_hf_dir", "write_weights"]

REMOTE_CODE = Path(__file__).resolve().parent / "remote"  # the transformers side of a copy-on export
REMOTE_FILES = tuple(sorted(p.name for p in REMOTE_CODE.glob("*.py") if p.name != "__init__.py"))  # every file, copied
DEFAULT_MAX_SHARD = 5 * 10**9  # bytes a weights file (the Hub's long-standing 5GB; transformers 5's save_pretrained: 50GB)
SHARD_INDEX = "model.safetensors.index.json"


def _adapters() -> list[tuple[str, object]]:
    """(model.arch, adapter) of every HF class read and written: each record's, then its sparse one."""
    return [(name, a) for name, b in BACKBONES.items() for a in (b.hf, b.hf.sparse) if a is not None]


def families(field: str) -> str:
    """Every adapter's `field` (family, model_type) in words: "Llama, GPT-2, Qwen3 or Qwen3-MoE"."""
    words = [getattr(a, field) for _, a in _adapters()]
    return " or ".join(words) if len(words) < 3 else f"{', '.join(words[:-1])} or {words[-1]}"


def check_hf_dir(directory: str | Path, m: ModelConfig) -> list[Path]:
    """The safetensors files of a local `save_pretrained` directory whose config fits `m`; else
    one-line HFImportError. Reads config.json only (training checks this before it starts). Its
    model_type must be the one the backbone's adapter reads (else: the model.arch that reads it);
    the adapter checks the rest."""
    d = Path(directory)
    where = f"model.init_from={directory}"
    if not (d / "config.json").is_file():
        raise HFImportError(f"{where}: no config.json there; point it at a directory written by save_pretrained")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise HFImportError(f"{where}: no *.safetensors weights there (save with safe_serialization=True)")
    try:
        hf_cfg = json.loads((d / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFImportError(f"{where}: config.json is not JSON ({e})") from None
    kind = hf_cfg.get("model_type") if isinstance(hf_cfg, dict) else None
    adapter = hf_adapter(m)
    if kind != adapter.model_type:
        raise HFImportError(f"{where}: {_another_class(kind, hf_cfg, m)}")
    adapter.check(hf_cfg, m, where)
    return files


def _another_class(kind, hf_cfg: dict, m: ModelConfig) -> str:
    """Why a HF model_type does not fit the run, and the model.arch / model.moe that reads it."""
    readers = [(name, a) for name, a in _adapters() if a.model_type == kind]
    if not readers:
        return f"model_type={kind!r}: only model_type {families('model_type')} checkpoints import"
    arch, adapter = readers[0]
    sparse = adapter is BACKBONES[arch].hf.sparse
    if sparse and m.moe.num_experts == 0:
        experts = hf_cfg.get("num_local_experts", hf_cfg.get("num_experts"))  # transformers 5's key, or 4's
        return (f"its model_type is {kind} (a mixture of experts), which a dense model.arch={m.arch} does not read: set "
                f"model.arch={arch} model.moe.num_experts={experts}")
    if not sparse and m.moe.num_experts and arch == m.arch:
        return (f"its model_type is {kind} (dense), which a sparse run (model.moe.num_experts={m.moe.num_experts}) "
                "does not read: set model.moe.num_experts=0")
    return f"its model_type is {kind}, which model.arch={m.arch} does not read: set model.arch={arch}"


def read_hf(directory: str | Path, m: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full backbone weights (float32) from a local `save_pretrained` directory, through the
    backbone's adapter."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in check_hf_dir(directory, m):
        state.update(load_file(str(f)))
    adapter = hf_adapter(m)
    try:
        full = adapter.from_hf(state, m)
    except (KeyError, RuntimeError) as e:
        raise HFImportError(f"model.init_from={directory}: its weights do not fit a {adapter.architecture} of these "
                            f"shapes ({str(e).splitlines()[0][:120]})") from None
    return {k: v.float() for k, v in full.items()}


def initialise_from_hf(model: torch.nn.Module, directory: str | Path, tp_rank: int, tp_size: int) -> None:
    """Overwrite this rank's backbone with a HF model's weights at any tp (the copy head keeps its
    fresh initialisation)."""
    from cplm_dist.model.parallel.sharding import load_full_state_dict

    load_full_state_dict(model, read_hf(directory, model.model_cfg), tp_rank, tp_size, require_all=False)


def generation_config(tokens: dict | None = None) -> dict:
    """generation_config.json: the tokenizer's bos/eos/pad ids (those it has) and a KV cache."""
    return {**(tokens or {}), "use_cache": True}


def write_hf_dir(full: dict[str, torch.Tensor], m: ModelConfig, copy: CopyConfig, directory: Path, dtype: torch.dtype,
                 extra: dict | None = None, tokens: dict | None = None, max_shard_size: int = DEFAULT_MAX_SHARD) -> None:
    """The weights (write_weights), config.json and generation_config.json (write_configs) and for
    a copy-on model the remote-code files into an existing empty `directory`, through the
    backbone's adapter; `tokens`: the tokenizer's {bos,eos,pad}_token_id (those it has), into both
    configs."""
    import shutil

    write_weights(hf_adapter(m).to_hf(full, m), directory, dtype, max_shard_size)
    write_configs(m, copy, directory, dtype, extra, tokens)
    if copy.enabled:
        for name in REMOTE_FILES:
            shutil.copy2(REMOTE_CODE / name, directory / name)


def write_configs(m: ModelConfig, copy: CopyConfig, directory: Path, dtype: torch.dtype, extra: dict | None = None,
                  tokens: dict | None = None) -> None:
    """config.json (the adapter's, with the token ids, the dtype and `extra`) and generation_config.json."""
    config = {**hf_adapter(m).hf_config(m, copy), **(tokens or {}), "torch_dtype": str(dtype).removeprefix("torch."),
              **(extra or {})}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(generation_config(tokens), indent=2) + "\n")


def write_weights(hf_state: dict[str, torch.Tensor], directory: Path, dtype: torch.dtype,
                  max_shard_size: int = DEFAULT_MAX_SHARD) -> list[str]:
    """The weights as save_pretrained writes them (huggingface_hub's split, in `dtype`): one
    model.safetensors, or model-0000k-of-0000n.safetensors of at most `max_shard_size` bytes each (a
    larger tensor alone in its own) and model.safetensors.index.json (total_size, total_parameters,
    weight_map). Returns the file names written."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    state = {k: _own_storage(v.to(dtype).contiguous()) for k, v in hf_state.items()}
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({k: state[k] for k in names}, str(directory / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_parameters": sum(v.numel() for v in state.values()), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (directory / SHARD_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return sorted(split.filename_to_tensors)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied when it is a view of a larger tensor (an adapter's split of a fused weight):
    the split counts a tensor's whole storage, and a file should hold only its own bytes."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def parse_size(text: str) -> int:
    """Bytes from a size as save_pretrained's max_shard_size takes it ("5GB", "500MB", "100KB",
    decimal units) or a plain number of bytes; ValueError (its message one line) otherwise."""
    import re

    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    match = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([KMGT]?B)?", str(text).strip().upper())
    size = int(float(match[1]) * units[match[2] or ""]) if match else 0
    if size < 1:
        raise ValueError(f"{text!r} is not a size: give bytes or a number with KB, MB, GB or TB (e.g. 5GB)")
    return size


def transformers_config(m: ModelConfig, **kwargs):
    """transformers' config object of the backbone's stock class for these shapes (config.json's
    fields; needs transformers): the profiler's peer model and anything else built from our shapes."""
    from transformers import AutoConfig

    adapter = hf_adapter(m)
    fields = {k: v for k, v in adapter.stock_config(m).items() if k != "torch_dtype"}
    return AutoConfig.for_model(adapter.model_type, **fields, **kwargs)
