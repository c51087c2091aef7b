"""One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)); the norm and MLP
are the backbone's (its record's `norm` and `mlp`, cplm_dist.config.backbones; layer `index` of a
sparse model's model.moe.sparse_layers has megatron's MoE layer instead: cplm_dist.model.moe), the attention's
kernel the model's (`PartSpec.core_attention`: SDPA, FlexAttention or context-parallel), its
parameters' shapes cplm_dist.model.layer_shapes.

Under sequence parallelism x is this rank's (T/tp, B, D) positions: norms and residuals run on
them, the attention and MLP linears gather and scatter the sequence (megatron-core).

How a layer runs in training is set after it is built (cplm_dist.model.recompute_compile), the same for
the whole model and a pipeline stage: `recompute` (activation checkpointing: only the input is kept,
the layer runs again in backward) and `compiled` (its `block` compiled). With a cache the layer
runs its `block` itself: decoding compiles the whole step around it (cplm_dist.model.static_decode).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from cplm_dist.model.attention import Attention
from cplm_dist.model.mlp import make_mlp
from cplm_dist.model.moe import SparseMLP
from cplm_dist.model.moe_recompute import checkpoint_contexts
from cplm_dist.model.norm import make_norm
from cplm_dist.model.parts import PartSpec
from cplm_dist.model.static_cache import StaticKV


class TransformerLayer(torch.nn.Module):
    def __init__(self, spec: PartSpec, index: int = 0):
        super().__init__()
        m, mp = spec.model, spec.megatron
        # norms see this rank's positions only under sequence parallelism (their gradients summed over tp)
        self.attn_norm = make_norm(m, device=spec.device, dtype=mp.params_dtype, grad_group=spec.sp_group)
        self.attention = Attention(m, mp, spec.tp_group, spec.tp_size, spec.core_attention, device=spec.device)
        self.mlp_norm = make_norm(m, device=spec.device, dtype=mp.params_dtype, grad_group=spec.sp_group)
        if index in m.moe.sparse_layers(m.num_layers):  # a sparse layer: megatron's MoE layer (cplm_dist.model.moe)
            self.mlp = SparseMLP(m, spec.tp_group, spec.tp_size, spec.sequence_parallel, index, mp.params_dtype, spec.device)
        else:
            self.mlp = make_mlp(m, mp, spec.tp_group, spec.tp_size)
        self.recompute = False  # activation checkpointing in training (recompute_compile)
        self.compiled = None  # torch.compile'd `block`, run in training and evaluation without a cache (recompute_compile)

    def block(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, masks,
              cache: StaticKV | None = None) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x), cos, sin, masks, cache)
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, masks,
                cache: StaticKV | None = None) -> torch.Tensor:
        """x (B, T, D) or sequence parallel (T/tp, B, D); cos/sin for all T positions (None:
        learned positions); `masks` what the layers' core attention built for this forward
        (`self.attention.core.masks`: causal, block-causal under document masking, a cp rank's
        chunks); `cache` (decoding) extended in place."""
        if cache is not None:
            return self.block(x, cos, sin, masks, cache)
        block = self.compiled if self.compiled is not None else self.block
        if self.recompute and self.training and torch.is_grad_enabled():
            # a sparse layer's recomputation replays its routing counts (cplm_dist.model.moe_recompute)
            return torch.utils.checkpoint.checkpoint(block, x, cos, sin, masks, use_reentrant=False,
                                                     context_fn=checkpoint_contexts)
        return block(x, cos, sin, masks)
