"""Grouped-query self-attention from megatron-core tensor-parallel linears and a core-attention
kernel chosen when the model is built (SDPA, FlexAttention, context-parallel:
cplm_dist.model.core_attention). RoPE on q and k where the backbone's positions are rotary; q and
k RMS-normalised per head before it where the backbone has qk-norm (Qwen3); biases on QKV and the
output projection where its record has biases (cplm_dist.config.backbones). The widths are heads x
model.head_dim, which need not be hidden_size (cplm_dist.model.layer_shapes).

QKV is one ColumnParallelLinear whose rows are laid out per kv group, Megatron's way:
[q_1 .. q_(nh/nkv), k, v] for each kv group, so an even split over tp hands every rank whole
groups (num_kv_heads % tp == 0). The output projection is a RowParallelLinear whose all-reduce
ends the tensor-parallel region.

Under sequence parallelism (mp.sequence_parallel) the layer's input and output are this rank's
positions in Megatron's sequence-first layout, (T/tp, B, D): the QKV linear all-gathers its input
along the sequence and the output projection reduce-scatters along it (megatron-core's own
sequence-parallel linears), so attention itself sees every position of its local heads.
"""

from __future__ import annotations

import torch

from cplm_dist.config import ModelConfig
from cplm_dist.megatron_compat import ModelParallelConfig, tensor_parallel
from cplm_dist.model.initialization import deferred_init
from cplm_dist.model.layer_shapes import attention_shapes, by_name
from cplm_dist.model.norm import make_qk_norms
from cplm_dist.model.parallel.sequence import sum_grad_over
from cplm_dist.model.parallel.sharding import mark_split
from cplm_dist.model.positions import apply_rope
from cplm_dist.model.static_cache import StaticKV


class Attention(torch.nn.Module):
    """Slots (megatron-core's self-attention spec): `qkv`, `q_norm` and `k_norm` (the backbone's
    qk-norm, or identities), the rotary positions, `core` (the kernel: cplm_dist.model.core_attention,
    chosen when the model is built) and `proj`. Shapes: cplm_dist.model.layer_shapes."""

    def __init__(self, cfg: ModelConfig, mp: ModelParallelConfig, tp_group, tp_size: int, core, device=None):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.heads = cfg.num_heads // tp_size  # local query heads
        self.kv_heads = cfg.num_kv_heads // tp_size  # local kv heads
        self.group = cfg.num_heads // cfg.num_kv_heads  # query heads per kv head
        self.sequence_parallel = mp.sequence_parallel and tp_size > 1
        shapes = by_name(attention_shapes(cfg))
        (qkv_out, hidden), (_, proj_in) = shapes["qkv.weight"].shape, shapes["proj.weight"].shape
        self.qkv = tensor_parallel.ColumnParallelLinear(
            hidden, qkv_out, config=mp, init_method=deferred_init, bias="qkv.bias" in shapes, gather_output=False,
            tp_group=tp_group,
        )
        # shared by every head, so each rank's gradient is its heads' part: summed over tp
        self.q_norm, self.k_norm = make_qk_norms(cfg, device=device, dtype=mp.params_dtype, grad_group=tp_group)
        self.proj = OutputLinear(proj_in, hidden, mp, tp_group, "proj.bias" in shapes)
        self.core = core
        mark_split(self.qkv.weight, dim=0)
        if self.qkv.bias is not None:
            mark_split(self.qkv.bias, dim=0)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, masks,
                cache: StaticKV | None = None) -> torch.Tensor:
        """x (B, T, D), or (T/tp, B, D) under sequence parallelism; cos/sin for all T positions
        (None: learned positions); `masks` what `self.core.masks` built for this forward (causal,
        document masking's block-causal mask, a cp rank's chunks); `cache` (decoding: a layer's
        StaticKV, cplm_dist.model.static_cache) holds the keys and values of earlier positions
        and writes these at its cursor's slots."""
        qkv, _ = self.qkv(x)  # (B, T, kv_heads * (group + 2) * hd); sequence parallel: (T, B, ..) gathered
        if self.sequence_parallel:
            qkv = qkv.transpose(0, 1)  # a view, (B, T, ..)
        B, T, _ = qkv.shape
        qkv = qkv.view(B, T, self.kv_heads, self.group + 2, self.head_dim)
        q = qkv[:, :, :, : self.group].reshape(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = qkv[:, :, :, self.group].transpose(1, 2)  # (B, nkv, T, hd)
        v = qkv[:, :, :, self.group + 1].transpose(1, 2)  # (B, nkv, T, hd)
        q, k = self.q_norm(q), self.k_norm(k)  # per head over hd, before RoPE (Qwen3); identities otherwise
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.extend(k, v)
        return self._project(self.core(q, k, v, masks), B, T)  # the kernel: (B, nh, T, hd)

    def _project(self, y: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """The heads' outputs y (B, nh, T, hd) through the output projection."""
        if self.sequence_parallel:  # (T, B, ..): the projection reduce-scatters along the sequence
            y = y.permute(2, 0, 1, 3).reshape(T, B, self.heads * self.head_dim)
        else:
            y = y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim)
        return self.proj(y)  # (B, T, D) all-reduced over tp; sequence parallel: (T/tp, B, D) reduce-scattered


class OutputLinear(tensor_parallel.RowParallelLinear):
    """The RowParallelLinear that ends a tp region (attention out, MLP down), returning one tensor.
    Its bias (gpt2) is added here, after the all-reduce or reduce-scatter: under sequence
    parallelism it meets this rank's positions only, so its gradient is summed over tp."""

    def __init__(self, in_features: int, out_features: int, mp: ModelParallelConfig, tp_group, bias: bool):
        super().__init__(in_features, out_features, config=mp, init_method=deferred_init, bias=bias,
                         input_is_parallel=True, skip_bias_add=True, tp_group=tp_group)
        mark_split(self.weight, dim=1)
        self.sp_group = tp_group if mp.sequence_parallel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = super().forward(x)
        return out if bias is None else out + sum_grad_over(bias, self.sp_group)
