"""Hugging Face Llama <-> CPLM backbone: one name and layout map, used both ways; and the
directory side both families share (HFImportError, check_hf_dir, read_hf, initialise_from_hf,
write_hf_dir with its generation_config.json), each given the family's map: a module with
ARCHITECTURE, hf_config, check_hf_config, to_hf and from_hf (this one, cplm_dist.interop.hf.gpt2), which
the caller picks from the backbone's record (cplm_dist.model.backbones's `hf`;
cplm_dist.interop.init_from.hf_map).

Import (`model.init_from: <local HF Llama directory>`): a transformers `LlamaForCausalLM` saved
with `save_pretrained` (config.json and *.safetensors) initialises the backbone at any tp; the
copy head starts fresh. Export (`tools/export_hf.py`): copy off, a stock `LlamaForCausalLM`
directory that loads without remote code; copy on, a `CPLMForCausalLM` (cplm_dist/interop/hf/remote,
copied into the directory and named in config.json's auto_map) for
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`, whose logits are the
mixture's log-probabilities.

Both sides are tp-independent "full" weights (cplm_dist.model.parallel.sharding turns them into a rank's
shards). The layouts differ in two places:

| ours | HF Llama |
|---|---|
| layers.i.attention.qkv [(nh + 2 nkv) hd, D], per kv group [q_1 .. q_g, k, v] | self_attn.q_proj, k_proj, v_proj |
| layers.i.mlp.fc1 [2 F, D] = [gate; up] | mlp.gate_proj, mlp.up_proj |

RoPE is the rotate-half convention on both sides (HF's checkpoints are already permuted for it),
RMSNorm the same formula, no biases. model.rope_scaling (context extension): linear is
transformers' rope_type linear both ways; ntk exports as plain RoPE at its larger theta
(`hf_rope`); a plain-RoPE Llama imports under any model.rope_scaling, a linear one under the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cplm_dist.config import CopyConfig, ModelConfig
from cplm_dist.errors import UsageError
from cplm_dist.model.backbones import BACKBONES, backbone, backbones_with

ARCHITECTURE = "LlamaForCausalLM"

# (our config field, HF config key)
SHAPE_FIELDS = (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"), ("num_heads", "num_attention_heads"),
                ("num_kv_heads", "num_key_value_heads"), ("ffn_hidden_size", "intermediate_size"),
                ("vocab_size", "vocab_size"))
LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "attention.proj.weight": "self_attn.o_proj.weight",
               "mlp_norm.weight": "post_attention_layernorm.weight", "mlp.fc2.weight": "mlp.down_proj.weight"}


class HFImportError(UsageError):
    """A Hugging Face directory that cannot initialise this model (one line, exit 2)."""


REMOTE_CODE = Path(__file__).resolve().parent / "remote"  # the transformers side of a copy-on export
REMOTE_FILES = tuple(sorted(p.name for p in REMOTE_CODE.glob("*.py") if p.name != "__init__.py"))  # every file, copied


def hf_config(m: ModelConfig, copy: CopyConfig | None = None) -> dict:
    """config.json for this model: a stock `LlamaForCausalLM` without copy head, else our
    `CPLMForCausalLM` (cplm_dist/interop/hf/remote, loaded with trust_remote_code=True)."""
    out = {"architectures": [ARCHITECTURE], "model_type": backbone(m).hf, **{hf: getattr(m, ours) for ours, hf in SHAPE_FIELDS},
           "head_dim": m.head_dim, "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
           **hf_rope(m), "tie_word_embeddings": m.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
           "mlp_bias": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "torch_dtype": "float32"}
    # no token ids of LlamaConfig's own (bos 1, eos 2: generate() would stop at our id 2): write_hf_dir adds the tokenizer's
    if copy is not None and copy.enabled:
        out.update({"architectures": ["CPLMForCausalLM"], "model_type": "cplm",
                    "auto_map": {"AutoConfig": "configuration_cplm.CPLMConfig",
                                 "AutoModelForCausalLM": "modeling_cplm.CPLMForCausalLM"}, **copy_fields(m, copy)})
    return out


def copy_fields(m: ModelConfig, copy: CopyConfig) -> dict:
    """config.json's copy_* keys of a copy-on export (either backbone's remote class reads them)."""
    scaling = m.rope_scaling
    return {"copy_num_heads": copy.num_heads, "copy_head_dim": copy.head_dim, "copy_paste": copy.paste,
            "copy_mix": copy.mix, "copy_rope": copy.rope, "copy_rope_theta": m.rope_theta,
            # the copy head's own RoPE follows model.rope_scaling at its own head dim (cplm_dist.model.copy_head)
            "copy_rope_scaling": None if scaling is None else {"type": scaling.type, "factor": scaling.factor}}


def hf_rope(m: ModelConfig) -> dict:
    """config.json's RoPE keys. model.rope_scaling linear is transformers' rope_type linear
    (inv_freq / factor: positions / factor), written both as rope_parameters (transformers 5) and
    rope_scaling (4.x). ntk is written as what it exactly is, a plain RoPE at the larger theta:
    transformers has no static NTK-aware type (its "dynamic" recomputes theta from each call's
    sequence length past max_position_embeddings, another function)."""
    from cplm_dist.model.rotary import scaled_theta

    r, theta, params = m.rope_scaling, m.rope_theta, {"rope_type": "default"}
    if r is not None and r.type == "ntk":
        theta = scaled_theta(m.head_dim, m.rope_theta, r)
    elif r is not None:
        params = {"rope_type": "linear", "factor": r.factor}
    out = {"rope_theta": theta, "rope_parameters": {"rope_theta": theta, **params}}
    return {**out, "rope_scaling": params} if r is not None and r.type == "linear" else out


def hf_rope_of(hf: dict) -> tuple[str, float, float | None]:
    """(rope type, base theta, factor or None) of a HF config.json (transformers 4's rope_scaling
    or 5's rope_parameters)."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
    return rope.get("rope_type", rope.get("type", "default")), theta, rope.get("factor")


def llama_config(m: ModelConfig, **kwargs):
    """transformers' LlamaConfig of this backbone (config.json's fields as an object; needs
    transformers): the profiler's peer model and anything else built from our shapes."""
    from transformers import LlamaConfig

    fields = {k: v for k, v in hf_config(m).items() if k not in ("architectures", "model_type", "torch_dtype")}
    return LlamaConfig(**fields, **kwargs)


def check_hf_config(hf: dict, m: ModelConfig, where: str) -> None:
    """One line naming the first field where the HF Llama (its model_type checked by check_hf_dir)
    and the config disagree."""
    for ours, theirs in SHAPE_FIELDS:
        if hf.get(theirs) != getattr(m, ours):
            raise HFImportError(f"{where}: {theirs}={hf.get(theirs)} but model.{ours}={getattr(m, ours)}: "
                                f"set model.{ours}={hf.get(theirs)} (the shapes must match the checkpoint)")
    check_hf_rope(hf, m, where)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    if head_dim != m.head_dim:
        raise HFImportError(f"{where}: head_dim={head_dim} but hidden_size/num_heads={m.head_dim}: not importable")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise HFImportError(f"{where}: {key}=true; the CPLM backbone has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFImportError(f"{where}: hidden_act={hf.get('hidden_act')!r}; the CPLM MLP is SwiGLU (silu)")
    check_tied(hf.get("tie_word_embeddings", False), m, where)


def check_tied(tied: bool, m: ModelConfig, where: str) -> None:
    """A model with its own LM head does not fit a tied run (a tied one fits an untied run: its
    LM head starts as a copy of the embedding)."""
    if m.tie_embeddings and not tied:
        raise HFImportError(f"{where}: tie_word_embeddings=false (its own LM head) but model.tie_embeddings=true: "
                            "set model.tie_embeddings=false")


def check_hf_rope(hf: dict, m: ModelConfig, where: str) -> None:
    """The HF model's RoPE is this config's base: the same theta; its linear scaling, if any, is
    model.rope_scaling. A plain-RoPE Llama may start a run with any model.rope_scaling (a context
    extension); other scaled types do not import."""
    kind, theta, factor = hf_rope_of(hf)
    if kind not in ("default", "linear"):
        raise HFImportError(f"{where}: RoPE {kind} does not import (plain and linear do): start from a Llama with "
                            "rope_type default or linear")
    if theta != m.rope_theta:
        raise HFImportError(f"{where}: RoPE {kind} with theta {theta}, the config has model.rope_theta={m.rope_theta}: "
                            f"set model.rope_theta={theta}")
    r = m.rope_scaling
    if kind == "linear" and (r is None or r.type != "linear" or r.factor != factor):
        raise HFImportError(f"{where}: RoPE linear with factor {factor}, the config has model.rope_scaling="
                            f"{r if r is None else f'{r.type}/{r.factor}'}: set model.rope_scaling.type=linear "
                            f"model.rope_scaling.factor={factor}")


def to_hf(full: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full weights -> LlamaForCausalLM's state dict, plus the copy head's (same names) if any."""
    g, hd, D = m.num_heads // m.num_kv_heads, m.head_dim, m.hidden_size
    out = {"model.embed_tokens.weight": full["embedding.weight"], "model.norm.weight": full["final_norm.weight"]}
    out.update({k: v for k, v in full.items() if k.startswith("copy_head.")})
    if not m.tie_embeddings:
        out["lm_head.weight"] = full["lm_head.weight"]
    for i in range(m.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        qkv = full[ours + "attention.qkv.weight"].view(m.num_kv_heads, g + 2, hd, D)
        out[theirs + "self_attn.q_proj.weight"] = qkv[:, :g].reshape(m.num_heads * hd, D)
        out[theirs + "self_attn.k_proj.weight"] = qkv[:, g].reshape(m.num_kv_heads * hd, D)
        out[theirs + "self_attn.v_proj.weight"] = qkv[:, g + 1].reshape(m.num_kv_heads * hd, D)
        gate, up = full[ours + "mlp.fc1.weight"].chunk(2, dim=0)
        out[theirs + "mlp.gate_proj.weight"], out[theirs + "mlp.up_proj.weight"] = gate, up
        out.update({theirs + hf: full[ours + name] for name, hf in LAYER_NAMES.items()})
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(hf: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's state dict -> our full backbone weights (no copy head)."""
    g, hd, D = m.num_heads // m.num_kv_heads, m.head_dim, m.hidden_size
    full = {"embedding.weight": hf["model.embed_tokens.weight"], "final_norm.weight": hf["model.norm.weight"]}
    if not m.tie_embeddings:
        full["lm_head.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    for i in range(m.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        q = hf[theirs + "self_attn.q_proj.weight"].view(m.num_kv_heads, g, hd, D)
        k = hf[theirs + "self_attn.k_proj.weight"].view(m.num_kv_heads, 1, hd, D)
        v = hf[theirs + "self_attn.v_proj.weight"].view(m.num_kv_heads, 1, hd, D)
        full[ours + "attention.qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, D)
        full[ours + "mlp.fc1.weight"] = torch.cat([hf[theirs + "mlp.gate_proj.weight"], hf[theirs + "mlp.up_proj.weight"]])
        full.update({ours + name: hf[theirs + theirs_name] for name, theirs_name in LAYER_NAMES.items()})
    return full


def check_hf_dir(directory: str | Path, m: ModelConfig, family) -> list[Path]:
    """The safetensors files of a local `save_pretrained` directory whose config fits `m`; else
    one-line HFImportError. Reads config.json only (training checks this before it starts). Its
    model_type must be the record's `hf` (else: the model.arch that reads it); `family` (the
    backbone's map) checks the rest."""
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
    if kind != backbone(m).hf:
        arch = backbones_with(hf=kind)
        if not arch:
            kinds = " or ".join(b.hf for b in BACKBONES.values())
            raise HFImportError(f"{where}: model_type={kind!r}: only model_type {kinds} checkpoints import")
        raise HFImportError(f"{where}: its model_type is {kind}, which model.arch={m.arch} does not read: "
                            f"set model.arch={arch[0]}")
    family.check_hf_config(hf_cfg, m, where)
    return files


def read_hf(directory: str | Path, m: ModelConfig, family) -> dict[str, torch.Tensor]:
    """Our full backbone weights (float32) from a local `save_pretrained` directory, through
    `family` (the backbone's map)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in check_hf_dir(directory, m, family):
        state.update(load_file(str(f)))
    try:
        full = family.from_hf(state, m)
    except (KeyError, RuntimeError) as e:
        raise HFImportError(f"model.init_from={directory}: its weights do not fit a {family.ARCHITECTURE} of these shapes "
                            f"({str(e).splitlines()[0][:120]})") from None
    return {k: v.float() for k, v in full.items()}


def initialise_from_hf(model: torch.nn.Module, directory: str | Path, tp_rank: int, tp_size: int, family) -> None:
    """Overwrite this rank's backbone with a HF model's weights at any tp (the copy head keeps its
    fresh initialisation)."""
    from cplm_dist.model.parallel.sharding import load_full_state_dict

    load_full_state_dict(model, read_hf(directory, model.model_cfg, family), tp_rank, tp_size, require_all=False)


def generation_config(tokens: dict | None = None) -> dict:
    """generation_config.json: the tokenizer's bos/eos/pad ids (those it has) and a KV cache."""
    return {**(tokens or {}), "use_cache": True}


def write_hf_dir(full: dict[str, torch.Tensor], m: ModelConfig, copy: CopyConfig, directory: Path, dtype: torch.dtype,
                 family, extra: dict | None = None, tokens: dict | None = None) -> None:
    """model.safetensors, config.json, generation_config.json (and for a copy-on model the
    remote-code files) into an existing empty `directory`, through `family` (the backbone's map);
    `tokens`: the tokenizer's {bos,eos,pad}_token_id (those it has), into both configs."""
    import shutil

    from safetensors.torch import save_file

    save_file({k: v.to(dtype).contiguous() for k, v in family.to_hf(full, m).items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    config = {**family.hf_config(m, copy), **(tokens or {}), "torch_dtype": str(dtype).removeprefix("torch."), **(extra or {})}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(generation_config(tokens), indent=2) + "\n")
    if copy.enabled:
        for name in REMOTE_FILES:
            shutil.copy2(REMOTE_CODE / name, directory / name)
