"""The copy head, the copy/LM mixture and their KV cache, shared by every copy-on remote class
(modeling_cplm.CPLMForCausalLM on Llama, modeling_cplm_gpt2.CPLMGPT2ForCausalLM on GPT-2,
modeling_cplm_qwen3.CPLMQwen3ForCausalLM on Qwen3): a
backbone's final hidden state h (after its final norm) feeds the LM head and the copy head, and
the logits returned are the mixture's log-probabilities (softmax of them is the mixture), so
`generate()` samples from the mixture.

For one copy head, s_tj = q_t . k_j / sqrt(d_c) over the candidates C_t (paste `next`: j < t
pastes x_{j+1}; `self`: j <= t pastes x_j); A_t = logsumexp_{C_t} s_tj. Each mix is two
log-weights, log p(w) = logaddexp(lm + log softmax(z)_w, copy + log copy_mass_w):
  gate      g = sigmoid(gate(h_t)): lm = log g, copy = log(1 - g) - A (lm = 0 when C_t is empty)
  joint     one softmax over the vocabulary and the positions: lm = LSE - log Z, copy = -log Z
  sentinel  a sentinel score S_0 joins the copy softmax: lm = S_0 - S, copy = -S
  joint_gate  the gate over the joint mix's evidence: gate's weights with g = sigmoid(gate(h_t) + LSE - A)
Several heads: gate averages the heads' copy distributions; joint, sentinel and joint_gate pool
the heads' candidates with weight 1/H.

KV cache (`use_cache=True`, what generate() asks for): a transformers Cache (the DynamicCache
generate builds) holds the backbone's keys and values in its layers 0..L-1 and, in one more layer
at index L (`CopyLayer`), the copy head's keys k_j (float32, RoPE'd at their absolute positions)
and the token ids x_j (int64: never the model's dtype, where a bf16 id above 256 would round).
Every Cache operation generate applies loops over the layers, so it reaches the copy state too:
reorder_cache (beam search), batch_repeat_interleave, batch_select_indices, crop. A step
feeds only the new tokens: their keys and ids are appended, their queries (and only the last one
in generate: logits_to_keep) score every cached key. The cache stores the ids, not the pasted
tokens, because paste `next` pastes x_{j+1} at j, which arrives with the following step.

Without a cache (use_cache False or None with no cache: a plain forward, as scoring wants) every
step recomputes the whole sequence exactly as the copy head always has. Rows are assumed
unpadded: generate() refuses an attention mask with zeros (one line); positions are 0..T-1.
"""

import math

import torch
import torch.nn.functional as F
try:  # the Cache API of transformers 5 (a cache layer class, the `cache` keyword)
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.modeling_utils import slice_logits_to_keep
    from transformers.utils.deprecation import deprecate_kwarg
except ImportError as e:
    import transformers

    raise ImportError(f"this copy-on export's code needs transformers >= 5.24 (its Cache API), this is transformers "
                      f"{transformers.__version__} ({e}): pip install 'transformers>=5.24'") from None

NEG_INF = float("-inf")


def _rope(x, theta, scaling, positions):
    """Rotate-half rotary embedding of x (B, H, n, d) at `positions` (n,), in float32;
    `scaling` {type, factor}: linear divides the positions by factor, ntk multiplies theta by
    factor ** (d / (d - 2))."""
    d = x.shape[-1]
    positions = positions.to(device=x.device, dtype=torch.float32)
    if scaling and scaling["type"] == "ntk":
        theta = theta * scaling["factor"] ** (d / (d - 2))
    elif scaling:
        positions = positions / scaling["factor"]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = torch.outer(positions, inv)
    ang = torch.cat([ang, ang], dim=-1)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * ang.cos() + rotated * ang.sin()


def _masked_lse(x, dim):
    """logsumexp over dim; -inf (not nan) where every entry is -inf."""
    m = x.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = torch.exp(x - m).sum(dim=dim, keepdim=True)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    return torch.where(total > 0, m + torch.log(safe), torch.full_like(total, NEG_INF)).squeeze(dim)


def _copy_theta(c):
    """The copy head's RoPE base: copy_rope_theta, else the backbone's rope_theta."""
    return getattr(c, "copy_rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get(
        "rope_theta", getattr(c, "rope_theta", 10000.0))


class CopyHead(torch.nn.Module):
    """q, k (H_c heads of d_c) and the mix's own parameters, named as cplm_dist's copy head."""

    def __init__(self, config):
        super().__init__()
        width = config.copy_num_heads * config.copy_head_dim
        self.q = torch.nn.Linear(config.hidden_size, width, bias=False)
        self.k = torch.nn.Linear(config.hidden_size, width, bias=False)
        if config.copy_mix in ("gate", "joint_gate"):
            self.gate = torch.nn.Linear(config.hidden_size, 1, bias=True)
        elif config.copy_mix == "sentinel":
            self.sentinel = torch.nn.Parameter(torch.zeros(config.copy_num_heads, config.copy_head_dim))


class CopyLayer(DynamicLayer):
    """The copy head's part of a Cache, one layer after the backbone's: keys = the copy keys
    (B, H_c, T, d_c) float32, values = the token ids (B, 1, T, 1) int64. A DynamicLayer, so
    growing on dim -2, beam reordering, batch repeats and selections, and crops are its own."""


def copy_layer(cache, num_layers: int, past: int) -> CopyLayer:
    """The cache's CopyLayer (index num_layers), added to a cache that holds no position yet;
    checked before the backbone writes into the cache, so a foreign cache is refused untouched."""
    layers = cache.layers
    static = next((type(x).__name__ for x in layers[:num_layers] if not isinstance(x, DynamicLayer)), None)
    if static is not None:  # cache_implementation="static": generate builds its masks for fixed-size layers, and with
        # the copy layer beside them it chose other tokens than the uncached path (tried), so refused
        raise ValueError(f"CPLM keeps its copy-head state in a dynamic cache, this one has a {static}: use the default "
                         "cache (no cache_implementation, or a DynamicCache)")
    if len(layers) > num_layers:
        layer = layers[num_layers]
        if not isinstance(layer, CopyLayer) or layer.get_seq_length() != past:
            held = layer.get_seq_length() if isinstance(layer, CopyLayer) else "no"
            raise ValueError(f"this cache's copy-head layer holds {held} positions, its backbone {past}: pass the cache "
                             "this model returned (or none)")
        return layer
    if past:
        raise ValueError(f"this cache holds {past} backbone positions but no copy-head state: pass the cache this "
                         "model returned (or none)")
    if len(layers) < num_layers and cache.layer_class_to_replicate is None:
        raise ValueError(f"this cache has {len(layers)} layers for a {num_layers}-layer backbone")
    while len(layers) < num_layers:  # a lazily grown cache: the backbone's layers first, as Cache.update adds them
        layers.append(cache.layer_class_to_replicate())
    layers.append(CopyLayer())
    return layers[num_layers]


def _kept_rows(logits_to_keep):
    """Which of the new positions to score, as transformers' slice_logits_to_keep picks them
    (an int keeps the last ones, 0 all; a 1-D tensor names them)."""
    if isinstance(logits_to_keep, int):
        return slice(-logits_to_keep, None)
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 1:
        return logits_to_keep
    raise ValueError("logits_to_keep: an int or a 1-D tensor of positions (the copy head scores the same positions "
                     "in every row)")


class CopyMixtureMixin:
    """The copy head's forward, mixture and cache on top of a transformers causal LM (first in the
    bases, so its __init__, forward and prepare_inputs_for_generation are the ones used). The
    backbone is `self.base_model` (Llama's and Qwen3's `model`, GPT-2's `transformer`), its head
    `self.lm_head`."""

    def __init__(self, config):
        super().__init__(config)
        self.copy_head = CopyHead(config)
        self.post_init()

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """generate()'s inputs (transformers' own: with a cache, the new tokens only), after
        refusing padding: generate drops an all-ones mask, so any mask here has zeros."""
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            row, col = (~attention_mask.bool()).nonzero()[0].tolist()
            raise ValueError(f"CPLM generate: attention_mask row {row} has a 0 at position {col} (padding); the copy head "
                             "reads every position of a row, so rows must be unpadded: generate prompts of different "
                             "lengths in separate calls (a prompt token equal to pad_token_id reads as padding too: pass "
                             "attention_mask=torch.ones_like(input_ids))")
        return super().prepare_inputs_for_generation(input_ids, attention_mask=attention_mask, **kwargs)

    def _heads(self, linear, h, positions):
        """One projection of h (B, n, D) as (B, H_c, n, d_c) float32, RoPE'd at `positions` if copy_rope."""
        c, (B, n, _) = self.config, h.shape
        x = linear(h).view(B, n, c.copy_num_heads, c.copy_head_dim).transpose(1, 2).float()
        return _rope(x, _copy_theta(c), getattr(c, "copy_rope_scaling", None), positions) if c.copy_rope else x

    def _copy_terms(self, h, input_ids):
        """The whole sequence's (copy_all (B, T), copy log-probs (B, T, V), gate score (B, T) or None)."""
        positions = torch.arange(h.shape[1], device=h.device)
        q, k = self._heads(self.copy_head.q, h, positions), self._heads(self.copy_head.k, h, positions)
        return self._terms(h, q, k, input_ids, positions)

    def _terms(self, h, q, keys, ids, positions):
        """Copy terms of the queries q (B, H, n, d) at absolute `positions` (n,), from the hidden
        states h (B, n, D), against the keys (B, H, K, d) and ids (B, K) of positions 0..K-1."""
        c, (B, n, _), K = self.config, h.shape, keys.shape[2]
        H, d = c.copy_num_heads, c.copy_head_dim
        shift = -1 if c.copy_paste == "next" else 0
        cand = torch.arange(K, device=h.device)[None, :] <= positions[:, None] + shift  # (n, K)
        scores = (q @ keys.transpose(-1, -2) / math.sqrt(d)).masked_fill(~cand, NEG_INF)  # (B, H, n, K)
        a_heads = _masked_lse(scores, dim=-1)  # (B, H, n)
        if c.copy_mix == "gate":  # each head normalised on its own, then averaged
            copy_all = torch.where(torch.isfinite(a_heads[:, 0]), 0.0, NEG_INF)
            norm = a_heads
        else:  # the heads' candidates pooled with weight 1/H
            copy_all = _masked_lse(a_heads, dim=1) - math.log(H)
            norm = copy_all.unsqueeze(1)
        norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
        weights = torch.exp(scores - norm.unsqueeze(-1)).mean(dim=1)  # (B, n, K)
        src = ids if c.copy_paste == "self" else torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -1)], 1)
        owned = src >= 0  # paste next: the last position's token is still to come (never a candidate)
        mass = torch.zeros(B, n, c.vocab_size, dtype=torch.float32, device=h.device)
        w = weights * owned.unsqueeze(1)
        mass.scatter_add_(2, torch.where(owned, src, torch.zeros_like(src)).unsqueeze(1).expand_as(w), w)
        gate = None
        if c.copy_mix in ("gate", "joint_gate"):
            gate = self.copy_head.gate(h).squeeze(-1).float()
        elif c.copy_mix == "sentinel":
            sent = torch.einsum("bhtd,hd->bht", q, self.copy_head.sentinel.float()) / math.sqrt(d)
            gate = torch.logsumexp(sent, dim=1) - math.log(H)
        return copy_all, torch.log(mass), gate

    def _mix_weights(self, lse, copy_all, gate):
        has = torch.isfinite(copy_all)
        if self.config.copy_mix in ("gate", "joint_gate"):
            safe_all = torch.where(has, copy_all, torch.zeros_like(copy_all))
            if self.config.copy_mix == "joint_gate":  # the gate over the joint mix's evidence
                gate = gate + lse - safe_all
            return (torch.where(has, F.logsigmoid(gate), torch.zeros_like(gate)),
                    torch.where(has, F.logsigmoid(-gate) - safe_all, torch.full_like(gate, NEG_INF)))
        if self.config.copy_mix == "joint":
            log_z = torch.logaddexp(lse, copy_all)
            return lse - log_z, -log_z
        s = torch.logaddexp(gate, copy_all)
        return gate - s, -s

    def _log_probs(self, h, copy_all, copy_lp, gate):
        """The mixture's log-probabilities (B, n, V) at the hidden states h (B, n, D)."""
        z = self.lm_head(h).float()
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        w_lm, w_copy = self._mix_weights(lse, copy_all.unsqueeze(-1), None if gate is None else gate.unsqueeze(-1))
        return torch.logaddexp(w_lm + z - lse, w_copy + copy_all.unsqueeze(-1) + copy_lp)

    def _cached_log_probs(self, input_ids, attention_mask, cache, logits_to_keep):
        """Feed the new tokens through the backbone and the copy head's part of `cache`; the
        log-probs of the kept positions (B, k, V)."""
        past = cache.get_seq_length()
        layer = copy_layer(cache, self.config.num_hidden_layers, past)
        h = self.base_model(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                            use_cache=True).last_hidden_state
        n = h.shape[1]
        new_positions = torch.arange(past, past + n, device=h.device)
        keys, ids = layer.update(self._heads(self.copy_head.k, h, new_positions), input_ids[:, None, :, None])
        rows = _kept_rows(logits_to_keep)
        h, positions = h[:, rows], new_positions[rows]
        q = self._heads(self.copy_head.q, h, positions)
        return self._log_probs(h, *self._terms(h, q, keys, ids[:, 0, :, 0], positions))

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(self, input_ids=None, attention_mask=None, cache=None, labels=None, use_cache=None, logits_to_keep=0,
                **kwargs):
        """logits = the mixture's log-probabilities at the kept positions (logits_to_keep, as
        transformers' models: 0 all). With use_cache=True or a cache: input_ids are the tokens
        after the cached ones, and the cache is returned; else the whole sequence, recomputed (a
        plain forward builds no cache). labels: the mean NLL of labels[:, 1:] (all positions kept)."""
        if input_ids is None:
            raise ValueError("CPLM needs input_ids: the copy head pastes token ids (inputs_embeds is not supported)")
        if labels is not None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError("labels need every position: pass logits_to_keep=0 with labels")
        if use_cache or (use_cache is None and cache is not None):
            cache = cache if cache is not None else DynamicCache(config=self.config)
            log_p = self._cached_log_probs(input_ids, attention_mask, cache, logits_to_keep)
        else:  # the reference path: every position, then the kept ones
            cache = None
            h = self.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
            log_p = slice_logits_to_keep(self._log_probs(h, *self._copy_terms(h, input_ids)), logits_to_keep)
        loss = None
        if labels is not None:
            loss = F.nll_loss(log_p[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=log_p, cache=cache)
