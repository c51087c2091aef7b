"""CPLMForCausalLM: Llama with the Copy-Paste head beside its LM head; the logits it returns are
the log-probabilities of the copy/LM mixture (softmax of them is the mixture), so `generate()`
samples from the mixture.

For one copy head, s_tj = q_t . k_j / sqrt(d_c) over the candidates C_t (paste `next`: j < t
pastes x_{j+1}; `self`: j <= t pastes x_j); A_t = logsumexp_{C_t} s_tj. Each mix is two
log-weights, log p(w) = logaddexp(lm + log softmax(z)_w, copy + log copy_mass_w):
  gate      g = sigmoid(gate(h_t)): lm = log g, copy = log(1 - g) - A (lm = 0 when C_t is empty)
  joint     one softmax over the vocabulary and the positions: lm = LSE - log Z, copy = -log Z
  sentinel  a sentinel score S_0 joins the copy softmax: lm = S_0 - S, copy = -S
Several heads: gate averages the heads' copy distributions; joint and sentinel pool the heads'
candidates with weight 1/H. No KV cache: every step recomputes the whole sequence (the copy head
needs every position's key and id), and rows are assumed unpadded.
"""

import math

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_cplm import CPLMConfig

NEG_INF = float("-inf")


def _rope(x, theta, scaling=None):
    """Rotate-half rotary embedding of x (B, H, T, d) at positions 0..T-1, in float32; `scaling`
    {type, factor}: linear divides the positions by factor, ntk multiplies theta by
    factor ** (d / (d - 2))."""
    d, T = x.shape[-1], x.shape[-2]
    positions = torch.arange(T, device=x.device, dtype=torch.float32)
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


class CopyHead(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        width = config.copy_num_heads * config.copy_head_dim
        self.q = torch.nn.Linear(config.hidden_size, width, bias=False)
        self.k = torch.nn.Linear(config.hidden_size, width, bias=False)
        if config.copy_mix == "gate":
            self.gate = torch.nn.Linear(config.hidden_size, 1, bias=True)
        elif config.copy_mix == "sentinel":
            self.sentinel = torch.nn.Parameter(torch.zeros(config.copy_num_heads, config.copy_head_dim))


class CPLMForCausalLM(LlamaForCausalLM):
    config_class = CPLMConfig

    def __init__(self, config):
        super().__init__(config)
        self.copy_head = CopyHead(config)
        self.post_init()

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return {"input_ids": input_ids}  # no cache: the whole sequence every step

    def _copy_terms(self, h, input_ids):
        """(copy_all (B, T), copy log-probs (B, T, V), gate score (B, T) or None)."""
        c, (B, T, _) = self.config, h.shape
        H, d = c.copy_num_heads, c.copy_head_dim
        q = self.copy_head.q(h).view(B, T, H, d).transpose(1, 2).float()
        k = self.copy_head.k(h).view(B, T, H, d).transpose(1, 2).float()
        if c.copy_rope:
            theta = getattr(c, "copy_rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get(
                "rope_theta", getattr(c, "rope_theta", 10000.0))
            scaling = getattr(c, "copy_rope_scaling", None)
            q, k = _rope(q, theta, scaling), _rope(k, theta, scaling)
        shift = -1 if c.copy_paste == "next" else 0
        cand = torch.ones(T, T, dtype=torch.bool, device=h.device).tril(diagonal=shift)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~cand, NEG_INF)  # (B, H, T, T)
        a_heads = _masked_lse(scores, dim=-1)  # (B, H, T)
        if c.copy_mix == "gate":  # each head normalised on its own, then averaged
            copy_all = torch.where(torch.isfinite(a_heads[:, 0]), 0.0, NEG_INF)
            norm = a_heads
        else:  # the heads' candidates pooled with weight 1/H
            copy_all = _masked_lse(a_heads, dim=1) - math.log(H)
            norm = copy_all.unsqueeze(1)
        norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
        weights = torch.exp(scores - norm.unsqueeze(-1)).mean(dim=1)  # (B, T, T)
        src = input_ids if c.copy_paste == "self" else torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], -1)], 1)
        owned = src >= 0
        mass = torch.zeros(B, T, c.vocab_size, dtype=torch.float32, device=h.device)
        w = weights * owned.unsqueeze(1)
        mass.scatter_add_(2, torch.where(owned, src, torch.zeros_like(src)).unsqueeze(1).expand_as(w), w)
        gate = None
        if c.copy_mix == "gate":
            gate = self.copy_head.gate(h).squeeze(-1).float()
        elif c.copy_mix == "sentinel":
            sent = torch.einsum("bhtd,hd->bht", q, self.copy_head.sentinel.float()) / math.sqrt(d)
            gate = torch.logsumexp(sent, dim=1) - math.log(H)
        return copy_all, torch.log(mass), gate

    def _mix_weights(self, lse, copy_all, gate):
        has = torch.isfinite(copy_all)
        if self.config.copy_mix == "gate":
            safe_all = torch.where(has, copy_all, torch.zeros_like(copy_all))
            return (torch.where(has, F.logsigmoid(gate), torch.zeros_like(gate)),
                    torch.where(has, F.logsigmoid(-gate) - safe_all, torch.full_like(gate, NEG_INF)))
        if self.config.copy_mix == "joint":
            log_z = torch.logaddexp(lse, copy_all)
            return lse - log_z, -log_z
        s = torch.logaddexp(gate, copy_all)
        return gate - s, -s

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        h = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        z = self.lm_head(h).float()
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        copy_all, copy_lp, gate = self._copy_terms(h, input_ids)
        w_lm, w_copy = self._mix_weights(lse, copy_all.unsqueeze(-1), None if gate is None else gate.unsqueeze(-1))
        log_p = torch.logaddexp(w_lm + z - lse, w_copy + copy_all.unsqueeze(-1) + copy_lp)
        loss = None
        if labels is not None:
            loss = F.nll_loss(log_p[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=log_p)
