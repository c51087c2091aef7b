"""The llama backbone (RMSNorm, SwiGLU, RoPE, no biases; the default) and its HF adapter onto
transformers' `LlamaForCausalLM`, used both ways (cplm_dist.config.backbones.hf_adapter):
`model.init_from: <local HF Llama directory>` imports at any tp (the copy head starts fresh);
tools/export_hf.py writes a stock `LlamaForCausalLM` (copy off, no remote code) or our
`CPLMForCausalLM` (copy on: cplm_dist/interop/hf/remote/modeling_cplm.py, named in auto_map), whose
logits are the mixture's log-probabilities.

The layouts differ in two places:

| ours | HF Llama |
|---|---|
| layers.i.attention.qkv [(nh + 2 nkv) hd, D], per kv group [q_1 .. q_g, k, v] | self_attn.q_proj, k_proj, v_proj |
| layers.i.mlp.fc1 [2 F, D] = [gate; up] | mlp.gate_proj, mlp.up_proj |

RoPE is the rotate-half convention on both sides (HF's checkpoints are already permuted for it),
RMSNorm the same formula, no biases. model.rope_scaling (context extension): linear is
transformers' rope_type linear both ways; ntk exports as plain RoPE at its larger theta
(`hf_rope`); a plain-RoPE Llama imports under any model.rope_scaling, a linear one under the same.
Qwen3 (qwen3.py) is this map plus its q/k norms.

A sparse llama (model.moe) maps onto `MixtralForCausalLM` (`HF.sparse`): this map plus the
router and experts (sparse_hf.py; Mixtral's block_sparse_moe, experts' w1 / w3 / w2 = gate / up /
down); num_local_experts, num_experts_per_tok and intermediate_size (one expert's width) are
model.moe's num_experts, top_k and ffn_hidden_size. Mixtral has every layer sparse, always
renormalises the top-k weights and has no remote class: a model with dense layers, normalize=false
or a copy head does not export as one (one line), a Mixtral with a sliding window does not import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import cplm_dist.config.backbones.sparse_hf as sparse_hf
from cplm_dist.config.backbones.hf_adapter import HFAdapter, RemoteClass, Weights, check_shapes, check_tied
from cplm_dist.config.backbones.record import Backbone
from cplm_dist.errors import ConfigError, HFImportError

if TYPE_CHECKING:  # the config package imports the records (config.validation): types only here
    from cplm_dist.config.tree import ModelConfig

ARCHITECTURE = "LlamaForCausalLM"

# (our config field, HF config key)
SHAPE_FIELDS = (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"), ("num_heads", "num_attention_heads"),
                ("num_kv_heads", "num_key_value_heads"), ("ffn_hidden_size", "intermediate_size"),
                ("vocab_size", "vocab_size"))
LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "attention.proj.weight": "self_attn.o_proj.weight",
               "mlp_norm.weight": "post_attention_layernorm.weight"}
DENSE_MLP_NAMES = {"mlp.fc2.weight": "mlp.down_proj.weight"}  # a dense layer's (a sparse one's: sparse_hf.py)


def stock_config(m: ModelConfig) -> dict:
    """LlamaConfig's fields for this model. No token ids (LlamaConfig's own bos 1 and eos 2 would
    stop generate() at our id 2): the export adds the tokenizer's."""
    return {**{hf: getattr(m, ours) for ours, hf in SHAPE_FIELDS}, "head_dim": m.head_dim,
            "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps, **hf_rope(m),
            "tie_word_embeddings": m.tie_embeddings, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "torch_dtype": "float32"}


def hf_rope(m: ModelConfig) -> dict:
    """config.json's RoPE keys. model.rope_scaling linear is transformers' rope_type linear
    (inv_freq / factor: positions / factor), written both as rope_parameters (transformers 5) and
    rope_scaling (4.x). ntk is written as what it exactly is, a plain RoPE at the larger theta:
    transformers has no static NTK-aware type (its "dynamic" recomputes theta from each call's
    sequence length past max_position_embeddings, another function)."""
    r, theta, params = m.rope_scaling, m.rope_theta, {"rope_type": "default"}
    if r is not None and r.type == "ntk":
        theta = r.scaled_theta(m.rope_theta, m.head_dim)
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


def check_hf_config(hf: dict, m: ModelConfig, where: str, family: str = "Llama") -> None:
    """One line naming the first field where the HF Llama (its model_type checked by the directory
    side) and the config disagree; `family` names the model in the RoPE line (Qwen3 reads this too)."""
    check_shapes({ours: (key, hf.get(key)) for ours, key in SHAPE_FIELDS}, m, where)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]  # no key: the whole split
    check_shapes({"head_dim": ("head_dim", head_dim)}, m, where)
    check_hf_rope(hf, m, where, family)
    eps = hf.get("rms_norm_eps", 1e-6)  # LlamaConfig's default
    if eps != m.norm_eps:
        raise HFImportError(f"{where}: rms_norm_eps={eps} but model.norm_eps={m.norm_eps}: set model.norm_eps={eps}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise HFImportError(f"{where}: {key}=true; the CPLM backbone has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFImportError(f"{where}: hidden_act={hf.get('hidden_act')!r}; the CPLM MLP is SwiGLU (silu)")
    check_tied(hf.get("tie_word_embeddings", False), m, where)


def check_hf_rope(hf: dict, m: ModelConfig, where: str, family: str = "Llama") -> None:
    """The HF model's RoPE is this config's base: the same theta; its linear scaling, if any, is
    model.rope_scaling. A plain-RoPE model may start a run with any model.rope_scaling (a context
    extension); other scaled types do not import."""
    kind, theta, factor = hf_rope_of(hf)
    if kind not in ("default", "linear"):
        raise HFImportError(f"{where}: RoPE {kind} does not import (plain and linear do): start from a {family} with "
                            "rope_type default or linear")
    if theta != m.rope_theta:
        raise HFImportError(f"{where}: RoPE {kind} with theta {theta}, the config has model.rope_theta={m.rope_theta}: "
                            f"set model.rope_theta={theta}")
    r = m.rope_scaling
    if kind == "linear" and (r is None or r.type != "linear" or r.factor != factor):
        raise HFImportError(f"{where}: RoPE linear with factor {factor}, the config has model.rope_scaling="
                            f"{r if r is None else f'{r.type}/{r.factor}'}: set model.rope_scaling.type=linear "
                            f"model.rope_scaling.factor={factor}")


def to_hf(full: Weights, m: ModelConfig) -> Weights:
    """Our full weights -> LlamaForCausalLM's state dict, plus the copy head's (same names) if any;
    a sparse model's layers (model.moe.sparse_layers) without their MLP (sparse_hf.py maps those)."""
    g, hd, D = m.num_heads // m.num_kv_heads, m.head_dim, m.hidden_size
    sparse = set(m.moe.sparse_layers(m.num_layers))
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
        out.update({theirs + hf: full[ours + name] for name, hf in LAYER_NAMES.items()})
        if i in sparse:
            continue
        gate, up = full[ours + "mlp.fc1.weight"].chunk(2, dim=0)
        out[theirs + "mlp.gate_proj.weight"], out[theirs + "mlp.up_proj.weight"] = gate, up
        out.update({theirs + hf: full[ours + name] for name, hf in DENSE_MLP_NAMES.items()})
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(hf: Weights, m: ModelConfig) -> Weights:
    """LlamaForCausalLM's state dict -> our full backbone weights (no copy head); a sparse model's
    layers without their MLP, as to_hf."""
    g, hd, D = m.num_heads // m.num_kv_heads, m.head_dim, m.hidden_size
    sparse = set(m.moe.sparse_layers(m.num_layers))
    full = {"embedding.weight": hf["model.embed_tokens.weight"], "final_norm.weight": hf["model.norm.weight"]}
    if not m.tie_embeddings:  # a tied source model's LM head is its embedding
        full["lm_head.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    for i in range(m.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        q = hf[theirs + "self_attn.q_proj.weight"].view(m.num_kv_heads, g, hd, D)
        k = hf[theirs + "self_attn.k_proj.weight"].view(m.num_kv_heads, 1, hd, D)
        v = hf[theirs + "self_attn.v_proj.weight"].view(m.num_kv_heads, 1, hd, D)
        full[ours + "attention.qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, D)
        full.update({ours + name: hf[theirs + theirs_name] for name, theirs_name in LAYER_NAMES.items()})
        if i in sparse:
            continue
        full[ours + "mlp.fc1.weight"] = torch.cat([hf[theirs + "mlp.gate_proj.weight"], hf[theirs + "mlp.up_proj.weight"]])
        full.update({ours + name: hf[theirs + theirs_name] for name, theirs_name in DENSE_MLP_NAMES.items()})
    return full


# --- Mixtral: a sparse llama (model.moe) -------------------------------------------------------------

MIXTRAL_NAMES = sparse_hf.ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")


def _every_layer_sparse(m: ModelConfig) -> bool:
    return m.moe.sparse_layers(m.num_layers) == list(range(m.num_layers))


def mixtral_stock_config(m: ModelConfig) -> dict:
    """MixtralConfig's fields: Llama's (no bias keys), intermediate_size one expert's width."""
    sparse_hf.refuse_export(m, "Mixtral", always_normalized=True)
    if not _every_layer_sparse(m):
        raise ConfigError(f"not exportable as Mixtral: model.moe leaves layers dense ({m.moe.sparse_layers(m.num_layers)} "
                          "sparse); Mixtral's are all sparse: set model.moe.first_dense_layers=0 model.moe.layer_freq=1")
    fields = {k: v for k, v in stock_config(m).items() if k not in ("mlp_bias", "attention_bias")}
    e = m.moe
    return {**fields, "intermediate_size": sparse_hf.expert_width(m), "num_local_experts": e.num_experts,
            "num_experts_per_tok": e.top_k, "sliding_window": None, "router_jitter_noise": 0.0,
            "output_router_logits": False, "router_aux_loss_coef": e.aux_loss_coeff}


def check_mixtral_config(hf: dict, m: ModelConfig, where: str) -> None:
    """Llama's checks (intermediate_size is the experts' width here), no sliding window, every layer
    sparse, the experts model.moe's."""
    why = sparse_hf.unsupported(m, "Mixtral", always_normalized=True)
    if why is not None:
        raise HFImportError(f"{where}: {why}")
    if hf.get("sliding_window") is not None:
        raise HFImportError(f"{where}: sliding_window={hf['sliding_window']}; the CPLM llama attends to every earlier "
                            "position: not importable (a Mixtral with sliding_window null is)")
    check_hf_config({**hf, "intermediate_size": m.ffn_hidden_size}, m, where, family="Mixtral")
    sparse_hf.check_sparse_layers(list(range(m.num_layers)), "Mixtral's: every layer", m, where)
    sparse_hf.check_experts({"num_experts": ("num_local_experts", hf.get("num_local_experts", 8)),
                             "top_k": ("num_experts_per_tok", hf.get("num_experts_per_tok", 2)),
                             "ffn_hidden_size": ("intermediate_size", hf.get("intermediate_size"))}, m, where)


def mixtral_to_hf(full: Weights, m: ModelConfig) -> Weights:
    """Our full weights (experts by global id) -> MixtralForCausalLM's state dict in the Hub's layout."""
    return {**to_hf(full, m), **{k: v.contiguous() for k, v in sparse_hf.to_hf(full, m, MIXTRAL_NAMES).items()}}


def mixtral_from_hf(hf: Weights, m: ModelConfig) -> Weights:
    """MixtralForCausalLM's state dict (the Hub's layout) -> our full backbone weights."""
    return {**from_hf(hf, m), **sparse_hf.from_hf(hf, m, MIXTRAL_NAMES)}


HF_MIXTRAL = HFAdapter(family="Mixtral", model_type="mixtral", architecture="MixtralForCausalLM", remote=None,
                       stock_config=mixtral_stock_config, check=check_mixtral_config, to_hf=mixtral_to_hf,
                       from_hf=mixtral_from_hf)
HF = HFAdapter(family="Llama", model_type="llama", architecture=ARCHITECTURE,
               remote=RemoteClass("cplm", config="CPLMConfig", module="modeling_cplm", architecture="CPLMForCausalLM"),
               stock_config=stock_config, check=check_hf_config, to_hf=to_hf, from_hf=from_hf, sparse=HF_MIXTRAL)

# RMSNorm, SwiGLU (8/3 D, a multiple of 64), RoPE, no biases
LLAMA = Backbone("llama", norm="rmsnorm", mlp="swiglu", bias=False, positions="rope", qk_norm=False, hf=HF,
                 ffn_ratio=(8, 3), ffn_multiple=64)
