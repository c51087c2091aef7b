"""Hugging Face directories <-> CPLM, for every backbone: reading a `save_pretrained` directory
(`model.init_from`: check_hf_dir, read_hf, initialise_from_hf) and writing an export
(tools/export_hf.py: write_hf_dir, with its generation_config.json and, copy on, the remote-code
files). What maps a family's config and weights is its record's adapter (`backbone(m).hf`,
cplm_dist.config.backbones.hf_adapter); nothing here names a family.

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
from cplm_dist.config.backbones import BACKBONES, backbone
from cplm_dist.errors import HFImportError

__all__ = ["HFImportError", "REMOTE_CODE", "REMOTE_FILES", "check_hf_dir", "families", "generation_config",
           "initialise_from_hf", "read_hf", "transformers_config", "write_hf_dir"]

REMOTE_CODE = Path(__file__).resolve().parent / "remote"  # the transformers side of a copy-on export
REMOTE_FILES = tuple(sorted(p.name for p in REMOTE_CODE.glob("*.py") if p.name != "__init__.py"))  # every file, copied


def families(field: str) -> str:
    """Every backbone's adapter's `field` (family, model_type) in words: "Llama, GPT-2 or Qwen3"."""
    words = [getattr(b.hf, field) for b in BACKBONES.values()]
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
    adapter = backbone(m).hf
    if kind != adapter.model_type:
        arch = [name for name, b in BACKBONES.items() if b.hf.model_type == kind]
        if not arch:
            raise HFImportError(f"{where}: model_type={kind!r}: only model_type {families('model_type')} checkpoints import")
        raise HFImportError(f"{where}: its model_type is {kind}, which model.arch={m.arch} does not read: "
                            f"set model.arch={arch[0]}")
    adapter.check(hf_cfg, m, where)
    return files


def read_hf(directory: str | Path, m: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full backbone weights (float32) from a local `save_pretrained` directory, through the
    backbone's adapter."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in check_hf_dir(directory, m):
        state.update(load_file(str(f)))
    adapter = backbone(m).hf
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
                 extra: dict | None = None, tokens: dict | None = None) -> None:
    """model.safetensors, config.json, generation_config.json (and for a copy-on model the
    remote-code files) into an existing empty `directory`, through the backbone's adapter;
    `tokens`: the tokenizer's {bos,eos,pad}_token_id (those it has), into both configs."""
    import shutil

    from safetensors.torch import save_file

    adapter = backbone(m).hf
    save_file({k: v.to(dtype).contiguous() for k, v in adapter.to_hf(full, m).items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    config = {**adapter.hf_config(m, copy), **(tokens or {}), "torch_dtype": str(dtype).removeprefix("torch."), **(extra or {})}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(generation_config(tokens), indent=2) + "\n")
    if copy.enabled:
        for name in REMOTE_FILES:
            shutil.copy2(REMOTE_CODE / name, directory / name)


def transformers_config(m: ModelConfig, **kwargs):
    """transformers' config object of the backbone's stock class for these shapes (config.json's
    fields; needs transformers): the profiler's peer model and anything else built from our shapes."""
    from transformers import AutoConfig

    adapter = backbone(m).hf
    fields = {k: v for k, v in adapter.stock_config(m).items() if k != "torch_dtype"}
    return AutoConfig.for_model(adapter.model_type, **fields, **kwargs)
