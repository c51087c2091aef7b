"""The Copy-Paste LM: a decoder from megatron-core tp layers, its vocab-parallel LM head, and the
copy head beside it, mixed without gathering the vocabulary. It is its parts in a row
(cplm_dist.model.parts): the embedding, the transformer layers, the head.

    model = build_model(cfg)                  # tp from the initialised parallel state
    out = model(input_ids, labels)            # TokenLoss: out.nll, out.lm_nll, out.copy_share (B, T)
    out = model(input_ids, labels, position_ids)  # packed documents that do not see each other (data.document_mask)
    logp = model.next_token_logprobs(ids)     # (B, T, V) full mixed distribution (evaluation)
    logp, greedy = model.score(ids, targets)  # (B, T) at the targets, the vocabulary never gathered
    state = model.new_decode_state(B, S)      # a static cache (cplm_dist.model.static_cache): both
                                              # continue it (state=...); generation: model.static_decode

Data flow of a forward, per tp rank:
    ids -> VocabParallelEmbedding (+ learned positions, gpt2) -> L x TransformerLayer -> norm -> h (B, T, D), replicated
    h -> LM head (ColumnParallelLinear) -> logits (B, T, V/tp), this rank's vocabulary shard
    h -> CopyHead (replicated) -> A_t, M_t, gate (B, T)
    loss.mixed_nll: (logits shard, labels, copy terms or None) -> nll (B, T)
Under sequence parallelism (docs/parallelism.md) the trunk runs in Megatron's sequence-first layout:
    ids -> VocabParallelEmbedding (reduce-scatter) -> x (T/tp, B, D), this rank's positions
    layers: norms and residuals on the T/tp positions; each linear pair all-gathers the sequence
        in and reduce-scatters it out (megatron-core's sequence-parallel linears)
    h (T/tp, B, D) -> LM head (all-gathers the sequence) -> logits (T, B, V/tp)
    h (T/tp, B, D) -> CopyHead (keys and per-token terms all-gathered) -> A_t, M_t, gate (T, B)
and the loss, replicated over tp as without it, comes back as (B, T).
Under context parallelism (parallel.cp, cplm_dist.model.parallel.context) input_ids and labels are
this rank's two chunks of each row (B, T/cp): every layer all-gathers K and V over cp, the copy head
its keys and the ids, and the loss comes back for this rank's tokens (B, T/cp).
Copy on or off, the loss is the same function (copy off: no copy terms), so the matched baseline
shares every line of loss code except the copy terms. The model never calls torch.distributed
itself: collectives live in the megatron layers and in cplm_dist.model.loss, on the tp group
handed in. It is built from the model, copy and loss sections and explicit flags (`build_model`).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.distributed as dist

import cplm_dist.model.loss as loss
from cplm_dist.config import Config, ModelConfig
from cplm_dist.megatron_compat import parallel_state
from cplm_dist.model.block import TransformerLayer
from cplm_dist.model.copy_lse import candidate_mask
from cplm_dist.model.core_attention import Masks
from cplm_dist.model.documents import check_positions, document_index
from cplm_dist.model.initialization import init_parameters
from cplm_dist.model.next_token import CopyOver, components, full_log_probs, mixed_shard
from cplm_dist.model.parallel.context import ContextInputs, ContextShard, context_inputs
from cplm_dist.model.parts import Embedding, Head, PartSpec
from cplm_dist.model.positions import layer_rope
from cplm_dist.model.recompute_compile import recompute_and_compile
from cplm_dist.model.static_cache import StaticCache

log = logging.getLogger(__name__)


SCORE_ROWS = 512  # CPLM.score: tokens whose V/tp log-probs exist at once (512 x 49152 fp32: 101 MB a tensor at tp = 1)


class ModelParts(NamedTuple):
    """The parts a CPLM is made of. Not registered as modules themselves: their modules are the
    model's own, under the names they have in their parts (so the state-dict keys are theirs)."""

    embed: Embedding
    head: Head


class CPLM(torch.nn.Module):
    def __init__(self, embed: Embedding, layers: list[TransformerLayer], head: Head, model_cfg: ModelConfig,
                 context: ContextShard | None = None):
        """The parts in a row; `build_model` builds them (the matched baseline without a copy head:
        copy.enabled=false). `context`: this rank's place in its cp group (parallel.cp > 1)."""
        super().__init__()
        self.context = context
        # the kernel the layers were built with (PartSpec.core_attention), whose masks a forward builds once
        self.core_attention = layers[0].attention.core
        self.model_cfg, self.copy_cfg, self.loss_cfg, self.tp_group = model_cfg, head.copy_cfg, head.loss_cfg, head.tp_group
        self.tp_rank, self.tp_size = loss.tp_rank_size(head.tp_group)
        self.vocab_size = model_cfg.vocab_size
        self.sequence_parallel = head.sequence_parallel
        self.embedding, self.position_embedding = embed.embedding, embed.position_embedding
        self.layers = torch.nn.ModuleList(layers)
        self.final_norm, self.lm_head, self.copy_head = head.final_norm, head.lm_head, head.copy_head
        self.parts = ModelParts(embed, head)

    def train(self, mode: bool = True) -> "CPLM":
        super().train(mode)
        for part in self.parts:  # their modules are ours (set by super); their own flags follow
            part.training = mode
        return self

    # --- shared trunk --------------------------------------------------------------------------

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states h (B, T, D), identical on every tp rank. Sequence parallel: this
        rank's positions, (T/tp, B, D). position_ids (B, T): document masking (module docstring
        of cplm_dist.model.documents); None: one document a row. Context parallel: input_ids are
        this rank's two chunks (cplm_dist.model.parallel.context)."""
        if self.context is not None:
            return self._context_trunk(input_ids, position_ids)[0]
        T = input_ids.shape[1]
        self._check_length(T, T)
        docs = None
        if position_ids is not None:
            check_positions(position_ids, input_ids, full_row=True)
            docs = document_index(position_ids)
        masks = self.core_attention.masks(docs, 0, T, input_ids.device)  # once a forward, for every layer
        return self.trunk(input_ids, position_ids, masks)

    def _check_length(self, local: int, total: int) -> None:
        if self.sequence_parallel and local % self.tp_size:
            raise ValueError(f"sequence length {local} is not divisible by tp={self.tp_size} (sequence parallelism)")
        if total > self.model_cfg.max_seq_len:
            raise ValueError(f"sequence length {total} exceeds model.max_seq_len={self.model_cfg.max_seq_len}")

    def trunk(self, input_ids: torch.Tensor, positions: torch.Tensor | None, masks,
              cache: StaticCache | None = None) -> torch.Tensor:
        """The embedding, the layers and the final norm over input_ids at `positions` (None:
        0..T-1), every layer's attention under `masks` (its core attention's, built once); with a
        decode `cache`, each layer's keys and values written at its cursor's slots."""
        cos, sin = layer_rope(self.model_cfg, input_ids.shape[1], 0, device=input_ids.device, position_ids=positions)
        x = self.parts.embed(input_ids, 0, positions)  # (B, T, D)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, masks, cache.layers[i] if cache is not None else None)
        return self.final_norm(x)

    def _context_trunk(self, input_ids: torch.Tensor,
                       position_ids: torch.Tensor | None) -> tuple[torch.Tensor, ContextInputs]:
        """Context parallelism: (the final-norm states of this rank's chunks, what the copy head
        reads of the whole sequence), the layers' attention under the chunks' masks."""
        inputs = context_inputs(self.context, input_ids, position_ids)
        self._check_length(input_ids.shape[1], inputs.ids.shape[1])
        masks = self.core_attention.masks(inputs.docs, 0, input_ids.shape[1], input_ids.device)
        return self.trunk(input_ids, inputs.positions, masks), inputs

    @property
    def tied(self) -> torch.Tensor | None:
        """The weight the LM head shares with the embedding (None: its own)."""
        return self.embedding.weight if self.model_cfg.tie_embeddings else None

    # --- training ------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> loss.TokenLoss:
        """input_ids (B, T); labels (B, T) global ids, -100 to ignore; default: the next input id.
        position_ids (B, T): positions restarting at 0 where a document starts (document masking:
        a token sees, and the copy head pastes from, earlier tokens of its own document only);
        None: one document a row."""
        if labels is None and self.context is not None:
            raise ValueError("a context-parallel forward needs its labels: the next id of a chunk's last token is another rank's")
        if labels is None:
            labels = torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], loss.IGNORE_INDEX)], 1)
        if self.context is not None:
            h, inputs = self._context_trunk(input_ids, position_ids)
            return self.parts.head.token_loss(h, input_ids, labels, self.tied, context=inputs)
        h = self.hidden_states(input_ids, position_ids)
        return self.parts.head.token_loss(h, input_ids, labels, self.tied, position_ids)

    def lm_logits(self, h: torch.Tensor, tied: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's vocabulary shard of the LM logits (B, T, V/tp) of final-norm states h."""
        return self.parts.head.lm_logits(h, tied)

    # --- evaluation and decoding: the model over its decode state, a static cache -------------------

    def new_decode_state(self, batch: int, slots: int) -> StaticCache:
        """An empty decode state for `batch` rows of up to `slots` positions (cplm_dist.model.static_cache)."""
        if self.context is not None:
            raise RuntimeError("a context-parallel model trains only: load its checkpoint with "
                               "cplm_dist.checkpoint.load_model (built without cp) to decode")
        if self.sequence_parallel:
            raise RuntimeError("a sequence-parallel model trains only: load its checkpoint with "
                               "cplm_dist.checkpoint.load_model (built without it) to decode")
        param = next(self.parameters())
        return StaticCache.allocate(self, batch, slots, param.device, param.dtype)

    def cache_masks(self, cache: StaticCache, t0: int, t1: int) -> Masks:
        """The attention masks of queries at slots t0..t1-1 against slots 0..t1-1: the kernel's own
        causal ones (flash on CUDA) where the cache holds one unpadded document a row, else SDPA's
        dense block-causal mask (FlexAttention's block mask would compile again for every shape)."""
        if cache.causal:
            return self.core_attention.masks(None, t0, t1 - t0, cache.ids.device)
        slots = torch.arange(t0, t1, device=cache.ids.device)
        return Masks(dense=candidate_mask(slots, t1, 0, cache.docs[:, :t1]).unsqueeze(1))

    def over_cache(self, input_ids: torch.Tensor, cache: StaticCache, slots: torch.Tensor, keys: int | None,
                   masks: Masks) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids (B, T) at `slots` (T,) of `cache` through the trunk, attending to its first
        `keys` slots (None: all) under `masks`: (final states h (B, T, D), the copy head's queries
        (B, H_c, T, d_c) or None); the ids, the keys and values, and the copy keys written at `slots`
        (their positions and documents are the cache's already: StaticCache.reserve)."""
        cache.cursor.slots, cache.cursor.keys = slots, keys
        positions = cache.positions[:, slots]
        h = self.trunk(input_ids, positions, masks, cache)
        cache.ids[:, slots] = input_ids
        if self.copy_head is None:
            return h, None
        q, k = self.copy_head.project(h, 0, positions=positions)
        cache.copy_k[:, :, slots] = k
        return h, q

    def head_over(self, h: torch.Tensor, q: torch.Tensor | None, cache: StaticCache, slots: torch.Tensor,
                  keys: int | None) -> tuple[torch.Tensor, CopyOver | None]:
        """The head at `slots` (T,) of final states h (B, T, D) and copy queries q: (this rank's LM
        logits shard (B, T, V/tp), the copy head's distribution over the first `keys` slots of
        `cache` (None: all) or None)."""
        logits = self.lm_logits(h, self.tied)
        if self.copy_head is None:
            return logits, None
        K = cache.slots if keys is None else keys
        cand = candidate_mask(slots, K, self.copy_head.shift, cache.docs[:, :K])
        weights, src, terms = self.copy_head.weights_for(q, cache.copy_k[:, :, :K], cache.ids[:, :K], h, cand)
        return logits, CopyOver(terms, weights, src, cand)

    @torch.no_grad()
    def feed(self, input_ids: torch.Tensor, state: StaticCache | None = None, position_ids: torch.Tensor | None = None):
        """Write input_ids after what `state` holds (None: a fresh state of their length) and run
        them: (the state, their slots, final states h, copy queries q or None)."""
        state = state if state is not None else self.new_decode_state(*input_ids.shape)
        t0 = state.length
        self._check_length(input_ids.shape[1], t0 + input_ids.shape[1])
        slots = state.reserve(input_ids, position_ids)
        h, q = self.over_cache(input_ids, state, slots, state.length, self.cache_masks(state, t0, state.length))
        return state, slots, h, q

    @torch.no_grad()
    def next_token_logprobs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                            state: StaticCache | None = None) -> torch.Tensor:
        """(B, T, V) float32 log p(x_{t+1} = w | x_<=t) of the mixture, gathered over tp, for
        input_ids (B, T) fed after what `state` holds (none: a fresh sequence; the state is
        extended); position_ids: as `forward` takes them, or continuing a state's documents."""
        state, slots, h, q = self.feed(input_ids, state, position_ids)
        logits, copy = self.head_over(h, q, state, slots, state.length)
        return full_log_probs(logits, copy, self.copy_cfg.mix, self.vocab_size, self.tp_group)[0]

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, targets: torch.Tensor, state: StaticCache | None = None,
              rows: int = SCORE_ROWS, position_ids: torch.Tensor | None = None, parts: bool = False):
        """(log p(targets[:, t] | what precedes and input_ids[:, :t + 1]), whether targets[:, t] is
        the mixture's most likely id), each (B, T), for `input_ids` (B, T) fed after what `state`
        holds (none: a fresh sequence; the state is extended as by `next_token_logprobs`). The
        distribution `next_token_logprobs` gives, read at the targets without gathering the
        vocabulary, `rows` tokens at a time (B x T x V floats never exist: about rows x V/tp at
        once). Targets of IGNORE_INDEX: 0, False. position_ids: as `next_token_logprobs` takes them.
        parts=True adds a third element, next_token.components at the targets: whether the LM head
        alone and the copy head's pointer rank each target first, and the mix's copy share."""
        state, slots, h, q = self.feed(input_ids, state, position_ids)
        block = max(1, rows // h.shape[0])
        logps, greedy, read = [], [], []
        for t0 in range(0, h.shape[1], block):
            t1 = min(h.shape[1], t0 + block)
            logits, copy = self.head_over(h[:, t0:t1], None if q is None else q[:, :, t0:t1], state, slots[t0:t1],
                                          state.length)
            shard, _ = mixed_shard(logits, copy, self.copy_cfg.mix, self.tp_group)
            lp, top = loss.target_log_probs(shard, targets[:, t0:t1], self.tp_group)
            logps.append(lp)
            greedy.append(top)
            if parts:
                read.append(components(logits, copy, self.copy_cfg.mix, targets[:, t0:t1], self.tp_group))
        if parts:
            return torch.cat(logps, dim=1), torch.cat(greedy, dim=1), {k: torch.cat([r[k] for r in read], dim=1)
                                                                     for k in read[0]}
        return torch.cat(logps, dim=1), torch.cat(greedy, dim=1)


def place(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` with every tensor on `device`: moved only if one is elsewhere (the parts are built
    on it; fake tensors, as a dry run builds them, cannot be swapped by Module.to)."""
    tensors = [*model.parameters(), *model.buffers()]
    return model.to(device) if any(t.device != device for t in tensors) else model


def build_model(cfg: Config, *, tp_group: dist.ProcessGroup | None = None, device=None, dtype=torch.float32,
                activation_checkpointing: bool | None = None, compile_layers: bool | None = None,
                sequence_parallel: bool | None = None, cp_group: dist.ProcessGroup | None = None) -> CPLM:
    """The model for this rank from cfg.model, cfg.copy, cfg.loss and cfg.seed, its tp group taken
    from the initialised parallel state unless given: its parts built, initialised from the seed
    (the same weights at every tp), then activation checkpointing and compilation applied as
    cfg.train says unless given (cplm_dist.model.recompute_compile); sequence parallelism as
    cfg.parallel says unless given (training only: the same parameters, so a checkpoint evaluates
    without it); its cp group (parallel.cp > 1) likewise from the parallel state unless given."""
    if cp_group is None and cfg.parallel.cp > 1 and parallel_state.model_parallel_is_initialized():
        cp_group = parallel_state.get_context_parallel_group()
    context = ContextShard.of(cp_group)
    if (context.size if context else 1) != cfg.parallel.cp:
        raise ValueError(f"parallel.cp={cfg.parallel.cp} but the context-parallel group has {context.size if context else 1} ranks")
    if tp_group is None:
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("build_model needs the parallel groups: call cplm_dist.distributed.init_distributed first")
        tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(tp_group)
    if tp != cfg.parallel.tp:
        raise ValueError(f"parallel.tp={cfg.parallel.tp} but the tensor-parallel group has {tp} ranks")
    m = cfg.model
    note = loss.vocab_padding_note(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    if note and dist.get_rank() == 0:
        log.warning(note)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    spec = PartSpec.of(cfg, tp_group, device, dtype, sequence_parallel, context)
    layers = [TransformerLayer(spec, i) for i in range(m.num_layers)]
    model = place(CPLM(Embedding(spec), layers, Head(spec), m, context), device)
    init_parameters(model, m, cfg.copy, cfg.seed, model.tp_rank, model.tp_size)
    t = cfg.train
    return recompute_and_compile(model, device=device,
                       activation_checkpointing=t.activation_checkpointing if activation_checkpointing is None else activation_checkpointing,
                       compile=t.compile if compile_layers is None else compile_layers)
