"""The model's parts, each built by one class: the embedding (`Embedding`), the transformer layers
(cplm_dist.model.block) and the head (`Head`: final norm, LM head, copy head, mixed loss). The
whole model is these parts in a row (cplm_dist.model.cplm.CPLM); a pipeline stage is one of them
with DeepSpeed's tuple interface (cplm_dist.training.pipeline). What is applied to the parts after
they are built (activation checkpointing, compile) is cplm_dist.model.recompute_compile.

    spec = PartSpec.of(cfg, tp_group, device, dtype)      # what every part is built from
    x = Embedding(spec)(ids)                              # (B, T, D); sequence parallel: (T/tp, B, D)
    out = Head(spec)(x, ids, labels, tied)                # TokenLoss, (B, T) each

The state-dict keys are the parts' own (embedding.weight, layers.i.*, final_norm.weight,
lm_head.weight, copy_head.*): the checkpoint, Hugging Face and pipeline-layer-file keys, and the
names the seeded initialisation hashes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import cplm_dist.model.loss as loss
from cplm_dist.config import Config, CopyConfig, LossConfig, ModelConfig
from cplm_dist.config.backbones import backbone
from cplm_dist.megatron_compat import ModelParallelConfig, tensor_parallel
from cplm_dist.model.copy_head import CopyHead
from cplm_dist.model.core_attention import local_attention
from cplm_dist.model.documents import document_index
from cplm_dist.model.initialization import deferred_init
from cplm_dist.model.norm import make_norm
from cplm_dist.model.parallel.context import ContextParallelAttention, ContextShard
from cplm_dist.model.parallel.sequence import gather_sequence
from cplm_dist.model.parallel.sharding import mark_split
from cplm_dist.model.positions import LearnedPositions


def megatron_config(tp_size: int, device: torch.device, dtype: torch.dtype,
                    sequence_parallel: bool = False) -> ModelParallelConfig:
    return ModelParallelConfig(
        tensor_model_parallel_size=tp_size,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,  # cplm_dist.model.initialization fills weights, tp-independently
        params_dtype=dtype,
        sequence_parallel=sequence_parallel and tp_size > 1,
        gradient_accumulation_fusion=False,
    )


def vocabulary_shard(model_cfg: ModelConfig, tp_group) -> tuple[int, int, int]:
    """(padded vocabulary, this rank's shard width, its columns before Megatron's padding)."""
    tp_rank, tp_size = loss.tp_rank_size(tp_group)
    padded = loss.padded_vocab_size(model_cfg.vocab_size, model_cfg.make_vocab_size_divisible_by, tp_size)
    v_local = padded // tp_size
    start, _ = loss.vocab_range(v_local, tp_group)
    return padded, v_local, max(0, min(v_local, model_cfg.vocab_size - start))


@dataclass(frozen=True)
class PartSpec:
    """What every part is built from: the model, copy and loss sections, this rank's tp group,
    Megatron's sequence parallelism (asked for; it is on at tp > 1 only), the device and dtype."""

    model: ModelConfig
    copy: CopyConfig
    loss: LossConfig
    tp_group: object
    sequence_parallel: bool
    device: torch.device
    dtype: torch.dtype = torch.float32
    context: ContextShard | None = None  # this rank's place in its cp group (parallel.cp > 1)

    @classmethod
    def of(cls, cfg: Config, tp_group, device: torch.device, dtype: torch.dtype = torch.float32,
           sequence_parallel: bool | None = None, context: ContextShard | None = None) -> "PartSpec":
        sp = cfg.parallel.sequence_parallel if sequence_parallel is None else sequence_parallel
        return cls(cfg.model, cfg.copy, cfg.loss, tp_group, sp, device, dtype, context)

    @functools.cached_property
    def core_attention(self):
        """The attention kernel every layer is built with, chosen here once (megatron-core's
        core_attention slot, cplm_dist.model.core_attention): context-parallel at cp > 1, else
        FlexAttention's on CUDA (document masking's block masks), SDPA's elsewhere."""
        if self.context is not None:
            return ContextParallelAttention(self.context, flex=self.device.type == "cuda")
        return local_attention(self.device)

    @property
    def tp_size(self) -> int:
        return loss.tp_rank_size(self.tp_group)[1]

    @functools.cached_property
    def megatron(self) -> ModelParallelConfig:
        return megatron_config(self.tp_size, self.device, self.dtype, self.sequence_parallel)

    @property
    def sp_group(self):
        """The tp group where sequence parallelism is on (a part sees this rank's positions), else None."""
        return self.tp_group if self.megatron.sequence_parallel else None


def mark_vocabulary(weight: torch.nn.Parameter, model_cfg: ModelConfig) -> None:
    """A vocabulary-sized weight: split over tp by rows, the rows past vocab_size Megatron's padding."""
    mark_split(weight, dim=0)
    weight.full_rows = model_cfg.vocab_size  # rows past it are padding (initialised to zero)


class Embedding(torch.nn.Module):
    """ids (B, T) -> x: the vocabulary-parallel embedding, plus learned positions where the backbone
    has them; (B, T, D), or under sequence parallelism this rank's positions (T/tp, B, D)."""

    def __init__(self, spec: PartSpec, positions: bool = True):
        """positions=False: the embedding alone (a pipeline's tied copy for the head)."""
        super().__init__()
        m, mp = spec.model, spec.megatron
        padded, _, _ = vocabulary_shard(m, spec.tp_group)
        self.embedding = tensor_parallel.VocabParallelEmbedding(
            padded, m.hidden_size, init_method=deferred_init, config=mp, tp_group=spec.tp_group,
            reduce_scatter_embeddings=mp.sequence_parallel,
        )
        mark_vocabulary(self.embedding.weight, m)
        learned = positions and backbone(m).positions == "learned"
        self.position_embedding = (LearnedPositions(m.max_seq_len, m.hidden_size, device=spec.device, dtype=spec.dtype,
                                                    sp_group=spec.sp_group) if learned else None)

    def forward(self, input_ids: torch.Tensor, offset: int = 0, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x of positions offset .. offset + T - 1, or of those position_ids (B, T) name (document masking)."""
        x = self.embedding(input_ids)
        return x if self.position_embedding is None else self.position_embedding(x, offset, position_ids)


class Head(torch.nn.Module):
    """The model's last part, over the last layer's output x: the final norm, the LM head's
    vocabulary shard, the copy head and the mixed per-token loss (cplm_dist.model.loss).
    `tied`: the embedding's weight when the LM head shares it, else None (its own weight)."""

    def __init__(self, spec: PartSpec):
        super().__init__()
        m, mp = spec.model, spec.megatron
        self.copy_cfg, self.loss_cfg, self.tp_group = spec.copy, spec.loss, spec.tp_group
        self.sequence_parallel = mp.sequence_parallel
        padded, self.v_local, self.real_local = vocabulary_shard(m, spec.tp_group)
        self.final_norm = make_norm(m, device=spec.device, dtype=spec.dtype, grad_group=spec.sp_group)
        self.lm_head = tensor_parallel.ColumnParallelLinear(
            m.hidden_size, padded, config=mp, init_method=deferred_init, bias=False, gather_output=False,
            skip_weight_param_allocation=m.tie_embeddings, tp_group=spec.tp_group,
        )
        if self.lm_head.weight is not None:
            mark_vocabulary(self.lm_head.weight, m)
        self.copy_head = (CopyHead(m, spec.copy, device=spec.device, dtype=spec.dtype, sp_group=spec.sp_group)
                          if spec.copy.enabled else None)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                tied: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> loss.TokenLoss:
        return self.token_loss(self.final_norm(x), input_ids, labels, tied, position_ids)

    def lm_logits(self, h: torch.Tensor, tied: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's vocabulary shard of the LM logits (B, T, V/tp); padded ids at -inf."""
        logits, _ = self.lm_head(h, weight=tied)  # (B, T, V/tp)
        if self.real_local < self.v_local:
            logits[..., self.real_local :] = float("-inf")
        return logits

    def token_loss(self, h: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                   tied: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   context=None) -> loss.TokenLoss:
        """Per-token loss terms (B, T) of final-norm states h (sequence parallel: this rank's
        (T/tp, B, D) positions), input_ids and labels (B, T); position_ids (B, T) under document
        masking (the copy head's candidates stay in their document: cplm_dist.model.documents).
        Context parallel: `context` (cplm_dist.model.parallel.context.ContextInputs) and this
        rank's chunks, (B, T/cp) each."""
        copy = None
        if self.copy_head is not None and context is not None:
            copy = self.copy_head(h, input_ids, labels, context.docs, context.positions, context)
        elif self.copy_head is not None:
            docs = None if position_ids is None else document_index(position_ids)
            copy = self.copy_head(h, input_ids, labels, docs, position_ids)
        sp = self.sequence_parallel
        token_labels = labels.t().contiguous() if sp else labels  # the loss in the trunk's layout: (T, B) sequence parallel
        if self.loss_cfg.impl == "chunked":
            weight = tied if tied is not None else self.lm_head.weight
            if sp:  # the whole sequence; backward reduce-scatters the partial dL/dh
                h = gather_sequence(h, self.tp_group, sum_grad=True)
            z_y, lse = loss.chunked_target_logit_and_lse(h, weight, token_labels, self.tp_group, real_local=self.real_local,
                                                                   rows=self.loss_cfg.chunk_rows, sum_grad_h=not sp)
            out = loss.mixed_nll_from_lm(z_y, lse, token_labels, copy, self.copy_cfg.mix)
        else:
            out = loss.mixed_nll(self.lm_logits(h, tied), token_labels, copy, self.copy_cfg.mix, self.tp_group, inplace=True)
        return loss.TokenLoss(*(t.t() for t in out)) if sp else out
