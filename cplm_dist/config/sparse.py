"""Checks of a sparse model's config (model.moe) and its expert parallelism (parallel.ep,
parallel.expert_tp): one line each, naming the field, the value and the fix.

The expert layout is megatron-core's: per pipeline stage the tp x cp x dp ranks are also
expert_tp x ep x expert-dp ranks, so ep x expert_tp divides tp x cp x dp; at expert_tp = tp the
ep ranks are carved out of dp x cp.
"""

from __future__ import annotations

from cplm_dist.config.tree import Config
from cplm_dist.errors import ConfigError


def expert_tp(cfg: Config) -> int:
    """The experts' tensor-parallel size (parallel.expert_tp; null: parallel.tp)."""
    return cfg.parallel.tp if cfg.parallel.expert_tp is None else cfg.parallel.expert_tp


def validate_moe(cfg: Config) -> None:
    """model.moe and parallel.ep / expert_tp, before any rank exists."""
    m, p = cfg.model, cfg.parallel
    e = m.moe
    if e.num_experts < 0:
        raise ConfigError(f"model.moe.num_experts={e.num_experts} must be >= 0 (0: a dense model)")
    if p.ep < 1:
        raise ConfigError(f"parallel.ep={p.ep} must be a positive integer")
    if e.num_experts == 0:
        if p.ep > 1:
            raise ConfigError(f"parallel.ep={p.ep} splits experts, and this model has none: set model.moe.num_experts "
                              "(e.g. 8) or parallel.ep=1")
        return
    _check_router(cfg)
    if not 1 <= e.top_k <= e.num_experts:
        raise ConfigError(f"model.moe.top_k={e.top_k} must lie in [1, model.moe.num_experts={e.num_experts}]")
    for name, value in (("model.moe.ffn_hidden_size", e.ffn_hidden_size), ("model.moe.layer_freq", e.layer_freq)):
        if value is not None and value < 1:
            raise ConfigError(f"{name}={value} must be a positive integer")
    if e.shared_ffn_hidden_size < 0 or e.first_dense_layers < 0:
        raise ConfigError("model.moe.shared_ffn_hidden_size and model.moe.first_dense_layers must be >= 0")
    if not e.sparse_layers(m.num_layers):
        raise ConfigError(f"model.moe.first_dense_layers={e.first_dense_layers} leaves no sparse layer of model.num_layers="
                          f"{m.num_layers}: lower it")
    if e.num_experts % p.ep:
        valid = [d for d in range(1, e.num_experts + 1) if e.num_experts % d == 0]
        raise ConfigError(f"parallel.ep={p.ep} does not divide model.moe.num_experts={e.num_experts}: choose ep from {valid}")
    etp = expert_tp(cfg)
    if etp not in (1, p.tp):
        raise ConfigError(f"parallel.expert_tp={etp} must be 1 or parallel.tp={p.tp} (null: tp)")
    if p.tp > 1 and not p.sequence_parallel:
        raise ConfigError(f"model.moe with parallel.tp={p.tp} needs parallel.sequence_parallel=true (megatron's MoE "
                          "layer routes each tp rank's own positions)")
    if p.ep > 1 and cfg.train.zero_stage == 0:
        raise ConfigError("parallel.ep > 1 with train.zero_stage=0: DeepSpeed saves a ZeRO-0 optimizer state from dp "
                          "rank 0 alone, which does not hold the other ep ranks' experts, so the run could not resume; "
                          "use train.zero_stage=1 or 2")
    if p.ep > 1 and cfg.train.zero_stage == 3:
        raise ConfigError("parallel.ep > 1 with train.zero_stage=3: ZeRO-3 would partition each expert over ranks that "
                          "do not hold it; use train.zero_stage=1 or 2 (experts reduced over the expert-data-parallel group)")


def _check_router(cfg: Config) -> None:
    e = cfg.model.moe
    if e.capacity_factor is not None and not e.capacity_factor > 0:
        raise ConfigError(f"model.moe.capacity_factor={e.capacity_factor} must be > 0 (or null: dropless)")
    if e.aux_loss_coeff < 0 or e.z_loss_coeff < 0 or e.bias_update_rate < 0:
        raise ConfigError("model.moe.aux_loss_coeff, z_loss_coeff and bias_update_rate must be >= 0")
    if e.score == "sigmoid" and not e.normalize and e.top_k > 1:
        raise ConfigError("model.moe.normalize=false with score=sigmoid: megatron renormalises sigmoid top-k scores "
                          "always; set normalize=true or score=softmax")
    if e.top_k == 1 and e.score == "softmax" and e.normalize:
        raise ConfigError("model.moe.top_k=1 with normalize=true weighs every token's expert 1 (the router would get no "
                          "gradient; megatron refuses it): set model.moe.normalize=false (Switch's softmax probability)")
    if e.expert_bias and e.score != "sigmoid":
        raise ConfigError("model.moe.expert_bias=true routes on sigmoid scores plus the bias (DeepSeek-V3): set "
                          "model.moe.score=sigmoid")


def check_expert_world(cfg: Config, world_size: int) -> None:
    """ep x expert_tp divides the tp x cp x dp ranks of a pipeline stage, or one line naming the valid ep."""
    p = cfg.parallel
    if cfg.model.moe.num_experts == 0 or p.ep == 1 and expert_tp(cfg) == p.tp:
        return
    stage = world_size // max(1, p.pp)
    etp = expert_tp(cfg)
    if stage % (p.ep * etp):
        valid = [d for d in range(1, stage // etp + 1) if (stage // etp) % d == 0 and cfg.model.moe.num_experts % d == 0]
        raise ConfigError(f"parallel.ep={p.ep} x expert_tp={etp} does not divide the {stage} ranks of a pipeline stage "
                          f"(tp x cp x dp): choose ep from {valid}")
