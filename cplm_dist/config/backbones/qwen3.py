"""The qwen3 backbone (Llama's: RMSNorm, SwiGLU, RoPE, GQA, no biases; plus queries and keys
RMS-normalised per head before RoPE, and its own head width model.head_dim) and its HF adapter onto
transformers' `Qwen3ForCausalLM`, used both ways (cplm_dist.config.backbones.hf_adapter): Llama's map
(llama.py) plus the q/k norms. `model.init_from: <local HF Qwen3 directory>` imports at any tp (the
copy head starts fresh); tools/export_hf.py writes a stock `Qwen3ForCausalLM` (copy off, no remote
code) or our `CPLMQwen3ForCausalLM` (copy on: cplm_dist/interop/hf/remote/modeling_cplm_qwen3.py).

| ours | HF Qwen3 |
|---|---|
| layers.i.attention.q_norm.weight, k_norm.weight [head_dim], shared by the heads | model.layers.i.self_attn.q_norm.weight, k_norm.weight |
| everything else | as Llama's (llama.py) |

An import is refused (one line) where transformers' Qwen3 computes something else: sliding-window
layers, attention biases, another head_dim, norm epsilon, activation or RoPE type.

A sparse qwen3 (model.moe) maps onto `Qwen3MoeForCausalLM` (`HF.sparse`, picked by
backbones.hf_adapter): this map plus the sparse layers' router and experts (sparse_hf.py);
num_experts, num_experts_per_tok, moe_intermediate_size and norm_topk_prob are model.moe's
num_experts, top_k, ffn_hidden_size and normalize, intermediate_size the dense layers'
model.ffn_hidden_size, decoder_sparse_step and mlp_only_layers its sparse layers (exported as
step 1 and the dense layers listed). Its copy-on export is the same remote class, which builds
transformers' Qwen3MoeSparseMoeBlock in the layers config.json makes sparse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import cplm_dist.config.backbones.llama as llama
import cplm_dist.config.backbones.sparse_hf as sparse_hf
from cplm_dist.config.backbones.hf_adapter import HFAdapter, RemoteClass, Weights
from cplm_dist.config.backbones.record import Backbone
from cplm_dist.errors import HFImportError

if TYPE_CHECKING:  # the config package imports the records (config.validation): types only here
    from cplm_dist.config.tree import ModelConfig

ARCHITECTURE = "Qwen3ForCausalLM"
# Qwen3Config's defaults, for the keys a config.json may leave out (its head_dim is its own, not hidden / heads)
DEFAULTS = {"head_dim": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
            "layer_types": None}
QK_NORMS = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}


def stock_config(m: ModelConfig) -> dict:
    """Qwen3Config's fields for this model: Llama's (no mlp_bias key), every layer full attention."""
    fields = {k: v for k, v in llama.stock_config(m).items() if k != "mlp_bias"}
    return {**fields, "use_sliding_window": False, "sliding_window": None, "max_window_layers": m.num_layers,
            "layer_types": ["full_attention"] * m.num_layers, "attention_dropout": 0.0}


def sliding_layers(hf: dict) -> list[int]:
    """The layers transformers' Qwen3 runs with sliding-window attention: config.json's layer_types,
    else (Qwen3Config's rule) from max_window_layers on when use_sliding_window is set."""
    types = hf["layer_types"]
    if types is None:
        window = hf["sliding_window"] if hf["use_sliding_window"] else None
        types = ["sliding_attention" if window is not None and i >= hf["max_window_layers"] else "full_attention"
                 for i in range(hf["num_hidden_layers"])]
    return [i for i, kind in enumerate(types) if kind != "full_attention"]


def check_hf_config(hf: dict, m: ModelConfig, where: str) -> None:
    """One line naming the first field where the HF Qwen3 (its model_type checked by the directory
    side) and the config disagree, or a Qwen3 variant the backbone does not compute."""
    hf = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    sliding = sliding_layers({"num_hidden_layers": m.num_layers, **hf})
    if sliding:
        raise HFImportError(f"{where}: sliding-window attention on layers {sliding} (use_sliding_window="
                            f"{str(hf['use_sliding_window']).lower()}, layer_types); the CPLM qwen3 attends to every "
                            "earlier position on every layer: not importable (a Qwen3 with use_sliding_window=false is)")
    llama.check_hf_config(hf, m, where, family="Qwen3")


def to_hf(full: Weights, m: ModelConfig) -> Weights:
    """Our full weights -> Qwen3ForCausalLM's state dict, plus the copy head's (same names) if any."""
    out = llama.to_hf(full, m)
    for i in range(m.num_layers):
        out.update({f"model.layers.{i}.{theirs}": full[f"layers.{i}.{ours}"].contiguous() for ours, theirs in QK_NORMS.items()})
    return out


def from_hf(hf: Weights, m: ModelConfig) -> Weights:
    """Qwen3ForCausalLM's state dict -> our full backbone weights (no copy head)."""
    full = llama.from_hf(hf, m)
    for i in range(m.num_layers):
        full.update({f"layers.{i}.{ours}": hf[f"model.layers.{i}.{theirs}"] for ours, theirs in QK_NORMS.items()})
    return full


# --- Qwen3-MoE: a sparse qwen3 (model.moe) ------------------------------------------------------

MOE_ARCHITECTURE = "Qwen3MoeForCausalLM"
MOE_DEFAULTS = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False, "num_experts": 128,
                "num_experts_per_tok": 8, "moe_intermediate_size": 768}  # Qwen3MoeConfig's
MOE_NAMES = sparse_hf.ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")


def moe_stock_config(m: ModelConfig) -> dict:
    """Qwen3MoeConfig's fields: Qwen3's (its attention has no per-layer window keys) and the experts'."""
    sparse_hf.refuse_export(m, "Qwen3-MoE")
    fields = {k: v for k, v in stock_config(m).items() if k not in ("layer_types", "max_window_layers")}
    e = m.moe
    return {**fields, "num_experts": e.num_experts, "num_experts_per_tok": e.top_k,
            "moe_intermediate_size": sparse_hf.expert_width(m), "norm_topk_prob": e.normalize,
            **sparse_hf.sparse_layer_keys(m), "output_router_logits": False, "router_aux_loss_coef": e.aux_loss_coeff}


def check_moe_config(hf: dict, m: ModelConfig, where: str) -> None:
    """Qwen3's checks (its window covers every layer in Qwen3-MoE), then the sparse layers and the
    experts; model.moe options Qwen3-MoE does not compute are refused first."""
    why = sparse_hf.unsupported(m, "Qwen3-MoE")
    if why is not None:
        raise HFImportError(f"{where}: {why}")
    hf = {**MOE_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    hf["num_experts"] = hf.get("num_local_experts", hf["num_experts"])  # transformers 5 writes num_local_experts
    step, only = hf["decoder_sparse_step"], hf["mlp_only_layers"]
    layers = hf.get("num_hidden_layers", m.num_layers)
    hf_sparse = sparse_hf.hf_sparse_layers(layers, step, only)
    dense = {**hf, "max_window_layers": 0, "layer_types": None}  # Qwen3MoeAttention: the window on every layer
    if len(hf_sparse) == layers:  # no dense layer: intermediate_size is no weight's shape
        dense["intermediate_size"] = m.ffn_hidden_size
    check_hf_config(dense, m, where)
    sparse_hf.check_sparse_layers(hf_sparse, f"decoder_sparse_step={step}, mlp_only_layers={only}", m, where)
    sparse_hf.check_experts({"num_experts": ("num_experts", hf["num_experts"]),
                             "top_k": ("num_experts_per_tok", hf["num_experts_per_tok"]),
                             "ffn_hidden_size": ("moe_intermediate_size", hf["moe_intermediate_size"]),
                             "normalize": ("norm_topk_prob", bool(hf["norm_topk_prob"]))}, m, where)


def moe_to_hf(full: Weights, m: ModelConfig) -> Weights:
    """Our full weights (experts by global id) -> Qwen3MoeForCausalLM's state dict in the Hub's layout."""
    return {**to_hf(full, m), **{k: v.contiguous() for k, v in sparse_hf.to_hf(full, m, MOE_NAMES).items()}}


def moe_from_hf(hf: Weights, m: ModelConfig) -> Weights:
    """Qwen3MoeForCausalLM's state dict (per-expert or fused) -> our full backbone weights."""
    return {**from_hf(hf, m), **sparse_hf.from_hf(hf, m, MOE_NAMES)}


REMOTE = RemoteClass("cplm_qwen3", config="CPLMQwen3Config", module="modeling_cplm_qwen3",
                     architecture="CPLMQwen3ForCausalLM")
HF_MOE = HFAdapter(family="Qwen3-MoE", model_type="qwen3_moe", architecture=MOE_ARCHITECTURE, remote=REMOTE,
                   stock_config=moe_stock_config, check=check_moe_config, to_hf=moe_to_hf, from_hf=moe_from_hf)
HF = HFAdapter(family="Qwen3", model_type="qwen3", architecture=ARCHITECTURE, remote=REMOTE,
               stock_config=stock_config, check=check_hf_config, to_hf=to_hf, from_hf=from_hf, sparse=HF_MOE)

# Llama's features plus RMS-normalised queries and keys per head before RoPE; its head width is
# model.head_dim (128 in the released sizes, not hidden / heads); SwiGLU at 3 D
QWEN3 = Backbone("qwen3", norm="rmsnorm", mlp="swiglu", bias=False, positions="rope", qk_norm=True, hf=HF,
                 ffn_ratio=(3, 1), ffn_multiple=64)
