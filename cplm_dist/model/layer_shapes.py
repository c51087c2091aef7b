"""A transformer layer's parameters as data, megatron-core's layer spec for shapes: each slot's
tensors (name, full shape, how it is laid out over tp) as a function of the model config and its
backbone's record (cplm_dist.config.backbones). The modules build themselves from these (attention,
its qk-norm slot, the MLP, the norms); counting (cplm_dist.model.counting) and the memory estimator
(cplm_dist.profiling.memory) read the same entries, so a new slot is counted where it is defined.

    layer_shapes(m, i)   layer i, in module order:  attn_norm.*, attention.*, mlp_norm.*, mlp.*
    attention_shapes(m)  qkv, [q_norm, k_norm], proj           (biases where the backbone has them)
    mlp_shapes(m)        fc1 ([gate; up] for a gated MLP), fc2
    sparse_mlp_shapes(m) the sparse slot (model.moe): router, each expert by global id, the shared expert
    norm_shapes(m, dim)  weight [, bias]
    muon_shapes(m, copy) what Muon orthogonalises (a layer's 2-D weights, the copy head's q and k), by name

Layers differ only in their MLP slot: a layer of model.moe.sparse_layers has the sparse one
(cplm_dist.model.moe), whose experts carry their global id (`expert`) and are split over
parallel.expert_tp (= tp by default; at expert_tp = 1 they are whole on every tp rank) and, whole
experts, over parallel.ep. A test ties every entry to the built module's parameters (name, full
shape, split) at tp 1 and 2, dense and sparse (tests/test_model.py). No megatron-core here: the arithmetic modules import without it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cplm_dist.config import CopyConfig, ModelConfig
from cplm_dist.config.backbones import backbone

# when a replicated tensor's gradient is summed over the tp ranks
UNDER_SEQUENCE_PARALLEL = "sequence_parallel"  # a rank applies it to its T/tp positions only then (norms, row biases)
ALWAYS = "always"  # a rank applies it to its own heads only (the qk-norm weights, shared by every head)


@dataclass(frozen=True)
class ParameterShape:
    """One parameter tensor of a layer: `shape` is the whole tensor (all tp ranks together); `split`
    the dimension cut over tp (Megatron's strided way with `stride`), None where every tp rank holds
    it whole; `matrix` where it multiplies the activation once a token (the FLOP count's N_matmul);
    `grad_sum` (replicated tensors) when its gradient is summed over tp; `expert` the global id of
    the routed expert it belongs to (None: every token uses it)."""

    name: str
    shape: tuple[int, ...]
    split: int | None = None
    stride: int = 1
    matrix: bool = False
    grad_sum: str | None = None
    expert: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """The shape one of `tp` ranks holds."""
        if self.split is None:
            return self.shape
        return tuple(s // tp if i == self.split else s for i, s in enumerate(self.shape))


def _under(prefix: str, shapes: list[ParameterShape]) -> list[ParameterShape]:
    return [replace(s, name=f"{prefix}.{s.name}") for s in shapes]


def by_name(shapes: list[ParameterShape]) -> dict[str, ParameterShape]:
    return {s.name: s for s in shapes}


def norm_shapes(m: ModelConfig, dim: int | None = None, grad_sum: str = UNDER_SEQUENCE_PARALLEL) -> list[ParameterShape]:
    """The backbone's norm over `dim` features (default hidden_size): a weight, and LayerNorm's bias."""
    dim = m.hidden_size if dim is None else dim
    names = ("weight", "bias") if backbone(m).norm == "layernorm" else ("weight",)
    return [ParameterShape(n, (dim,), grad_sum=grad_sum) for n in names]


def column_shapes(rows: int, cols: int, bias: bool, stride: int = 1) -> list[ParameterShape]:
    """A ColumnParallelLinear cols -> rows: weight (rows, cols) and bias split by rows over tp."""
    return [ParameterShape("weight", (rows, cols), split=0, stride=stride, matrix=True)] + (
        [ParameterShape("bias", (rows,), split=0, stride=stride)] if bias else [])


def row_shapes(rows: int, cols: int, bias: bool) -> list[ParameterShape]:
    """A RowParallelLinear cols -> rows (ending a tp region): weight split by columns, bias whole
    (added after the reduction: under sequence parallelism it meets T/tp positions a rank)."""
    return [ParameterShape("weight", (rows, cols), split=1, matrix=True)] + (
        [ParameterShape("bias", (rows,), grad_sum=UNDER_SEQUENCE_PARALLEL)] if bias else [])


def qk_norm_shapes(m: ModelConfig) -> list[ParameterShape]:
    """The qk-norm slot: q_norm and k_norm, RMSNorm weights over head_dim shared by every head
    (so replicated over tp, their gradients summed over tp); empty where the backbone has none."""
    if not backbone(m).qk_norm:
        return []
    return [ParameterShape(f"{which}.weight", (m.head_dim,), grad_sum=ALWAYS) for which in ("q_norm", "k_norm")]


def attention_shapes(m: ModelConfig) -> list[ParameterShape]:
    """QKV (rows per kv group [q_1 .. q_g, k, v]: (nh + 2 nkv) head_dim), the qk-norm slot, and the
    output projection (nh head_dim -> hidden). Their widths are heads x head_dim, which need not be
    hidden_size (model.head_dim, Qwen3)."""
    bias = backbone(m).bias
    qkv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    return (_under("qkv", column_shapes(qkv, m.hidden_size, bias)) + qk_norm_shapes(m)
            + _under("proj", row_shapes(m.hidden_size, m.num_heads * m.head_dim, bias)))


def mlp_shapes(m: ModelConfig) -> list[ParameterShape]:
    """fc1 (hidden -> ffn, or a gated MLP's [gate; up], 2 ffn rows of stride 2) and fc2 (ffn -> hidden)."""
    b = backbone(m)
    gated = b.gated_mlp
    fc1 = column_shapes(m.ffn_hidden_size * (2 if gated else 1), m.hidden_size, b.bias, stride=2 if gated else 1)
    return _under("fc1", fc1) + _under("fc2", row_shapes(m.hidden_size, m.ffn_hidden_size, b.bias))


def sparse_mlp_shapes(m: ModelConfig) -> list[ParameterShape]:
    """The sparse slot (megatron's MoE layer, cplm_dist.model.moe), in module order: the router
    (E, D), replicated, its gradient summed over tp under sequence parallelism (each rank routes its
    own positions); each expert's fc1 and fc2 under its global id (megatron's SequentialMLP keys,
    an expert's width model.moe.ffn_hidden_size; no biases); the shared expert's gate (1, D,
    replicated like the router) and its fc1 and fc2, split over tp like the dense MLP's."""
    e, gated = m.moe, backbone(m).gated_mlp
    width, stride = (2, 2) if gated else (1, 1)
    f = e.ffn_hidden_size or m.ffn_hidden_size
    out = [ParameterShape("router.weight", (e.num_experts, m.hidden_size), matrix=True, grad_sum=UNDER_SEQUENCE_PARALLEL)]
    for j in range(e.num_experts):
        expert = (_under("linear_fc1", column_shapes(width * f, m.hidden_size, False, stride))
                  + _under("linear_fc2", row_shapes(m.hidden_size, f, False)))
        out += [replace(s, expert=j) for s in _under(f"experts.local_experts.{j}", expert)]
    if e.shared_ffn_hidden_size:
        fs = e.shared_ffn_hidden_size
        if e.shared_gate:
            out.append(ParameterShape("shared_experts.gate_weight", (1, m.hidden_size), matrix=True,
                                      grad_sum=UNDER_SEQUENCE_PARALLEL))
        out += _under("shared_experts", _under("linear_fc1", column_shapes(width * fs, m.hidden_size, False, stride))
                      + _under("linear_fc2", row_shapes(m.hidden_size, fs, False)))
    return out


_LAYERS: dict[tuple[str, bool], tuple[ParameterShape, ...]] = {}  # (repr of the model config, sparse): its layer's entries


def layer_shapes(m: ModelConfig, index: int = 0) -> list[ParameterShape]:
    """Every parameter of transformer layer `index` (cplm_dist.model.block), in module order; its
    MLP slot the sparse one where model.moe makes that layer sparse. Kept per model config and
    kind of layer: a sparse layer lists every expert (256 entries a layer at 128 experts), and the
    planner asks for them thousands of times."""
    sparse = index in m.moe.sparse_layers(m.num_layers)
    key = (repr(m), sparse)
    if key not in _LAYERS:
        if len(_LAYERS) > 64:
            _LAYERS.clear()
        _LAYERS[key] = tuple(_under("attn_norm", norm_shapes(m)) + _under("attention", attention_shapes(m))
                             + _under("mlp_norm", norm_shapes(m))
                             + _under("mlp", sparse_mlp_shapes(m) if sparse else mlp_shapes(m)))
    return list(_LAYERS[key])


def model_layer_shapes(m: ModelConfig, layers: int | None = None) -> list[list[ParameterShape]]:
    """Each layer's shapes: all model.num_layers, or the first `layers` of them (a pipeline stage's
    count: exact for a dense model or an evenly sparse one, an approximation where
    model.moe.first_dense_layers or layer_freq make layers differ)."""
    return [layer_shapes(m, i) for i in range(m.num_layers if layers is None else layers)]


# a layer's QKV weight: orthogonalised per projection (queries, keys, values) under optim.muon.split_qkv
QKV_WEIGHT = "attention.qkv.weight"


def muon_shapes(m: ModelConfig, copy: CopyConfig | None = None) -> dict[str, ParameterShape]:
    """Muon's matrices (optim.name=muon: cplm_dist.training.muon steps them, cplm_dist.profiling.muon_cost
    prices them) by name: a layer's 2-D weights under their name in the layer (QKV, attention out,
    MLP fc1 and fc2) and, given `copy` (optim.muon.copy_head) with the copy head on, its query and
    key projections. Norms, the qk-norm slot, biases, the embedding and the LM head are AdamW's."""
    dense = replace(m, moe=replace(m.moe, num_experts=0))  # a sparse slot's router and experts stay AdamW's (as built)
    out = {s.name: s for s in layer_shapes(dense) if len(s.shape) == 2}
    if copy is not None and copy.enabled:
        width = copy.num_heads * copy.head_dim
        for name in ("copy_head.q.weight", "copy_head.k.weight"):
            out[name] = ParameterShape(name, (width, m.hidden_size), matrix=True)
    return out


def muon_shape(name: str, shapes: dict[str, ParameterShape]) -> ParameterShape | None:
    """The entry of `shapes` (muon_shapes) for the model's parameter `name` (a layer's as
    `layers.<i>.<its name in the layer>`), or None: an AdamW parameter."""
    parts = name.split(".", 2)
    return shapes.get(parts[2] if parts[0] == "layers" and len(parts) == 3 else name)
