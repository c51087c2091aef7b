"""`model.init_from`: a fresh run starts from another model's weights. One key, the source told
apart by what the directory holds:

    DIR/complete.json                       one of our step-* directories: that step
    DIR/checkpoints/ or DIR/step-*/         one of our run directories or its checkpoints/: the newest
                                            complete step (as --checkpoint resolves it for evaluation)
    DIR/config.json with model_type llama   a Hugging Face LlamaForCausalLM, into model.arch=llama
    DIR/config.json with model_type gpt2    a Hugging Face GPT2LMHeadModel, into model.arch=gpt2
    DIR/config.json with model_type qwen3   a Hugging Face Qwen3ForCausalLM, into model.arch=qwen3
    ... model_type qwen3_moe                a Hugging Face Qwen3MoeForCausalLM, into model.arch=qwen3 with model.moe

From one of our checkpoints the run takes the weights only (evaluation's: `load_model`'s shards,
joined and re-sharded, so any saved tp, ZeRO stage or pipeline layout), not the optimizer, the
schedule or the data position: it is a new run at step 0 in its own train.out_dir. The shapes
must be the checkpoint's; what may change is where the positions go: model.max_seq_len,
model.rope_theta and model.rope_scaling (a context extension, docs/training.md), and everything a
new run may choose (data, lr, layout). GPT-2's learned position table cannot stretch: a gpt2
checkpoint starts a run at its own max_seq_len only. The copy head comes along; a copy-off
checkpoint into a copy-on run keeps the fresh copy head (as a HF model does), a copy-on one into a
copy-off run leaves its copy head out; both say so.

A Hugging Face directory (save_pretrained: config.json and *.safetensors) initialises the backbone
at any tp through its record's HF adapter (`backbone(m).hf`, read by cplm_dist.interop.hf.directory);
its model_type must be the one the run's model.arch reads (else one line naming the model.arch
that does), its shapes the run's; a GPT-2 also needs model.num_kv_heads = n_head and
model.max_seq_len = n_positions, and GELU's tanh approximation (gelu_new or gelu_pytorch_tanh); a
Qwen3 no sliding-window layers; a Qwen3-MoE the run's model.moe (experts, top_k, expert width,
normalize, which layers are sparse: cplm_dist.config.backbones.sparse_hf). The copy head starts
fresh. Experts go by global id: each ep rank takes its own (sharding.load_full_state_dict).

    source = init_source(cfg)            # before anything starts: one line when it cannot be used
    initialise_from(model, cfg, tp_rank, tp_size)   # after the model is built, before DeepSpeed
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from cplm_dist.checkpoint.loading import copy_buffers, read_checkpoint, saved_buffers, saved_shards
from cplm_dist.checkpoint.manifest import COMPLETE, Manifest
from cplm_dist.config import Config
from cplm_dist.config.backbones import backbone, backbones_with
from cplm_dist.errors import CheckpointError, ConfigError, UsageError

log = logging.getLogger(__name__)

# the fields that make the weights' shapes: a checkpoint's must be the run's
SHAPE_FIELDS = ("arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size",
                "vocab_size", "tie_embeddings")
COPY_SHAPE_FIELDS = ("num_heads", "head_dim", "mix")


@dataclass(frozen=True)
class InitSource:
    kind: str  # "checkpoint" (ours) or "hf" (a HF directory of a backbone's stock class)
    path: Path  # the step directory, or the HF directory
    notes: tuple[str, ...] = ()  # what the run should know (the copy head fresh or left out)


def _is_ours(d: Path) -> bool:
    return (d / COMPLETE).is_file() or (d / "checkpoints").is_dir() or any(d.glob(f"step-*/{COMPLETE}"))


def init_source(cfg: Config) -> InitSource:
    """Which source model.init_from names, checked against the run's config (reads complete.json
    or config.json only); one line (exit 2) when it cannot start this run."""
    from cplm_dist.interop.hf.directory import check_hf_dir, families

    d, where = Path(cfg.model.init_from), f"model.init_from={cfg.model.init_from}"
    if not d.is_dir():
        raise UsageError(f"{where}: no such directory: give one of our run, checkpoints/ or step-* directories, "
                         f"or a Hugging Face {families('family')} directory (save_pretrained)")
    if _is_ours(d):
        return _check_checkpoint(cfg, where)
    if (d / "config.json").is_file():
        check_hf_dir(d, cfg.model)
        return InitSource("hf", d)
    raise UsageError(f"{where}: neither one of our checkpoints (a step-* directory with {COMPLETE}, a run directory or "
                     f"its checkpoints/) nor a Hugging Face {families('family')} (config.json, model_type "
                     f"{families('model_type')}): point it at one of those")


def _check_checkpoint(cfg: Config, where: str) -> InitSource:
    """One of our checkpoints as this run's start: the shapes agree, the positions can move."""
    try:
        saved, manifest = read_checkpoint(cfg.model.init_from)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    m, s = cfg.model, saved.model
    for name in SHAPE_FIELDS:
        if getattr(s, name) != getattr(m, name):
            raise ConfigError(f"{where}: its model.{name}={getattr(s, name)} but this run has model.{name}="
                              f"{getattr(m, name)}: set model.{name}={getattr(s, name)} (the shapes must match the checkpoint)")
    if backbone(m).positions != "rope" and m.max_seq_len != s.max_seq_len:
        rotary = backbones_with(positions="rope")[0]
        raise ConfigError(f"{where}: model.arch={m.arch} learns one position embedding a position (a {s.max_seq_len}-row "
                          f"table), which cannot stretch to model.max_seq_len={m.max_seq_len}: keep model.max_seq_len="
                          f"{s.max_seq_len} (a longer context needs rotary positions, model.arch={rotary})")
    if manifest.layout.zero_stage == 3 and manifest.layout.tp > 1:
        raise CheckpointError(f"{where}: ZeRO-3 checkpoints saved at tp>1 cannot be merged yet (DeepSpeed's zero_to_fp32 "
                              "reads tp rank 0 only); start from one saved at tp=1 or at ZeRO 0-2")
    notes = []
    if saved.copy.enabled and cfg.copy.enabled:
        for name in COPY_SHAPE_FIELDS:
            if getattr(saved.copy, name) != getattr(cfg.copy, name):
                raise ConfigError(f"{where}: its copy.{name}={getattr(saved.copy, name)} but this run has copy.{name}="
                                  f"{getattr(cfg.copy, name)}: set copy.{name}={getattr(saved.copy, name)} (the copy "
                                  "head's weights must fit)")
    elif cfg.copy.enabled:
        notes.append(f"{where} has no copy head (copy.enabled=false): the copy head starts fresh")
    elif saved.copy.enabled:
        notes.append(f"{where} has a copy head, this run has copy.enabled=false: its copy head is left out")
    return InitSource("checkpoint", manifest.step_dir, tuple(notes))


def initialise_from(model: torch.nn.Module, cfg: Config, tp_rank: int, tp_size: int) -> InitSource:
    """Overwrite this rank's freshly built `model` with model.init_from's weights, at this run's
    tp whatever tp they were saved at."""
    from cplm_dist.interop.hf.directory import initialise_from_hf

    source = init_source(cfg)
    for note in source.notes:
        log.warning(note)
    if source.kind == "hf":
        initialise_from_hf(model, source.path, tp_rank, tp_size)
    else:
        saved, manifest = read_checkpoint(source.path)
        load_checkpoint_weights(model, manifest, saved, tp_rank, tp_size, require_copy_head=saved.copy.enabled)
    return source


def load_checkpoint_weights(model: torch.nn.Module, manifest: Manifest, saved: Config, tp_rank: int, tp_size: int,
                            require_copy_head: bool = True) -> None:
    """A checkpoint's weights (every saved tp rank's, joined) into this rank's shard of `model`
    (cplm_dist.model.parallel.sharding: the tp-independent tensors, then this rank's part)."""
    from cplm_dist.checkpoint.expert_files import saved_experts, with_saved_experts
    from cplm_dist.model.moe_naming import global_expert_name
    from cplm_dist.model.parallel.sharding import full_state_dict, load_full_state_dict

    # a sparse model saved at ep > 1: every expert from its expert files, by global id
    shards = saved_shards(manifest, saved)
    full = with_saved_experts(full_state_dict(shards, model), saved_experts(manifest), model)
    params = [global_expert_name(n, p) for n, p in model.named_parameters()]
    missing = [n for n in params if n not in full and (require_copy_head or not n.startswith("copy_head."))]
    try:
        if missing:
            raise ValueError(f"no weights for {missing[:3]}")
        load_full_state_dict(model, full, tp_rank, tp_size, require_all=False)
        copy_buffers(model, shards[0], saved_buffers(model, shards[0]))  # a sparse layer's expert bias routes as saved
    except ValueError as e:
        raise CheckpointError(f"model.init_from={manifest.step_dir}: weights do not match the model ({e})") from None
