"""The experts through grouped GEMM: one `torch._grouped_mm` for every local expert's fc1 and
one for fc2, in place of megatron's SequentialMLP loop of one matmul pair an expert
(model.moe.expert_impl: grouped; auto picks it on CUDA, where the loop's many small GEMMs leave
the GPU idle). The parameters are SequentialMLP's own (the same state-dict keys, the same
checkpoints); each forward stacks them into (E_local, D, F) operands. That stack is a copy of the
local experts' weights a forward (a step pays it twice with recompute): what keeping the keys
costs, against the E_local kernel launches it saves.

Same arithmetic as megatron's expert MLP: h = x W1^T per expert over its rows (tokens sorted by
expert, `tokens_per_expert` of them), the activation (SwiGLU's [gate; up] halves, or GELU), the
routing probability applied to the activation, then W2. Equal to the sequential path (fp32 on
CPU: tests/test_moe.py).
"""

from __future__ import annotations

import types

import torch


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (the grouped GEMM's backward on CPU
    refuses an expanded one)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped(x: torch.Tensor, weights: list[torch.Tensor], offsets: torch.Tensor) -> torch.Tensor:
    stacked = torch.stack(weights).transpose(1, 2)  # (E, in, out)
    return _ContiguousGrad.apply(torch._grouped_mm(x, stacked, offs=offsets))


def grouped_forward(experts, hidden: torch.Tensor, tokens_per_expert, probs: torch.Tensor):
    """SequentialMLP.forward's contract: (output rows in the input's order, None)."""
    counts = torch.as_tensor(tokens_per_expert, device=hidden.device).reshape(-1)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    local = experts.local_experts
    h = _grouped(hidden, [e.linear_fc1.weight for e in local], offsets)
    if experts.config.gated_linear_unit:
        gate, up = h.chunk(2, dim=-1)
        h = experts.config.activation_func(gate) * up
    else:
        h = experts.config.activation_func(h)
    h = (h * probs.unsqueeze(-1)).to(hidden.dtype)
    return _grouped(h, [e.linear_fc2.weight for e in local], offsets), None


def use_grouped_gemm(experts) -> None:
    """Run megatron's SequentialMLP `experts` through grouped GEMM (their parameters unchanged)."""
    experts.forward = types.MethodType(grouped_forward, experts)


def grouped_wanted(impl: str, device: torch.device) -> bool:
    """model.moe.expert_impl: grouped, sequential, or auto (grouped on CUDA)."""
    return impl == "grouped" or impl == "auto" and device.type == "cuda"


__all__ = ["grouped_forward", "grouped_wanted", "use_grouped_gemm"]
