"""Grouped-query self-attention from megatron-core tensor-parallel linears and torch SDPA.
RoPE on q and k where the backbone's positions are rotary; biases on QKV and the output projection
where its record has biases (cplm_dist.model.backbones).

QKV is one ColumnParallelLinear whose rows are laid out per kv group, Megatron's way:
[q_1 .. q_(nh/nkv), k, v] for each kv group, so an even split over tp hands every rank whole
groups (num_kv_heads % tp == 0). The output projection is a RowParallelLinear whose all-reduce
ends the tensor-parallel region.

Under sequence parallelism (mp.sequence_parallel) the layer's input and output are this rank's
positions in Megatron's sequence-first layout, (T/tp, B, D): the QKV linear all-gathers its input
along the sequence and the output projection reduce-scatters along it (megatron-core's own
sequence-parallel linears), so attention itself sees every position of its local heads.
"""

import torch
import torch.nn.functional as F

from cplm_dist.config import ModelConfig
from cplm_dist.megatron_compat import ModelParallelConfig, tensor_parallel
from cplm_dist.model.backbones import backbone
from cplm_dist.model.documents import flex_attend
from cplm_dist.model.initialization import deferred_init
from cplm_dist.model.parallel.context import ContextAttention
from cplm_dist.model.parallel.sequence import sum_grad_over
from cplm_dist.model.parallel.sharding import mark_split
from cplm_dist.model.rotary import apply_rope


class Attention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, mp: ModelParallelConfig, tp_group, tp_size: int):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.heads = cfg.num_heads // tp_size  # local query heads
        self.kv_heads = cfg.num_kv_heads // tp_size  # local kv heads
        self.group = cfg.num_heads // cfg.num_kv_heads  # query heads per kv head
        self.sequence_parallel = mp.sequence_parallel and tp_size > 1
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * self.head_dim
        bias = backbone(cfg).bias
        self.qkv = tensor_parallel.ColumnParallelLinear(
            cfg.hidden_size, qkv_out, config=mp, init_method=deferred_init, bias=bias, gather_output=False,
            tp_group=tp_group,
        )
        self.proj = OutputLinear(cfg.num_heads * self.head_dim, cfg.hidden_size, mp, tp_group, bias)
        mark_split(self.qkv.weight, dim=0)
        if bias:
            mark_split(self.qkv.bias, dim=0)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: dict | None = None,
                mask=None) -> torch.Tensor:
        """x (B, T, D), or (T/tp, B, D) under sequence parallelism; cos/sin for all T positions;
        `cache` ({"k", "v"} of earlier positions, or empty) is extended in place, for decoding one
        step at a time; `mask` (document masking, cplm_dist.model.documents): None for causal
        attention, else the block-causal mask of these queries against every key (the cache's
        too): SDPA's boolean (B, 1, T, Tk) or FlexAttention's BlockMask."""
        qkv, _ = self.qkv(x)  # (B, T, kv_heads * (group + 2) * hd); sequence parallel: (T, B, ..) gathered
        if self.sequence_parallel:
            qkv = qkv.transpose(0, 1)  # a view, (B, T, ..)
        B, T, _ = qkv.shape
        qkv = qkv.view(B, T, self.kv_heads, self.group + 2, self.head_dim)
        q = qkv[:, :, :, : self.group].reshape(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = qkv[:, :, :, self.group].transpose(1, 2)  # (B, nkv, T, hd)
        v = qkv[:, :, :, self.group + 1].transpose(1, 2)  # (B, nkv, T, hd)
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(mask, ContextAttention):
            y = mask.attend(q, k, v, enable_gqa=self.group > 1)
            return self._project(y, B, T)
        causal = mask is None
        if cache is not None:
            past = cache["k"].shape[2] if "k" in cache else 0
            if past:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)  # (B, nkv, past + T, hd)
                if mask is None:  # query i sits at position past + i and sees keys 0 .. past + i
                    mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
                causal = False
            cache["k"], cache["v"] = k, v
        if mask is not None and not isinstance(mask, torch.Tensor):  # a BlockMask (CUDA)
            y = flex_attend(q, k, v, mask, enable_gqa=self.group > 1)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                               enable_gqa=self.group > 1)  # (B, nh, T, hd)
        return self._project(y, B, T)

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
