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

where a device holds P_tp = (tp-split parameters) / tp + replicated parameters.

Activations saved for backward, per token, per transformer layer, counted from what our block's
autograd graph keeps, by the backbone's features (cplm_dist.model.backbone; b = bytes per
activation element; a test measures each shipped backbone with saved-tensor hooks and must agree
exactly):

    norms     2 x (4 D + 4 + 4 D + b D)     RMSNorm: fp32 input and normalised copies, 1/rms, output
              2 x (4 D + 8 + b D)           LayerNorm: fp32 input, mean and 1/std, output
    attention b (nh + 2 nkv) hd             the fused QKV output (q, k, v are views of it)
              + b (nh + nkv) hd             rotary positions: the rotated q, k
              + b nh hd [nkv < nh]          learned positions: q made contiguous when heads share kv
              + b nh hd + 4 nh              the SDPA output and its log-sum-exp
    MLP       b (2 F + F + F)               SwiGLU: fc1 output, SiLU(gate), SiLU(gate) * up
              b (F + F)                     GELU: fc1 output, GELU output

(nh, nkv = heads per tp rank; in bf16 each norm also keeps an fp32 copy of each of its tensors, 4 D
bytes a tensor per layer, not counted). With activation checkpointing a layer keeps only its input
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
                     one fp32 copy of the parameters it updates)
    buckets:         ZeRO 1-3 with train.contiguous_gradients: DeepSpeed 0.19.8's gradient
                     reduction buffers, train.reduce_bucket_size elements each in the gradient
                     dtype, allocated at the first backward and kept; two with overlap_comm at
                     ZeRO 1-2 (a double buffer) and two under the pipeline engine (it stages one
                     more for its own reduction); measured on CPU (docs/benchmarks.md)

On CPU the measured figure is the process's peak resident set above its size before the model
was built, with glibc told to return freed blocks at once (cplm_dist.profiling.measure).

Pipeline parallelism (parallel.pp = p > 1; DeepSpeed's 1F1B schedule, cplm_dist.model.pipeline):
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

A 1F1B step lasts m + p - 1 micro-batch slots for m micro-batches of work: the bubble, the share
of the step a stage waits, is (p - 1) / (m + p - 1) (cplm_dist.profiling.planner, `bubble`). At
p = 1 every figure is the single-stage one above.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cplm_dist.config import Config
from cplm_dist.model.backbone import backbone
from cplm_dist.model.copy_lse import FLEX_VALUE_DIM
from cplm_dist.model.stages import Stage, pipeline_stages, stage_parameters
from cplm_dist.vocab_parallel import padded_vocab_size

GIB = 1024**3
COPY_SCORE_TENSORS = 6  # (B, H_c, T, T) fp32 tensors alive at the dense copy head's peak (measured)
COPY_BLOCK_TENSORS = 5  # (B, H_c, chunk, T) fp32 tensors at the chunked path's peak (measured 4.5)


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


def in_flight(stage: Stage, accumulation: int) -> int:
    """Micro-batches whose activations stage s holds at once under 1F1B: min(p - s, m)."""
    return min(stage.stages - stage.index, accumulation)


def bubble(pp: int, accumulation: int) -> float:
    """The share of a 1F1B step a stage idles: (p - 1) / (m + p - 1)."""
    return (pp - 1) / (accumulation + pp - 1)


def state_bytes_per_parameter(precision: str, zero: int, dp: int,
                              grad_accum_dtype: str | None = None) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes per parameter a device holds, as the table above."""
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


def layer_activation_bytes_per_token(cfg: Config, tp: int, act_bytes: int) -> float:
    """What one transformer layer saves for backward per token, from its backbone's features (the
    module docstring's counts)."""
    m, b, bb = cfg.model, act_bytes, backbone(cfg.model)
    D, F, hd = m.hidden_size, m.ffn_hidden_size // tp, m.head_dim
    nh, nkv = m.num_heads // tp, m.num_kv_heads // tp
    norms = 2 * NORM_SAVED[bb.norm](D, b) / sequence_shards(cfg, tp)
    attention = b * (nh + 2 * nkv) * hd  # the fused QKV output
    if bb.positions == "rope":
        attention += b * (nh + nkv) * hd  # rotated q and k
    elif nkv < nh:
        attention += b * nh * hd  # q made contiguous for SDPA when heads share kv
    attention += b * nh * hd + 4 * nh  # the SDPA output and its log-sum-exp
    return norms + attention + b * MLP_SAVED[bb.mlp] * F


def copy_head_bytes(cfg: Config, micro_batch: int, seq_len: int, tp: int = 1) -> float:
    """The copy head's activation bytes at the backward peak (module docstring), per device."""
    c = cfg.copy
    shards = sequence_shards(cfg, tp)
    tokens = micro_batch * seq_len
    qk = tokens * 4 * c.num_heads * c.head_dim * (1 / shards + 1)  # q of this rank's positions, k of all
    rows = seq_len // shards  # the query rows this rank scores
    if c.impl == "flex":
        return 2 * qk + tokens / shards * 2 * 4 * c.num_heads + 4 * 4 * c.num_heads * FLEX_VALUE_DIM * tokens
    if c.impl == "dense" or seq_len <= c.chunk_size:  # one block: CopyHead takes the dense path
        return qk + micro_batch * COPY_SCORE_TENSORS * 4 * c.num_heads * rows * seq_len
    block = micro_batch * 4 * c.num_heads * min(c.chunk_size, rows) * seq_len
    return 2 * qk + tokens / shards * 2 * 4 * c.num_heads + COPY_BLOCK_TENSORS * block


def estimate(cfg: Config, *, tp: int, dp: int, micro_batch: int, seq_len: int, zero: int | None = None,
             precision: str | None = None, activation_checkpointing: bool | None = None, pp: int | None = None,
             accumulation: int | None = None) -> MemoryEstimate:
    """Bytes per device for one training step of `micro_batch` sequences of `seq_len` tokens: at
    pp > 1 the heaviest pipeline stage's (the module docstring). pp defaults to parallel.pp,
    accumulation (the micro-batches a step, which bound those in flight) to
    train.global_batch_size / (micro_batch x dp)."""
    return max(stage_estimates(cfg, tp=tp, dp=dp, micro_batch=micro_batch, seq_len=seq_len, zero=zero,
                               precision=precision, activation_checkpointing=activation_checkpointing, pp=pp,
                               accumulation=accumulation), key=lambda e: e.total)


def stage_estimates(cfg: Config, *, tp: int, dp: int, micro_batch: int, seq_len: int, zero: int | None = None,
                    precision: str | None = None, activation_checkpointing: bool | None = None, pp: int | None = None,
                    accumulation: int | None = None) -> list[MemoryEstimate]:
    """`estimate` of every pipeline stage, in stage order (one at pp = 1)."""
    pp = cfg.parallel.pp if pp is None else pp
    if accumulation is None:
        accumulation = max(1, cfg.train.global_batch_size // (micro_batch * dp))
    return [_stage_estimate(cfg, stage, tp=tp, dp=dp, micro_batch=micro_batch, seq_len=seq_len, zero=zero,
                            precision=precision, activation_checkpointing=activation_checkpointing,
                            accumulation=accumulation) for stage in pipeline_stages(cfg, pp, tp)]


def _stage_estimate(cfg: Config, stage: Stage, *, tp: int, dp: int, micro_batch: int, seq_len: int, zero: int | None,
                    precision: str | None, activation_checkpointing: bool | None, accumulation: int) -> MemoryEstimate:
    t, m, c = cfg.train, cfg.model, cfg.copy
    zero = t.zero_stage if zero is None else zero
    precision = t.precision if precision is None else precision
    ckpt = t.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    b = 2 if precision == "bf16" else 4
    tokens = micro_batch * seq_len
    n_local = stage_parameters(cfg, stage, tp)
    p_b, g_b, o_b = state_bytes_per_parameter(precision, zero, dp, t.grad_accum_dtype)
    per_layer = layer_activation_bytes_per_token(cfg, tp, b)
    shards = sequence_shards(cfg, tp)
    if stage.stages == 1:  # the whole model, one micro-batch at a time
        layers, held, buffers = m.num_layers, 1, 0.0
    else:
        layers, held = stage.layers, in_flight(stage, accumulation)
        received = b * m.hidden_size / shards  # per token: gathered whole unless sequence-sharded
        sent = b * m.hidden_size / tp  # DeepSpeed keeps a tp partition of what it sent (or the sp shard)
        buffers = held * tokens * (16 + received * (not stage.first and not ckpt) + sent * (not stage.last))
    if ckpt:
        activations = held * tokens * (layers * b * m.hidden_size) / shards
        recompute = tokens * per_layer
    else:
        activations = held * tokens * layers * per_layer
        recompute = 0.0
    outside = 2 * 4 * seq_len * m.head_dim  # the rotary tables
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
            copy_head = copy_head_bytes(cfg, micro_batch, seq_len, tp)
    embedding_grad = v_local * m.hidden_size * (g_b if zero < 2 else b) if stage.first or stage.last else 0.0
    return MemoryEstimate(
        parameters=n_local * p_b,
        gradients=n_local * g_b,
        optimizer=n_local * o_b,
        activations=activations,
        logits=logits,
        copy_head=copy_head,
        backward_transient=recompute + tokens * per_layer + embedding_grad,
        optimizer_transient=4 * n_local / (dp if zero >= 1 else 1),
        accumulated_gradients=n_local * g_b if accumulation > 1 else 0.0,
        buckets=bucket_bytes(cfg, zero=zero, pp=stage.stages, act_bytes=b),
    )


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
