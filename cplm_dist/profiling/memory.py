"""Per-device memory of a training step, from the config and the layout alone.

Model states (bytes per parameter held by the device, the ZeRO paper's counts, with our AdamW):

| precision | ZeRO | parameters | gradients | optimizer (m, v, fp32 master) |
|---|---|---|---|---|
| fp32 | 0 | 4 | 4 | 8 |
| fp32 | 1 | 4 | 4 | 8 / dp |
| fp32 | 2 | 4 | 4 / dp | 8 / dp |
| fp32 | 3 | 4 / dp | 4 / dp | 8 / dp |
| bf16 | 0 | 2 | 2 + 4 (DeepSpeed's fp32 gradient copy) | 12 |
| bf16 | 1 | 2 | 2 + 4 / dp (grad_accum_dtype=fp32: 2 + 4, the full fp32 accumulator) | 12 / dp |
| bf16 | 2 | 2 | 2 / dp + 4 / dp | 12 / dp |
| bf16 | 3 | 2 / dp | 2 / dp + 4 / dp | 12 / dp |

With optim.name=muon the transformer layers' matrices (and the copy head's q and k under
optim.muon.copy_head) keep one fp32 momentum buffer where AdamW keeps two moments: their optimizer
bytes are 4 (fp32) or 8 (bf16: momentum and fp32 master), / dp under ZeRO 1-2 (`muon_elements`).

where a device holds P_tp = (tp-split parameters) / tp + replicated parameters, and dp is the
group ZeRO partitions over: dp x cp under context parallelism (DeepSpeed's sequence-data-parallel
group), dp alone otherwise.

Activations saved for backward, per token, per transformer layer, counted from what our block's
autograd graph keeps, by the backbone's features (cplm_dist.config.backbones; b = bytes per
activation element; a test measures each shipped backbone with saved-tensor hooks and must agree
exactly):

    norms     2 x (4 D + 4 + 4 D + b D)     RMSNorm: fp32 input and normalised copies, 1/rms, output
              2 x (4 D + 8 + b D)           LayerNorm: fp32 input, mean and 1/std, output
    attention b (nh + 2 nkv) hd             the fused QKV output (q, k, v are views of it)
              + 4 (nh + nkv) (hd + 1)       qk-norm (qwen3): each head's fp32 normalised copy and 1/rms,
                + 4 (nh + nkv) hd             and in bf16 the fp32 casts of q and k,
                + 4 nh hd [nkv < nh]          in fp32 q's copy out of the QKV output (k is a view of it)
              + b (nh + nkv) hd             rotary positions: the rotated q, k
              + b nh hd [nkv < nh]          learned positions: q made contiguous when heads share kv
              + b nh hd + 4 nh              the SDPA output and its log-sum-exp
    MLP       b (2 F + F + F)               SwiGLU: fc1 output, SiLU(gate), SiLU(gate) * up
              b (F + F)                     GELU: fc1 output, GELU output

(nh, nkv = heads per tp rank; in bf16 each norm also keeps an fp32 copy of each of its tensors, 4 D
bytes a tensor per layer, not counted). A sparse layer (model.moe) has its MLP line from
cplm_dist.profiling.expert_cost (router, dispatcher, experts, shared expert; the grouped path's
stacked weights), and its routed experts' states are partitioned over the expert-dp ranks. With activation checkpointing a layer keeps only its input
(b D per token) and one layer's activations exist at a time, during its recomputation.

Sequence parallelism (parallel.sequence_parallel, tp > 1) keeps the norms' tensors for T/tp
positions (the tp linears keep their input shard and gather it again in backward), so the norms
line and a checkpointed layer's input are divided by tp; attention and MLP are unchanged (heads
and MLP width were already split). Outside the layers the final norm is divided by tp, and the
copy head keeps q, A_t, M_t for its own T/tp positions and k for all of them.

Outside the layers, per token: the final norm (8 D + 4 + b D), the loss's [tokens, V/tp] fp32
softmax (4 V/tp, plus the bf16 logits while they are cast; with loss.impl=chunked, one block of
loss.chunk_rows rows, 8 V/tp each plus the bf16 logits), and the copy head's fp32 q and k
(4 H_c d_c each), then by `copy.impl`:
  - dense: its (B, H_c, T, T) fp32 score tensors, the masked exponentials for A_t and M_t kept for
    backward and their gradients; measured on CPU, about 3 score-sized tensors after forward and 6
    at the backward peak, which is what is counted;
  - chunked: A_t and M_t per head (4 H_c each per token) kept for backward; during backward dq and
    dk (q-sized) and one row block's tensors, (B, H_c, chunk, T) each, 5 counted (measured on
    CPU: 4.5 block-sized tensors at T = 1024-4096, chunk 256 and 1024); with T <= chunk the
    head takes the dense path and is counted as such;
  - flex (CUDA): A_t and M_t per head, the kernel's all-zero values and its two unread outputs
    (FLEX_VALUE_DIM wide each) kept for backward, dq, dk and the values' gradient in backward
    (not yet measured on a GPU);
  - auto is counted as chunked: what it runs on CPU, and the larger of its two paths.

The peak is whichever moment is larger, on top of parameters, optimizer states and DeepSpeed's
gradient buckets:

    early backward:  all activations + the softmax buffer + the copy head's + one layer's
                     activation gradients + the vocabulary-embedding gradient (written first)
                     + with more than one micro-batch a step, the gradients the earlier ones left
                     (they accumulate until the step: found by the dry run, cplm_dist.profiling.dry_run)
    optimizer step:  all gradients + the optimizer's temporaries (torch's foreach AdamW: about
                     one fp32 copy of the parameters it updates; Muon, before AdamW runs on the
                     rest: under ZeRO 1-2 the direction all-gathered whole, one fp32 copy of its
                     matrices, at ZeRO-0 one matrix's direction; and the Newton-Schulz iteration's
                     tensors of the largest whole matrix, NS_MATRIX_TENSORS of its size and
                     NS_GRAM_TENSORS Gram-sized)
    buckets:         ZeRO 1-3 with train.contiguous_gradients: DeepSpeed 0.19.8's gradient
                     reduction buffers, train.reduce_bucket_size elements each in the gradient
                     dtype, allocated at the first backward and kept; two with overlap_comm at
                     ZeRO 1-2 (a double buffer) and two under the pipeline engine (it stages one
                     more for its own reduction); measured on CPU (docs/benchmarks.md)

On CPU the measured figure is the process's peak resident set above its size before the model
was built, with glibc told to return freed blocks at once (cplm_dist.profiling.measure).

Pipeline parallelism (parallel.pp = p > 1; DeepSpeed's 1F1B schedule, cplm_dist.training.pipeline):
the layers are split as CPLMPipe splits them, `partition(layer_parameters(cfg), p)` (pipeline
layer 0 the embedding, 1..L the transformer layers, L+1 the head), and the figure is the heaviest
stage's, each stage counted as above for its own part, with m = accumulation micro-batches a step:

    parameters  its transformer layers' (matrices / tp + the two norms), the first stage the
                embedding (V/tp x D), the last the LM head (V/tp x D: under tie_embeddings the
                tied copy, so both ends hold one), the final norm and the copy head
                (counting.tensor_sizes_per_device of the stage); gradients, optimizer states
                and the optimizer's temporaries of those only (ZeRO 0-1)
    activations stage s holds min(p - s, m) micro-batches in flight (1F1B: the first stage the
                most, the last one) of its own layers' activations (checkpointed: their inputs),
                plus per in-flight micro-batch the pipe buffers DeepSpeed keeps for backward: the
                received hidden states (stages after the first; b D per token, / tp under
                sequence parallelism; not again under checkpointing, where they are the first
                layer's saved input), the hidden states sent on (stages before the last; b D / tp
                per token: DeepSpeed keeps a tp partition of them, or the sequence shard) and the
                ids and labels (16 bytes a token)
    last stage  the final norm, the loss's logits buffer and the copy head, for one micro-batch
    transient   one layer's activation gradients (+ its recomputation) on every stage; the
                vocabulary gradient only on the stages holding a vocabulary tensor (first, last)

Context parallelism (parallel.cp = c > 1, cplm_dist.model.parallel.context; with pipeline stages
too, each stage as above for its own layers): each rank holds
T/c positions of each sequence (2 of 2c chunks), so everything counted per token above is counted
for micro x T/c tokens: the layers' activations (or their checkpointed inputs), the final norm,
the loss's logits, the rotary tables (one row a token: positions are given, (B, T/c, hd) each).
What changes inside a layer (measured with saved-tensor hooks at cp 2, both backbones, fp32, bf16
and tp 2 with sequence parallelism; a test holds the formula to it exactly):

    attention b (nh + 2 nkv) hd of the fused QKV output is no longer kept: the keys and values
              SDPA saves are the all-gathered ones, so instead
              b nh hd                        q (rotated; made contiguous for learned positions
                                             with shared heads; a view of the QKV output with
                                             learned positions and nkv = nh: b (nh + 2 nkv) hd)
              + 2 b c nkv hd                 the gathered K and V of the whole sequence (T = c x T/c
                                             positions, for each of this rank's tokens)
              + 2 b nh hd + 4 nh             each chunk's SDPA output and log-sum-exp, and their
                                             concatenation (the output projection's input)
              + 16 T per layer and sequence  the gathers' two (T,) int64 reorderings
              + qk-norm's line above         and in fp32 the fused QKV output, which k is a view of

so the gathered K/V of every layer are held for backward (SDPA needs them), not only transiently;
under checkpointing one layer's, during its recomputation. On CPU, SDPA also keeps a float copy of
each chunk's boolean mask per layer (b x rows x keys, (2c + 1) (T / 2c)^2 elements a micro-batch),
not counted: on CUDA the chunks run FlexAttention's block masks. The copy head keeps q for its own
T/c positions and the gathered keys of all T, and scores each of its two chunks against the
prefix it sees (cp rank 0's second chunk: all T keys, the largest block, counted); dense chunks
keep 3 score tensors each for backward, with 3 more of the largest at the backward peak. ZeRO
partitions over dp x cp (the table above), and the accumulation counts dp alone.

A 1F1B step lasts m + p - 1 micro-batch slots for m micro-batches of work: the bubble, the share
of the step a stage waits, is (p - 1) / (m + p - 1) (cplm_dist.profiling.planner, `bubble`). At
p = 1 every figure is the single-stage one above. Under DualPipeV (parallel.pp_schedule) a rank
holds two stages (its Stage adds them up: rank 0 the embedding and the head), p + 1/2 micro-batches
in flight on every rank (`in_flight`), and its p2p buffers both ways; its bubble is `bubble`'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from cplm_dist.config import Config
from cplm_dist.config.backbones import backbone
from cplm_dist.model.copy_lse import FLEX_VALUE_DIM
from cplm_dist.model.layer_shapes import by_name, layer_shapes
from cplm_dist.model.loss import padded_vocab_size
from cplm_dist.model.parallel.stages import Stage, pipeline_stages, stage_parameters
from cplm_dist.profiling.expert_cost import (ExpertGroups, grouped_stack_bytes, local_expert_elements,
                                             sparse_mlp_bytes_per_token, stage_sparse_layers)
from cplm_dist.profiling.muon_cost import muon_matrices

GIB = 1024**3
COPY_SCORE_TENSORS = 6  # (B, H_c, T, T) fp32 tensors alive at the dense copy head's peak (measured)
COPY_BLOCK_TENSORS = 5  # (B, H_c, chunk, T) fp32 tensors at the chunked path's peak (measured 4.5)
NS_MATRIX_TENSORS = 5  # matrix-sized fp32 tensors of one Newton-Schulz step: the gathered U, X, its update, a X, the result
NS_GRAM_TENSORS = 3  # (min, min) tensors of one step: X X^T, its square, b A + c A^2


@dataclass
class MemoryEstimate:
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    copy_head: float
    backward_transient: float  # one layer's activation gradients (+ its recomputation) + the embedding gradient
    optimizer_transient: float
    accumulated_gradients: float = 0.0  # the gradients held while a later micro-batch runs (accumulation > 1)
    buckets: float = 0.0  # DeepSpeed's gradient reduction buffers

    @property
    def early_backward(self) -> float:
        return self.activations + self.logits + self.copy_head + self.backward_transient + self.accumulated_gradients

    @property
    def optimizer_step(self) -> float:
        return self.gradients + self.optimizer_transient

    @property
    def total(self) -> float:
        return self.parameters + self.optimizer + self.buckets + max(self.early_backward, self.optimizer_step)

    def as_dict(self) -> dict:
        return {**asdict(self), "early_backward": self.early_backward, "optimizer_step": self.optimizer_step,
                "total": self.total}


def in_flight(stage: Stage, accumulation: int) -> float:
    """Micro-batches whose activations stage s holds at once: min(p - s, m) under 1F1B; under
    DualPipeV p + 1/2 on every rank (counted in micro-batches through both of its stages: the
    phase-0 forwards it runs ahead while the first ones come back, as DeepSpeed's schedule orders
    them; checked against it in tests/test_pipeline_schedule.py)."""
    if stage.chunks == 2:
        return min(stage.stages + 0.5, accumulation)
    return min(stage.stages - stage.index, accumulation)


def bubble(pp: int, accumulation: int, schedule: str = "1f1b") -> float:
    """The share of a step a pipeline rank idles: (p - 1) / (m + p - 1) under 1F1B; under
    DualPipeV (two half-stages a rank, the backward twice the forward F of a stage, weight
    gradients inside the backward as DeepSpeed runs it) the idle time is 2 (p - 1) F - F / 2
    against 3 m F of work: (2p - 2.5) / (3m + 2p - 2.5)."""
    if pp == 1:
        return 0.0
    if schedule == "dualpipev":
        idle = 2 * (pp - 1) - 0.5
        return idle / (3 * accumulation + idle)
    return (pp - 1) / (accumulation + pp - 1)


def state_bytes_per_parameter(precision: str, zero: int, dp: int,
                              grad_accum_dtype: str | None = None) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes per parameter a device holds, as the table above;
    `dp` the ranks ZeRO partitions over (dp x cp under context parallelism)."""
    if precision == "fp32":
        params, grads, optim = 4.0, 4.0, 8.0
        return (params / dp if zero >= 3 else params, grads / dp if zero >= 2 else grads, optim / dp if zero >= 1 else optim)
    params, low_grads, fp32_grads, optim = 2.0, 2.0, 4.0, 12.0
    full_fp32_grads = zero == 0 or (zero == 1 and grad_accum_dtype == "fp32")  # BF16_Optimizer's accumulator
    return (
        params / dp if zero >= 3 else params,
        (low_grads / dp if zero >= 2 else low_grads) + (fp32_grads if full_fp32_grads else fp32_grads / dp),
        optim / dp if zero >= 1 else optim,
    )


def bucket_bytes(cfg: Config, *, zero: int, pp: int, act_bytes: int, cuda: bool = True) -> float:
    """DeepSpeed's gradient reduction buffers (the module docstring's `buckets`); overlap_comm
    as the engine sets it (null: on with CUDA, off under a pipeline)."""
    t = cfg.train
    if zero == 0 or not t.contiguous_gradients:
        return 0.0
    overlap = (cuda if t.overlap_comm is None else t.overlap_comm) and pp == 1
    buffers = 2 if pp > 1 or (overlap and zero < 3) else 1
    dtype = 4 if t.grad_accum_dtype == "fp32" and zero == 1 else act_bytes
    return float(t.reduce_bucket_size) * buffers * dtype


def sequence_shards(cfg: Config, tp: int) -> int:
    """What the sequence-sharded activations are divided by: tp under sequence parallelism, else 1."""
    return tp if cfg.parallel.sequence_parallel and tp > 1 else 1


# per token, what one norm saves for backward (b bytes an activation): RMSNorm its fp32 input and
# normalised copies, 1/rms and its output; LayerNorm its fp32 input, mean and 1/std and its output
NORM_SAVED = {"rmsnorm": lambda D, b: 4 * D + 4 + 4 * D + b * D, "layernorm": lambda D, b: 4 * D + 8 + b * D}
# per token, b x this x ffn/tp bytes the MLP saves: SwiGLU fc1's [gate; up], SiLU(gate) and the
# product; GELU fc1's output and the GELU
MLP_SAVED = {"swiglu": 4, "gelu": 2}


def qk_norm_bytes_per_token(nh: int, nkv: int, hd: int, b: int, qkv_counted: bool) -> float:
    """What the qk-norm slot (RMSNorm over head_dim of each of the rank's nh query and nkv key heads,
    in fp32) saves per token: each head's normalised copy and 1/rms, and its fp32 input: in bf16
    the casts of q and k; in fp32 q's copy out of the fused QKV output when heads share kv (a view
    of it otherwise) and k, a view of that output, keeping it (`qkv_counted`: already counted)."""
    saved = 4 * (nh + nkv) * (hd + 1)
    if b != 4:
        return saved + 4 * (nh + nkv) * hd
    return saved + (4 * nh * hd if nkv < nh else 0) + (0 if qkv_counted else b * (nh + 2 * nkv) * hd)


def layer_activation_bytes_per_token(cfg: Config, tp: int, act_bytes: int, cp: int = 1, sparse: bool = False) -> float:
    """What one transformer layer saves for backward per token of this rank, from its backbone's
    features and its linears' widths (cplm_dist.model.layer_shapes; the module docstring's counts);
    under context parallelism (cp > 1) with the gathered keys and values (not counted: the
    gathers' int64 reorderings, `CP_ORDER_BYTES`). `sparse`: a layer of model.moe.sparse_layers,
    whose MLP is the sparse one (cplm_dist.profiling.expert_cost.sparse_mlp_bytes_per_token)."""
    m, b, bb = cfg.model, act_bytes, backbone(cfg.model)
    shapes = by_name(layer_shapes(replace(m, moe=replace(m.moe, num_experts=0))))  # a dense layer's (no experts to list)
    D, hd = m.hidden_size, m.head_dim
    F = shapes["mlp.fc2.weight"].local_shape(tp)[1]  # this rank's MLP width
    qkv = shapes["attention.qkv.weight"].local_shape(tp)[0]  # this rank's fused QKV width, (nh + 2 nkv) hd
    nh, nkv = m.num_heads // tp, m.num_kv_heads // tp
    norms = 2 * NORM_SAVED[bb.norm](D, b) / sequence_shards(cfg, tp)
    mlp = sparse_mlp_bytes_per_token(cfg, tp, b) if sparse else b * MLP_SAVED[bb.mlp] * F
    if cp > 1:  # q, the gathered K and V, each chunk's output and log-sum-exp and their concatenation
        q = b * qkv if bb.positions != "rope" and nkv == nh else b * nh * hd
        qk_norm = qk_norm_bytes_per_token(nh, nkv, hd, b, qkv_counted=q == b * qkv) if bb.qk_norm else 0
        return norms + q + qk_norm + 2 * b * cp * nkv * hd + 2 * b * nh * hd + 4 * nh + mlp
    attention = b * qkv  # the fused QKV output
    if bb.qk_norm:
        attention += qk_norm_bytes_per_token(nh, nkv, hd, b, qkv_counted=True)
    if bb.positions == "rope":
        attention += b * (nh + nkv) * hd  # rotated q and k
    elif nkv < nh:
        attention += b * nh * hd  # q made contiguous for SDPA when heads share kv
    attention += b * nh * hd + 4 * nh  # the SDPA output and its log-sum-exp
    return norms + attention + mlp


CP_ORDER_BYTES = 16  # per layer and position of the whole sequence: the K and V gathers' (T,) int64 reorderings


def copy_head_bytes(cfg: Config, micro_batch: int, seq_len: int, tp: int = 1, cp: int = 1) -> float:
    """The copy head's activation bytes at the backward peak (module docstring), per device (at
    cp > 1 the heaviest: cp rank 0, whose second chunk scores every key)."""
    c = cfg.copy
    shards = sequence_shards(cfg, tp)
    if cp > 1:
        return _context_copy_head_bytes(cfg, micro_batch, seq_len, shards, cp)
    tokens = micro_batch * seq_len
    qk = tokens * 4 * c.num_heads * c.head_dim * (1 / shards + 1)  # q of this rank's positions, k of all
    rows = seq_len // shards  # the query rows this rank scores
    if c.impl == "flex":
        return 2 * qk + tokens / shards * 2 * 4 * c.num_heads + 4 * 4 * c.num_heads * FLEX_VALUE_DIM * tokens
    if c.impl == "dense" or seq_len <= c.chunk_size:  # one block: CopyHead takes the dense path
        return qk + micro_batch * COPY_SCORE_TENSORS * 4 * c.num_heads * rows * seq_len
    block = micro_batch * 4 * c.num_heads * min(c.chunk_size, rows) * seq_len
    return 2 * qk + tokens / shards * 2 * 4 * c.num_heads + COPY_BLOCK_TENSORS * block


def _context_copy_head_bytes(cfg: Config, micro_batch: int, seq_len: int, shards: int, cp: int) -> float:
    """copy_head_bytes under context parallelism: q of this rank's rows, the gathered keys of all
    seq_len positions, and each run of consecutive rows (a chunk, or its sequence shard) scored
    against the prefix it sees by its own path (dense, chunked, flex: CopyHead.lse_path's rule);
    the heaviest tp rank of cp rank 0 (its second chunk ends at the last position)."""
    from cplm_dist.model.parallel.context import ContextShard

    c = cfg.copy
    H, d = c.num_heads, c.head_dim
    local = seq_len // cp
    q_rows = local // shards
    qk = 4 * H * d * micro_batch * (q_rows + seq_len)  # q of this rank's rows, k of every position
    am = micro_batch * q_rows * 2 * 4 * H  # A_t and M_t per head, kept for backward
    shard, worst = ContextShard(0, cp), 0.0
    for r in range(shards):
        runs = [(b - a, pos + b - a) for a, b, pos in shard.runs(r * q_rows, (r + 1) * q_rows, local)]  # (rows, keys)
        if c.impl == "flex":
            total = 2 * qk + am + 4 * H * FLEX_VALUE_DIM * micro_batch * (2 * sum(k for _, k in runs) + 2 * q_rows)
        else:
            scores = micro_batch * 4 * H
            dense = [scores * n * k for n, k in runs if c.impl == "dense" or k <= c.chunk_size]
            blocks = [scores * min(c.chunk_size, n) * k for n, k in runs if not (c.impl == "dense" or k <= c.chunk_size)]
            saved = COPY_SCORE_TENSORS // 2  # of a dense run's score tensors, kept for backward (the rest at its backward)
            total = qk + saved * sum(dense) + max([saved * x for x in dense] + [COPY_BLOCK_TENSORS * x for x in blocks])
            if blocks:  # the chunked path also keeps A_t, M_t and makes dq, dk in backward
                total += qk + am
        worst = max(worst, total)
    return worst


def estimate(cfg: Config, *, tp: int, dp: int, micro_batch: int, seq_len: int, zero: int | None = None,
             precision: str | None = None, activation_checkpointing: bool | None = None, pp: int | None = None,
             accumulation: int | None = None, cp: int | None = None) -> MemoryEstimate:
    """Bytes per device for one training step of `micro_batch` sequences of `seq_len` tokens: at
    pp > 1 the heaviest pipeline stage's (the module docstring). pp and cp default to parallel.pp
    and parallel.cp (dp is the data-parallel size alone: dp x cp ranks partition ZeRO's states),
    accumulation (the micro-batches a step, which bound those in flight) to
    train.global_batch_size / (micro_batch x dp)."""
    return max(stage_estimates(cfg, tp=tp, dp=dp, micro_batch=micro_batch, seq_len=seq_len, zero=zero,
                               precision=precision, activation_checkpointing=activation_checkpointing, pp=pp,
                               accumulation=accumulation, cp=cp), key=lambda e: e.total)


def stage_estimates(cfg: Config, *, tp: int, dp: int, micro_batch: int, seq_len: int, zero: int | None = None,
                    precision: str | None = None, activation_checkpointing: bool | None = None, pp: int | None = None,
                    accumulation: int | None = None, cp: int | None = None) -> list[MemoryEstimate]:
    """`estimate` of every pipeline stage, in stage order (one at pp = 1)."""
    pp = cfg.parallel.pp if pp is None else pp
    cp = cfg.parallel.cp if cp is None else cp
    if seq_len % cp:
        raise ValueError(f"seq_len={seq_len} is not divisible by cp={cp}")
    if accumulation is None:
        accumulation = max(1, cfg.train.global_batch_size // (micro_batch * dp))
    return [_stage_estimate(cfg, stage, tp=tp, dp=dp, micro_batch=micro_batch, seq_len=seq_len, zero=zero,
                            precision=precision, activation_checkpointing=activation_checkpointing,
                            accumulation=accumulation, cp=cp) for stage in pipeline_stages(cfg, pp, tp)]


def _stage_estimate(cfg: Config, stage: Stage, *, tp: int, dp: int, micro_batch: int, seq_len: int, zero: int | None,
                    precision: str | None, activation_checkpointing: bool | None, accumulation: int,
                    cp: int = 1) -> MemoryEstimate:
    t, m, c = cfg.train, cfg.model, cfg.copy
    zero = t.zero_stage if zero is None else zero
    precision = t.precision if precision is None else precision
    ckpt = t.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    b = 2 if precision == "bf16" else 4
    tokens = micro_batch * seq_len // cp  # this rank's positions of its micro-batch
    n_local = stage_parameters(cfg, stage, tp)
    partitions = dp * cp  # ZeRO partitions over dp x cp
    p_b, g_b, o_b = state_bytes_per_parameter(precision, zero, partitions, t.grad_accum_dtype)
    # a sparse model's routed experts: partitioned over the expert-dp ranks (cplm_dist.profiling.expert_cost)
    n_experts = local_expert_elements(cfg, stage, tp)
    _, ge_b, oe_b = state_bytes_per_parameter(precision, zero, ExpertGroups.of(cfg, tp=tp, cp=cp, dp=dp).expert_dp,
                                              t.grad_accum_dtype)
    grads = (n_local - n_experts) * g_b + n_experts * ge_b
    sparse = stage_sparse_layers(cfg, stage, tp)
    dense_layer = layer_activation_bytes_per_token(cfg, tp, b, cp)
    sparse_layer = layer_activation_bytes_per_token(cfg, tp, b, cp, sparse=True) if sparse else 0.0
    stack = grouped_stack_bytes(cfg, b)  # per sparse layer and micro-batch, kept for backward
    per_layer = max(dense_layer, sparse_layer)  # the heaviest one layer (its gradients, its recomputation)
    shards = sequence_shards(cfg, tp)
    if stage.stages == 1:  # the whole model, one micro-batch at a time
        layers, held, buffers = m.num_layers, 1, 0.0
    else:
        layers, held = stage.layers, in_flight(stage, accumulation)
        received = b * m.hidden_size / shards  # per token: gathered whole unless sequence-sharded
        sent = b * m.hidden_size / tp  # DeepSpeed keeps a tp partition of what it sent (or the sp shard)
        if stage.chunks == 2:  # DualPipeV: every rank receives and sends, and sends whole tensors
            receives, sends, sent = True, True, b * m.hidden_size / shards
        else:
            receives, sends = not stage.first, not stage.last
        buffers = held * tokens * (16 + received * (receives and not ckpt) + sent * sends)
    order = CP_ORDER_BYTES * seq_len if cp > 1 else 0.0  # per layer: the K and V gathers' (T,) int64 reorderings
    if ckpt:
        activations = held * tokens * (layers * b * m.hidden_size) / shards
        recompute = tokens * per_layer + order + (stack if sparse else 0.0)
    else:
        kept = (layers - sparse) * dense_layer + sparse * sparse_layer
        activations = held * (tokens * kept + layers * order + sparse * stack)
        recompute = 0.0
    # the rotary tables: (T, hd) cos and sin, or under cp one row a token of this rank (positions given)
    outside = 2 * 4 * (tokens if cp > 1 else seq_len) * m.head_dim
    if stage.last:  # the final norm
        outside = tokens * (8 * m.hidden_size + 4 + b * m.hidden_size) / shards + outside
    activations += buffers + outside
    v_local = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) / tp
    logits = copy_head = 0.0
    if stage.last:
        if cfg.loss.impl == "chunked":  # one row block at a time: its fp32 logits and their exp / gradient, its bf16 logits
            logits = min(tokens, cfg.loss.chunk_rows) * v_local * (8 + (b if b != 4 else 0))
        else:
            logits = tokens * v_local * (4 + (b if b != 4 else 0))
        if c.enabled:
            copy_head = copy_head_bytes(cfg, micro_batch, seq_len, tp, cp)
    embedding_grad = v_local * m.hidden_size * (g_b if zero < 2 else b) if stage.first or stage.last else 0.0
    optimizer, optimizer_transient = optimizer_bytes(cfg, stage, tp, n_local - n_experts, o_b, zero, partitions)
    optimizer += n_experts * oe_b
    optimizer_transient += 4 * n_experts / (ExpertGroups.of(cfg, tp=tp, cp=cp, dp=dp).expert_dp if zero >= 1 else 1)
    return MemoryEstimate(
        parameters=n_local * p_b,
        gradients=grads,
        optimizer=optimizer,
        activations=activations,
        logits=logits,
        copy_head=copy_head,
        backward_transient=recompute + tokens * per_layer + embedding_grad,
        optimizer_transient=optimizer_transient,
        accumulated_gradients=grads if accumulation > 1 else 0.0,
        buckets=bucket_bytes(cfg, zero=zero, pp=stage.stages, act_bytes=b),
    )


def muon_elements(cfg: Config, stage: Stage, tp: int) -> tuple[float, float, float]:
    """(elements of the Muon matrices one rank of `stage` holds, the largest whole matrix's
    elements, its smaller side; cplm_dist.profiling.muon_cost.muon_matrices); (0, 0, 0) with AdamW."""
    if cfg.optim.name != "muon":
        return 0.0, 0.0, 0.0
    matrices = muon_matrices(cfg, stage)
    if not matrices:
        return 0.0, 0.0, 0.0
    local = sum(shape[0] * shape[1] // (tp if split else 1) for shape, split, _ in matrices)
    largest = max((shape for shape, _, _ in matrices), key=lambda shape: shape[0] * shape[1])
    return float(local), float(largest[0] * largest[1]), float(min(largest))


def optimizer_bytes(cfg: Config, stage: Stage, tp: int, n_local: float, o_b: float, zero: int,
                     partitions: int) -> tuple[float, float]:
    """(optimizer state bytes, the step's temporaries) of one rank: AdamW's for all its
    parameters, or with Muon one fp32 moment fewer for its matrices and the larger of AdamW's and
    Muon's temporaries (they run one after the other)."""
    shards = partitions if zero >= 1 else 1
    muon, largest, side = muon_elements(cfg, stage, tp)
    state = n_local * o_b - 4 * muon / shards
    adamw_transient = 4 * (n_local - muon) / shards
    if not muon:
        return state, adamw_transient
    direction = 4 * muon if zero >= 1 else 4 * largest  # U gathered over the partition group, or one matrix
    iteration = 4 * (NS_MATRIX_TENSORS * largest + NS_GRAM_TENSORS * side * side)
    return state, max(adamw_transient, direction + iteration)


def largest_micro_batch(cfg: Config, device_bytes: float, *, tp: int, dp: int, seq_len: int, headroom: float = 0.9,
                        **kw) -> int:
    """The largest micro-batch whose estimate fits in `headroom` x device memory (0: not even 1)."""
    best, mb = 0, 1
    while estimate(cfg, tp=tp, dp=dp, micro_batch=mb, seq_len=seq_len, **kw).total <= headroom * device_bytes:
        best, mb = mb, mb * 2
    lo, hi = best, mb
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if estimate(cfg, tp=tp, dp=dp, micro_batch=mid, seq_len=seq_len, **kw).total <= headroom * device_bytes:
            lo = mid
        else:
            hi = mid
    return lo
