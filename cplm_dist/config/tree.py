"""The typed config tree: one dataclass a section, `Config` their root (loading:
cplm_dist.config.loading, validation: cplm_dist.config.validation).

Fields a resumed run may change carry the mark `resumable(...)` (dataclass field metadata);
`RESUMABLE_CHANGES` lists them, derived from the marks. A resume refuses any other difference from
the saved config (the model, the copy head, the data and its order, the precision, the seed):
cplm_dist.checkpoint.manifest.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

MixMode = Literal["gate", "joint", "sentinel", "joint_gate"]
PasteMode = Literal["next", "self"]
CopyImpl = Literal["auto", "chunked", "dense", "flex"]
OptimImpl = Literal["auto", "fused", "foreach"]
OptimName = Literal["adamw", "muon"]
NsDtype = Literal["auto", "fp32", "bf16"]
LossImpl = Literal["dense", "chunked"]
TokenizerBackend = Literal["sentencepiece", "huggingface"]
Schedule = Literal["cosine", "wsd", "constant"]
Precision = Literal["fp32", "bf16"]
PipeSchedule = Literal["1f1b", "dualpipev"]
GradAccumDtype = Literal["fp32", "bf16"]
Arch = Literal["llama", "gpt2", "qwen3"]  # the backbones: cplm_dist.config.backbones's records
RopeScalingType = Literal["linear", "ntk"]
RouterScore = Literal["softmax", "sigmoid"]
AuxLoss = Literal["none", "micro_batch", "sequence", "global"]
Dispatcher = Literal["alltoall", "allgather"]
ExpertImpl = Literal["auto", "sequential", "grouped"]


def resumable(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A field a resumed run may change (the run's length, batch sizes, intervals, schedule, the
    layout within the reshape rules, logging): listed in RESUMABLE_CHANGES."""
    return field(default=default, default_factory=default_factory, metadata={"resumable": True})


@dataclass
class RopeScaling:
    """RoPE stretched for a longer context (docs/training.md, "Context extension"): `linear`
    divides the positions by `factor` (position interpolation, transformers' rope_type linear);
    `ntk` multiplies model.rope_theta by factor ** (d / (d - 2)) for head dim d (static
    "NTK-aware" scaling: exactly a larger theta)."""

    type: RopeScalingType
    factor: float  # > 1: how many times longer a context the positions are stretched to

    def scaled_theta(self, theta: float, dim: int) -> float:
        """The base RoPE runs at for head dim `dim`: ntk's theta * factor ** (dim / (dim - 2)), so
        the lowest frequency covers factor times the positions while the highest ones are nearly
        unchanged; linear keeps theta (it divides the positions)."""
        return theta * self.factor ** (dim / (dim - 2)) if self.type == "ntk" else theta


@dataclass
class MoEConfig:
    """A sparse MLP (mixture of experts: cplm_dist.model.moe, docs/moe.md) in place of the dense one
    in some layers; num_experts = 0 keeps the model dense. Built from megatron-core's MoE layer."""

    num_experts: int = 0  # experts a sparse layer holds (0: dense model)
    top_k: int = 2  # experts each token is routed to
    ffn_hidden_size: int | None = None  # one expert's width; null: model.ffn_hidden_size
    shared_ffn_hidden_size: int = 0  # a shared expert every token passes through (0: none)
    shared_gate: bool = False  # the shared expert's output scaled by sigmoid(x . w) (Qwen2-MoE's)
    first_dense_layers: int = 0  # the first layers keep the dense MLP (DeepSeek-V3's first 3)
    layer_freq: int = 1  # after them, every layer_freq-th layer is sparse (1: all)
    score: RouterScore = "softmax"  # the router's score over experts
    # softmax: the top-k probabilities renormalised to sum 1 (Qwen3, Mixtral, OLMoE: norm_topk_prob);
    # false: the top-k of a softmax over all experts. sigmoid scores are always renormalised
    normalize: bool = True
    aux_loss: AuxLoss = "micro_batch"  # the load-balancing loss: over a micro-batch, each sequence, or the step's dp ranks
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 0.0  # router z-loss (ST-MoE); 0 = off
    expert_bias: bool = False  # DeepSeek-V3's auxiliary-loss-free balancing (sigmoid score): a bias per expert, updated each step
    bias_update_rate: float = 1e-3
    capacity_factor: float | None = None  # null: dropless; else tokens over capacity x tokens/experts are dropped
    dispatcher: Dispatcher = "alltoall"  # megatron's token dispatcher across ep (and tp) ranks
    expert_impl: ExpertImpl = "auto"  # auto: grouped GEMM on CUDA, one expert after another elsewhere

    def sparse_layers(self, num_layers: int) -> list[int]:
        """The 0-based layers whose MLP is sparse (none while num_experts = 0)."""
        if self.num_experts <= 0:
            return []
        return [i for i in range(self.first_dense_layers, num_layers) if (i - self.first_dense_layers) % self.layer_freq == 0]


@dataclass
class ModelConfig:
    """The decoder: its backbone (cplm_dist.config.backbones) and shapes (the size table in docs/copy_head.md)."""

    name: str = "tiny"
    # the backbone: llama (RMSNorm, SwiGLU, RoPE, no biases), gpt2 (LayerNorm with bias, GELU MLP,
    # learned absolute positions, biases) or qwen3 (llama's, with queries and keys RMS-normalised per
    # head); the copy head and the loss are the same for all
    arch: Arch = "llama"
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 8
    num_kv_heads: int = 4
    # the width of one attention head; null: hidden_size / num_heads (filled in as the config is built,
    # so a config or checkpoint written before the field reads as it did). Qwen3's is its own (128):
    # q is num_heads x head_dim wide, k and v num_kv_heads x head_dim, whatever hidden_size is
    head_dim: int | None = None
    ffn_hidden_size: int = 256
    vocab_size: int = 512
    max_seq_len: int = 2048
    tie_embeddings: bool = True
    # a fresh run starts from these weights (cplm_dist.interop.init_from): one of our run, checkpoints/ or
    # step-* directories (any tp; weights only), or a local HF LlamaForCausalLM / GPT2LMHeadModel directory (hf_llama, hf_gpt2)
    init_from: str | None = resumable(None)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # null, or {type: linear | ntk, factor: F > 1} (context extension)
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Output projections (attention out, MLP down) start at init_std / sqrt(2 * num_layers).
    scaled_init: bool = True
    # Megatron pads the vocabulary to a multiple of this times tp; padded ids never get mass.
    make_vocab_size_divisible_by: int = 128
    moe: MoEConfig = field(default_factory=MoEConfig)  # experts (num_experts > 0): a sparse model

    def __post_init__(self):
        # null is hidden_size / num_heads; a split that is not whole stays null for validation to name
        if self.head_dim is None and isinstance(self.num_heads, int) and self.num_heads > 0 \
                and isinstance(self.hidden_size, int) and self.hidden_size % self.num_heads == 0:
            self.head_dim = self.hidden_size // self.num_heads


@dataclass
class CopyConfig:
    """The Copy-Paste head (docs/copy_head.md)."""

    enabled: bool = True
    num_heads: int = 1  # H_c
    head_dim: int = 64  # d_c
    paste: PasteMode = "next"
    mix: MixMode = "gate"
    rope: bool = False  # rotary position on the copy q/k
    init_std: float = 0.02
    gate_bias_init: float = 0.0  # gate mix: sigmoid(0) = half the mass to the LM head at init
    # gate mix: the gate reads the final hidden state detached, so its loss trains the gate's own
    # linear only, never the trunk (docs/ablation/retention.md tests it)
    gate_detach: bool = False
    # auto: chunked, and flex (fused FlexAttention kernels) training on CUDA once a GPU check has
    # recorded it for this torch (cplm_dist/model/flex_record.py); chunked: scores recomputed in
    # backward per row block; dense: the reference (docs/copy_head.md)
    impl: CopyImpl = "auto"
    chunk_size: int = 256  # query rows per block of the chunked path


@dataclass
class LossConfig:
    """How the LM side of the loss is computed (cplm_dist.model.loss); the value is the same."""

    impl: LossImpl = resumable("dense")  # chunked: logits made and differentiated `chunk_rows` rows at a time, none kept
    chunk_rows: int = resumable(1024)  # rows (tokens) per block of the chunked path (1024 x 49152 fp32: 201 MB)


@dataclass
class BlendEntry:
    """One Megatron indexed dataset (path prefix of its .bin/.idx) and its sampling weight.

    `path` may be a glob of prefixes (data/parts/web-*: web-00000.idx, ...) and `weight` may be
    `tokens` (the dataset's token count, from its .idx); cplm_dist.data.blend expands them before the
    data is read: one entry per part, its weight the entry's split by the parts' tokens, `source`
    the entry's own path, so per-source metrics stay one per entry as the config gives it."""

    path: str
    weight: float | Literal["tokens"] = 1.0
    source: str | None = None  # set on an entry expanded from a glob: the glob (its metrics' source)


@dataclass
class DataStage:
    """One stage of a staged mixture (data.stages): `blend` from the step after `from_step` on."""

    from_step: int = 0  # the stage begins after this many optimizer steps (its first step is from_step + 1)
    blend: list[BlendEntry] = field(default_factory=list)
    # or after this many tokens: from_step = ceil(from_tokens / (global_batch_size x seq_length)), set at load
    from_tokens: int | None = None


@dataclass
class DataConfig:
    """Training data: a weighted blend of indexed datasets read through megatron-core's
    GPTDataset / BlendedMegatronDatasetBuilder (cplm_dist.data)."""

    blend: list[BlendEntry] = field(default_factory=list)
    # a staged mixture (SmolLM2's): [{from_step, blend}, ...], the first from_step 0, instead of data.blend
    # (its one-stage form); future stages may change on resume, begun ones may not (cplm_dist.config.curriculum)
    stages: list[DataStage] = resumable(default_factory=list)
    tokenizer: str | None = None  # a SentencePiece .model, or a Hugging Face tokenizer directory
    tokenizer_backend: TokenizerBackend = "sentencepiece"
    split: str = "98,2,0"  # train, valid, test weights of every dataset in the blend (Megatron's)
    seq_length: int = 512
    seed: int = 1234  # data order only, so matched runs can differ in init but not in data
    cache_dir: str | None = resumable(None)  # megatron's index cache; default: <first dataset's dir>/index-cache
    eod_mask_loss: bool = False  # do not train on predicting the token after an end-of-document
    # packed documents do not see each other: position_ids restart after each end-of-document id, attention
    # and the copy head's candidates stay inside a document (cplm_dist.model.documents; needs data made with eod)
    document_mask: bool = False
    num_workers: int = resumable(2)  # DataLoader worker processes per rank (under Slurm at most its CPUs less one: data/loader.py)


@dataclass
class ParallelConfig:
    tp: int = resumable(1)  # tensor-parallel size; dp = world_size / (tp x cp x pp)
    # Megatron sequence parallelism (tp > 1): norms, residuals and the copy head's queries on
    # sequence shards between the tp regions (docs/parallelism.md); a no-op at tp = 1
    sequence_parallel: bool = resumable(False)
    # pipeline stages (DeepSpeed's 1F1B pipeline engine, docs/parallelism.md): the layers split by
    # parameters over pp stages; dp = world_size / (tp x pp); needs train.zero_stage <= 1
    pp: int = resumable(1)
    # the pipeline's schedule at pp > 1 (docs/parallelism.md): DeepSpeed's 1F1B, or DualPipeV (two
    # stages a rank, micro-batches out and back: a smaller bubble; needs 2 x pp micro-batches a step
    # and 2 x pp transformer layers); a layout field: changing it on resume needs --reshape
    pp_schedule: PipeSchedule = resumable("1f1b")
    # context parallelism (docs/parallelism.md): each sequence cut into 2 x cp chunks, cp rank r
    # holding chunks r and 2cp-1-r; attention and the copy head all-gather keys over cp;
    # dp = world_size / (tp x cp x pp); gradients summed over cp, averaged over dp
    cp: int = resumable(1)
    # expert parallelism (model.moe, docs/moe.md): a sparse layer's experts split over ep ranks carved
    # out of dp x cp (megatron's expert-model-parallel group); the attention and copy head unchanged
    ep: int = resumable(1)
    # the experts' own tensor parallelism: null = parallel.tp (megatron's default), or 1 (each expert whole on a rank)
    expert_tp: int | None = resumable(None)


@dataclass
class MuonConfig:
    """Muon for the transformer layers' matrices (cplm_dist.training.muon, docs/training.md "Muon"):
    Nesterov momentum orthogonalised by a quintic Newton-Schulz iteration on the whole matrix
    (gathered over tp and the ZeRO partition), scaled by rms_scale x sqrt(max(rows, cols)) so
    AdamW's learning rates transfer (Moonlight); AdamW keeps the rest."""

    lr: float | None = resumable(None)  # null: optim.lr (the update's RMS matches AdamW's); same schedule
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations (quintic, coefficients 3.4445, -4.7750, 2.0315)
    ns_dtype: NsDtype = "auto"  # the iteration's dtype: auto = bf16 on CUDA, fp32 on CPU
    rms_scale: float = 0.2  # update x rms_scale x sqrt(max(rows, cols)); 0 = the bare orthogonal matrix
    # QKV orthogonalised per projection (queries, keys, values apart) rather than as one matrix
    split_qkv: bool = False
    # the copy head's query/key projections under Muon too (default: AdamW, as the LM head's; docs/training.md)
    copy_head: bool = False


@dataclass
class OptimConfig:
    """The optimizer (AdamW, or Muon with AdamW beside it) and its learning-rate schedule
    (cplm_dist.training.optim)."""

    name: OptimName = "adamw"  # adamw | muon (not resumable: a resume keeps its optimizer's states)
    muon: MuonConfig = field(default_factory=MuonConfig)

    lr: float = resumable(3e-4)
    min_lr: float = resumable(3e-5)  # floor of the cosine / WSD decay
    schedule: Schedule = resumable("cosine")
    warmup_steps: int = resumable(100)
    decay_fraction: float = resumable(0.2)  # wsd: the last fraction of train_steps decays to min_lr
    weight_decay: float = resumable(0.1)
    decay_embeddings: bool = False  # norms and biases are never decayed; embeddings only if true
    # CPLM parameter-name prefixes never decayed either, e.g. [copy_head.] (the copy head) or
    # [copy_head.gate.] (the gate's linear); a prefix that names no parameter is refused
    no_decay: list[str] = field(default_factory=list)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = resumable(1.0)  # global gradient-norm clipping (0 = off)
    impl: OptimImpl = resumable("auto")  # AdamW's kernels: auto = fused on CUDA (one kernel per step), foreach on CPU


@dataclass
class TrainConfig:
    """The run: batch arithmetic, precision, ZeRO, logging, evaluation and checkpoints."""

    micro_batch_size: int = resumable(4)  # sequences per rank per forward
    global_batch_size: int = resumable(32)  # sequences per optimizer step = micro x accumulation x dp
    train_steps: int = resumable(1000)
    # the run's length in tokens: when set, train_steps = ceil(train_tokens / (global_batch_size x
    # data.seq_length)), set at load (an explicit, different train_steps is then ignored, said once)
    train_tokens: int | None = resumable(None)
    precision: Precision = "bf16"
    zero_stage: int = resumable(1)
    activation_checkpointing: bool = resumable(False)  # recompute each transformer layer in backward
    compile: bool = resumable(False)  # torch.compile each transformer layer (regional: one graph, reused by every layer)
    # DeepSpeed ZeRO communication (docs/performance.md, "ZeRO settings"); null = on for CUDA, off on CPU/gloo
    overlap_comm: bool | None = resumable(None)  # reduce (stage 1-2) / gather (stage 3) on a side stream during backward
    contiguous_gradients: bool = resumable(True)  # copy gradients into one buffer as they are produced (less fragmentation)
    reduce_bucket_size: int = resumable(500_000_000)  # elements per gradient reduction
    allgather_bucket_size: int = resumable(500_000_000)  # elements per parameter all-gather after the step (stage 1-2)
    stage3_prefetch_bucket_size: int = resumable(50_000_000)  # elements of upcoming parameters ZeRO-3 gathers ahead
    # dtype gradients accumulate (over micro-batches) and are reduced in; null: the parameters'
    # (DeepSpeed's default). fp32 with bf16 (ZeRO-1 only): DeepSpeed's BF16_Optimizer, as Megatron
    # accumulates (docs/training.md, "Gradient accumulation in fp32")
    grad_accum_dtype: GradAccumDtype | None = None
    out_dir: str = resumable("runs/default")  # checkpoints/ and logs/ go here
    log_interval: int = resumable(10)
    eval_interval: int = resumable(200)  # validation loss every this many steps (and at the end)
    eval_batches: int = resumable(10)  # micro-batches per rank in one validation pass
    save_interval: int = resumable(500)
    keep_last: int = resumable(3)  # checkpoints kept (older ones are deleted after a newer one is complete)
    # beside keep_last: checkpoints at multiples of this step count are never deleted (0 = none); under
    # optim.schedule=wsd the last checkpoint before the decay starts is kept too (cplm_dist.checkpoint.pruning)
    keep_every: int = resumable(0)
    # the step loop blocks only while states are copied to host memory; files, hashes and the manifest
    # are written by a background thread (cplm_dist/checkpoint/async_save.py)
    async_save: bool = resumable(False)
    max_bad_steps: int = resumable(5)  # consecutive non-finite steps before the run stops
    collective_timeout_minutes: float = resumable(10.0)  # a collective waiting longer ends the job (a hung or lost rank)
    # --reshape: rank 0 converts the checkpoint while the others wait on a marker file, not in a collective,
    # at most this long (cplm_dist.checkpoint.reshape; a 7B checkpoint with its optimizer is ~100 GB)
    reshape_timeout_minutes: float = resumable(120.0)
    join_timeout_minutes: float = resumable(5.0)  # joining the job (every rank arriving, the host checks) takes at most this
    lock_stale_minutes: float = resumable(10.0)  # out_dir's run lock: a holder on another host silent this long is gone (checkpoint.run_lock)
    exit_at_step: int | None = resumable(None)  # save and exit once this step is done (a time-sliced job; Megatron's --exit-interval)
    inject_nonfinite_at: list[int] = resumable(default_factory=list)  # fault injection (tests): NaN loss at these steps
    inject_spike_at: list[int] = resumable(default_factory=list)  # fault injection: the loss (and gradients) x 10 at these steps
    # spikes (cplm_dist.training.stability): a loss or grad norm above mean + spike_zscore x std of the last
    # spike_window good steps is logged with its batch's sources; 0 = off
    spike_window: int = resumable(128)
    spike_zscore: float = resumable(6.0)
    skip_spikes: bool = resumable(False)  # also skip the update of a step whose loss spikes (beside the non-finite guard)
    # the copy head's gradient path and the mixture, measured live every this many steps (0 = off;
    # cplm_dist.train.diagnostics, docs/training.md "Watching the copy head learn")
    diagnostics_interval: int = resumable(0)
    # in-loop evaluation every eval_interval (cplm_dist.evaluation.in_loop): tasks of the copy/retrieval
    # suite (induction, mqar, spamlang, phonebook) on the live model, dp-sharded; [] = off
    eval_tasks: list[str] = resumable(default_factory=list)
    eval_task_samples: int = resumable(16)  # samples per task setting, over all dp ranks
    eval_task_lengths: list[int] = resumable(default_factory=list)  # the by-length subset (mqar in filler) at these lengths
    tensorboard: bool = resumable(True)
    wandb: bool = resumable(False)
    wandb_project: str = resumable("cplm_dist")
    wandb_entity: str | None = resumable(None)  # the W&B team or user (None: the login's default)
    wandb_group: str | None = resumable(None)  # W&B's run group (e.g. a ladder or an ablation's name)
    wandb_tags: list[str] = resumable(default_factory=list)
    # torch.profiler over steps [a, b] (1-based, inclusive) of this run: a Chrome trace per rank in
    # <out_dir>/logs/profile/rank<r>-step<a>-<b>.json (cplm_dist.training.step_profile); [] = off
    profile_steps: list[int] = resumable(default_factory=list)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    copy: CopyConfig = field(default_factory=CopyConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 1234  # model initialisation


def resumable_fields(cls: type = Config, prefix: str = "") -> tuple[str, ...]:
    """The dotted names of the fields marked `resumable`, in the tree's order."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += resumable_fields(hints[f.name], f"{prefix}{f.name}.")
        elif f.metadata.get("resumable"):
            out.append(prefix + f.name)
    return tuple(out)


# Config fields a resumed run may change; any other difference from the saved config is refused.
RESUMABLE_CHANGES = resumable_fields()


def to_dict(cfg: Any) -> dict:
    """The resolved tree as plain data (for checkpoints, logs and `--print-config`). A blend entry's
    `source` appears only where it is set (expanded from a glob), so a config saved before the field
    existed reads the same."""
    out = dataclasses.asdict(cfg)
    if isinstance(cfg, Config):
        data = out["data"]
        for entry in data["blend"] + [e for stage in data["stages"] for e in stage["blend"]]:
            if entry.get("source") is None:
                entry.pop("source", None)
    return out
