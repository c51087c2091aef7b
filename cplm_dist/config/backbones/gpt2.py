"""The gpt2 backbone (LayerNorm with bias, GELU MLP, learned absolute positions, biases on every
linear) and its HF adapter onto transformers' `GPT2LMHeadModel`, used both ways
(cplm_dist.config.backbones.hf_adapter).

Import (`model.init_from: <local HF GPT-2 directory>`): a transformers `GPT2LMHeadModel` saved
with `save_pretrained` (config.json and *.safetensors) initialises the backbone at any tp; the
copy head starts fresh. GPT-2 has one K/V head a query head, so the run has
model.num_kv_heads = n_head; its learned position table cannot stretch, so model.max_seq_len =
n_positions. Export (`tools/export_hf.py`): copy off, a stock `GPT2LMHeadModel` that loads without
remote code; copy on, a `CPLMGPT2ForCausalLM` (cplm_dist/interop/hf/remote/modeling_cplm_gpt2.py, named
in config.json's auto_map) whose logits are the mixture's log-probabilities.

| ours | HF GPT-2 (Conv1D weights are [in, out]: ours transposed) |
|---|---|
| embedding.weight, position_embedding.weight | transformer.wte.weight, transformer.wpe.weight |
| layers.i.attn_norm, mlp_norm, final_norm (weight, bias) | transformer.h.i.ln_1, ln_2, transformer.ln_f |
| layers.i.attention.qkv [(nh + 2 nkv) hd, D], per kv group [q_1 .. q_g, k, v] | h.i.attn.c_attn [D, 3 D] = [q (all heads); k; v] |
| layers.i.attention.proj, mlp.fc1, mlp.fc2 | h.i.attn.c_proj, mlp.c_fc, mlp.c_proj |
| lm_head.weight (untied only) | lm_head.weight |

Grouped-query attention (model.num_kv_heads < num_heads) exports exactly: each K/V head is
repeated for the g query heads that read it (GPT-2 has no GQA). An untied model
(model.tie_embeddings=false) exports exactly: transformers 5's GPT2LMHeadModel ties lm_head to
wte only when config.json's tie_word_embeddings is true. The attention scale is 1/sqrt(hd) on both
sides (scale_attn_weights); the MLP is GELU's tanh approximation (gelu_new; gelu_pytorch_tanh is
the same function and imports too; exact "gelu" does not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cplm_dist.config.backbones.hf_adapter import HFAdapter, RemoteClass, Weights, check_shapes, check_tied
from cplm_dist.config.backbones.record import Backbone
from cplm_dist.errors import HFImportError, UsageError

if TYPE_CHECKING:  # the config package imports the records (config.validation): types only here
    from cplm_dist.config.tree import ModelConfig

ARCHITECTURE = "GPT2LMHeadModel"
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # F.gelu(approximate="tanh"), two spellings
# GPT2Config's defaults: an older config.json leaves out the keys that have them
DEFAULTS = {"n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None, "vocab_size": 50257,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "add_cross_attention": False,
            "tie_word_embeddings": True}
# (our config field, HF config key)
SHAPE_FIELDS = (("num_layers", "n_layer"), ("hidden_size", "n_embd"), ("num_heads", "n_head"), ("vocab_size", "vocab_size"))
NORMS = {"attn_norm": "ln_1", "mlp_norm": "ln_2"}
LINEARS = {"attention.proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}  # Conv1D: transposed


def stock_config(m: ModelConfig) -> dict:
    """GPT2Config's fields for this model. No token ids (GPT2Config's 50256 is not in our
    vocabulary): the export adds the tokenizer's."""
    return {"vocab_size": m.vocab_size, "n_positions": m.max_seq_len, "n_embd": m.hidden_size, "n_layer": m.num_layers,
            "n_head": m.num_heads, "n_inner": m.ffn_hidden_size, "activation_function": "gelu_new",
            "layer_norm_epsilon": m.norm_eps, "initializer_range": m.init_std, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "add_cross_attention": False, "tie_word_embeddings": m.tie_embeddings,
            "use_cache": True, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "torch_dtype": "float32"}


def check_hf_config(hf: dict, m: ModelConfig, where: str) -> None:
    """One line naming the first field where the HF GPT-2 (its model_type checked by
    the directory side) and the config disagree, or a GPT-2 variant the backbone does not compute."""
    hf = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k == "n_inner"}}
    ffn = hf["n_inner"] if hf["n_inner"] is not None else 4 * hf["n_embd"]
    check_shapes({**{ours: (theirs, hf[theirs]) for ours, theirs in SHAPE_FIELDS}, "ffn_hidden_size": ("n_inner", ffn),
                  "head_dim": ("n_embd/n_head", hf["n_embd"] // hf["n_head"])}, m, where)
    if m.num_kv_heads != hf["n_head"]:
        raise HFImportError(f"{where}: GPT-2 has a K/V head per query head (n_head={hf['n_head']}), this run has "
                            f"model.num_kv_heads={m.num_kv_heads}: set model.num_kv_heads={hf['n_head']}")
    if hf["n_positions"] != m.max_seq_len:
        raise HFImportError(f"{where}: n_positions={hf['n_positions']} but model.max_seq_len={m.max_seq_len}: set "
                            f"model.max_seq_len={hf['n_positions']} (a learned position table cannot stretch or shrink)")
    if hf["activation_function"] not in TANH_GELUS:
        raise HFImportError(f"{where}: activation_function={hf['activation_function']!r}; the CPLM gpt2 MLP is GELU's "
                            f"tanh approximation ({' or '.join(TANH_GELUS)}): not importable")
    if hf["layer_norm_epsilon"] != m.norm_eps:
        raise HFImportError(f"{where}: layer_norm_epsilon={hf['layer_norm_epsilon']} but model.norm_eps={m.norm_eps}: "
                            f"set model.norm_eps={hf['layer_norm_epsilon']}")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if bool(hf[key]) != want:
            raise HFImportError(f"{where}: {key}={str(hf[key]).lower()}; the CPLM gpt2 attention is plain causal "
                                f"self-attention at 1/sqrt(head_dim): not importable")
    check_tied(hf["tie_word_embeddings"], m, where)


def to_hf(full: Weights, m: ModelConfig) -> Weights:
    """Our full weights -> GPT2LMHeadModel's state dict (K/V heads repeated for GQA), plus the
    copy head's (same names) if any."""
    if m.head_dim * m.num_heads != m.hidden_size:
        raise UsageError(f"model.head_dim={m.head_dim}: GPT2LMHeadModel's heads are n_embd / n_head = "
                         f"{m.hidden_size // m.num_heads} wide, so this gpt2 model has no transformers export")
    g, hd = m.num_heads // m.num_kv_heads, m.head_dim
    out = {"transformer.wte.weight": full["embedding.weight"], "transformer.wpe.weight": full["position_embedding.weight"],
           "transformer.ln_f.weight": full["final_norm.weight"], "transformer.ln_f.bias": full["final_norm.bias"]}
    out.update({k: v for k, v in full.items() if k.startswith("copy_head.")})
    if not m.tie_embeddings:
        out["lm_head.weight"] = full["lm_head.weight"]
    for i in range(m.num_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            qkv = full[f"{ours}attention.qkv.{kind}"]
            qkv = qkv.view(m.num_kv_heads, g + 2, hd, *qkv.shape[1:])
            q, k, v = qkv[:, :g], qkv[:, g : g + 1].repeat_interleave(g, dim=1), qkv[:, g + 1 :].repeat_interleave(g, dim=1)
            c_attn = torch.cat([t.reshape(m.num_heads * hd, *qkv.shape[3:]) for t in (q, k, v)])
            out[f"{theirs}attn.c_attn.{kind}"] = c_attn.t() if kind == "weight" else c_attn
            for name, hf in NORMS.items():
                out[f"{theirs}{hf}.{kind}"] = full[f"{ours}{name}.{kind}"]
            for name, hf in LINEARS.items():
                tensor = full[f"{ours}{name}.{kind}"]
                out[f"{theirs}{hf}.{kind}"] = tensor.t() if kind == "weight" else tensor
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(hf: Weights, m: ModelConfig) -> Weights:
    """GPT2LMHeadModel's state dict (or a GPT2Model's, without the transformer. prefix) -> our
    full backbone weights (no copy head; model.num_kv_heads = num_heads, check_hf_config)."""
    if not any(k.startswith("transformer.") for k in hf):
        hf = {f"transformer.{k}": v for k, v in hf.items()}  # the original checkpoints' names
    hd = m.head_dim
    full = {"embedding.weight": hf["transformer.wte.weight"], "position_embedding.weight": hf["transformer.wpe.weight"],
            "final_norm.weight": hf["transformer.ln_f.weight"], "final_norm.bias": hf["transformer.ln_f.bias"]}
    if not m.tie_embeddings:
        full["lm_head.weight"] = hf.get("lm_head.weight", hf["transformer.wte.weight"])
    for i in range(m.num_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            c_attn = hf[f"{theirs}attn.c_attn.{kind}"]
            c_attn = c_attn.t() if kind == "weight" else c_attn  # [3 D, (D)] = [q; k; v], each nh x hd rows
            heads = c_attn.reshape(3, m.num_heads, hd, *c_attn.shape[1:]).transpose(0, 1)  # per head [q, k, v]
            full[f"{ours}attention.qkv.{kind}"] = heads.reshape(c_attn.shape)
            for name, theirs_name in NORMS.items():
                full[f"{ours}{name}.{kind}"] = hf[f"{theirs}{theirs_name}.{kind}"]
            for name, theirs_name in LINEARS.items():
                tensor = hf[f"{theirs}{theirs_name}.{kind}"]
                full[f"{ours}{name}.{kind}"] = tensor.t() if kind == "weight" else tensor
    return full


HF = HFAdapter(family="GPT-2", model_type="gpt2", architecture=ARCHITECTURE,
               remote=RemoteClass("cplm_gpt2", config="CPLMGPT2Config", module="modeling_cplm_gpt2",
                                  architecture="CPLMGPT2ForCausalLM"),
               stock_config=stock_config, check=check_hf_config, to_hf=to_hf, from_hf=from_hf)

# LayerNorm with bias, GELU MLP (4 D), learned absolute positions, biases on every linear
GPT2 = Backbone("gpt2", norm="layernorm", mlp="gelu", bias=True, positions="learned", qk_norm=False, hf=HF,
                ffn_ratio=(4, 1), ffn_multiple=1)
