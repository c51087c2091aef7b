"""lm-evaluation-harness requests answered by a CPLM, batched (the optional `lm-eval` package).

    python tools/lm_eval_cplm.py --checkpoint runs/x --tasks cplm_local --batch-size 16
    lm_eval --model cplm --model_args checkpoint=runs/x --tasks cplm_local --include_path <tasks dir>

`HarnessAdapter` answers the harness's three request types from the model's mixed next-token
distribution (so the copy head's mass counts), read at the targets by `CPLM.score` without ever
gathering the vocabulary (a (B, T, V) fp32 tensor would be 6.4 GB at batch 16 x 2048 tokens and
V = 49152), and from greedy generation with the KV cache. It does not need lm-eval (its answers
are tested directly against the model); the harness's model class is
cplm_dist/evaluation/harness_model.py. Batching (docs/evaluation.md):

- loglikelihood: the options of one question (requests sharing a context) run the context once
  and continue its KV cache, all options of a batch of questions in one forward; other requests
  run as rows of a right-padded batch, longest first (causal: padding after a row's end changes
  none of its positions, the copy head included). Both give batch 1's numbers.
- loglikelihood_rolling: every window of every text is a row of such a batch.
- generate_until: prompts of the same generation settings decode together, of any lengths (left-padded).

Every tensor is made on the model's device.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from cplm_dist.data.loader import IGNORE_INDEX
from cplm_dist.evaluation.generation import device_of, generate


@dataclass
class _Window:
    """One forward row: `inputs`, of which the last len(targets) positions predict `targets`."""

    inputs: list[int]
    targets: list[int]
    request: int


def _progress(total: int, desc: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with datasets; without it, no bar
        enabled = False
    if not enabled:
        class _Quiet:
            def update(self, n): pass
            def close(self): pass
        return _Quiet()
    return tqdm(total=total, desc=desc, unit="req", leave=False)


class HarnessAdapter:
    """Requests are objects with `.args`: (context, continuation), (text,), or (context, gen_kwargs).
    `batch_size` rows at most in one forward; `progress` shows a bar (rank 0 of a launch)."""

    def __init__(self, model, tokenizer, max_length: int | None = None, batch_size: int = 1, progress: bool = False,
                 seed: int = 0):
        """seed: of the sampling generator, which goes on across generate_until batches (the tp
        ranks of a replica draw the same tokens: they see the same requests in the same order)."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: need >= 1")
        self.model, self.tok = model, tokenizer
        self.max_length = max_length or model.model_cfg.max_seq_len
        self.batch_size, self.progress = batch_size, progress
        self.device = device_of(model)
        self.generator = torch.Generator().manual_seed(seed)

    def _tensor(self, rows: list[list[int]]) -> torch.Tensor:
        """(B, longest) ids on the model's device, right-padded with end-of-document."""
        width = max(len(r) for r in rows)
        return torch.tensor([r + [self.tok.eod] * (width - len(r)) for r in rows], dtype=torch.long, device=self.device)

    # --- encoding -----------------------------------------------------------------------------

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as lm-eval's own models split them: the context's
        trailing spaces go to the continuation and the pair is encoded whole, so the boundary
        tokenizes as running text does. An empty context is the end-of-document token."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        context_ids = self.tok.encode(context) if context else []
        whole = self.tok.encode(context + continuation)
        if whole[: len(context_ids)] != context_ids:  # the tokenizer merged across the boundary
            whole = context_ids + self.tok.encode(continuation)
        return context_ids or [self.tok.eod], whole[len(context_ids):]

    def _windows(self, context_ids: list[int], cont_ids: list[int], request: int) -> list[_Window]:
        """The continuation in windows of max_length inputs, each token predicted once from as
        much preceding text as fits (one window unless the continuation is longer than that)."""
        ids, start, out = context_ids + cont_ids, len(context_ids), []
        while start < len(ids):
            end = min(len(ids), start + self.max_length)
            window = ids[max(0, end - self.max_length - 1):end]
            out.append(_Window(window[:-1], window[-(end - start):], request))
            start = end
        return out

    # --- scoring ------------------------------------------------------------------------------

    def _score_windows(self, windows: list[_Window], totals: list[list], bar) -> None:
        """Add each window's log-probability and greedy flag to totals[request] ([logprob, greedy])."""
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i].inputs))
        for b in range(0, len(order), self.batch_size):
            batch = [windows[i] for i in order[b:b + self.batch_size]]
            # each row's targets at its last len(targets) positions; the rest (and the padding) ignored
            targets = self._targets([[IGNORE_INDEX] * (len(w.inputs) - len(w.targets)) + w.targets for w in batch])
            logp, greedy = self.model.score(self._tensor([w.inputs for w in batch]), targets)  # (B, T) each
            for row, w in enumerate(batch):
                end, n = len(w.inputs), len(w.targets)
                self._add_scored(totals[w.request], logp[row, end - n:end], greedy[row, end - n:end])
            bar.update(len(batch))

    def _targets(self, rows: list[list[int]]) -> torch.Tensor:
        """(B, longest) target ids on the model's device, right-padded with IGNORE_INDEX."""
        width = max(len(r) for r in rows)
        return torch.tensor([r + [IGNORE_INDEX] * (width - len(r)) for r in rows], dtype=torch.long, device=self.device)

    @staticmethod
    def _add_scored(total: list, logp: torch.Tensor, greedy: torch.Tensor) -> None:
        """total += the targets' log-probabilities; greedy while every target is the argmax."""
        total[0] += float(logp.sum())
        total[1] = total[1] and bool(greedy.all())

    def _score_shared(self, groups: list[tuple[list[int], list[tuple[int, list[int]]]]], totals: list[list], bar) -> None:
        """Questions whose options share a context: each context but its last token runs once
        (questions of equal context length together) into a decode state, then every option,
        that last token and the option, continues its question's state."""
        by_length = defaultdict(list)
        for g in groups:
            by_length[len(g[0])].append(g)
        for length in sorted(by_length, reverse=True):
            bucket = by_length[length]
            for b in range(0, len(bucket), self.batch_size):
                chunk = bucket[b:b + self.batch_size]
                longest = max(max(len(cont), 1) for _, opts in chunk for _, cont in opts)
                state = self.model.new_decode_state(len(chunk), length - 1 + longest)
                if length > 1:
                    self.model.feed(self._tensor([ctx[:-1] for ctx, _ in chunk]), state)
                options = [(g, req, chunk[g][0][-1:] + cont[:-1], cont) for g, (_, opts) in enumerate(chunk) for req, cont in opts]
                for o in range(0, len(options), self.batch_size):
                    part = options[o:o + self.batch_size]
                    rows = torch.tensor([g for g, _, _, _ in part], dtype=torch.long, device=self.device)
                    targets = self._targets([cont + [IGNORE_INDEX] * (len(inputs) - len(cont)) for _, _, inputs, cont in part])
                    logp, greedy = self.model.score(self._tensor([inputs for _, _, inputs, _ in part]), targets,
                                                    state.select(rows))
                    for row, (_, req, _, cont) in enumerate(part):
                        self._add_scored(totals[req], logp[row, : len(cont)], greedy[row, : len(cont)])
                    bar.update(len(part))

    # --- the harness's request types -------------------------------------------------------------

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether greedy decoding gives the continuation)."""
        pairs = [self.encode_pair(req.args[0], req.args[1]) for req in requests]
        totals = [[0.0, True] for _ in pairs]
        shared, windows = defaultdict(list), []
        for i, (ctx, cont) in enumerate(pairs):
            if len(ctx) + max(len(cont), 1) - 1 <= self.max_length:
                shared[tuple(ctx)].append((i, cont))
            else:
                windows += self._windows(ctx, cont, i)
        groups = []
        for ctx, opts in shared.items():
            if len(opts) > 1:
                groups.append((list(ctx), opts))
            else:
                windows += self._windows(list(ctx), opts[0][1], opts[0][0])
        bar = _progress(len(requests), "loglikelihood", self.progress)
        self._score_shared(groups, totals, bar)
        self._score_windows(windows, totals, bar)
        bar.close()
        return [(t[0], t[1]) for t in totals]

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Whole-text log-likelihood, in windows of max_length tokens, each token predicted once."""
        totals = [[0.0, True] for _ in requests]
        windows = [w for i, req in enumerate(requests) for w in self._windows([self.tok.eod], self.tok.encode(req.args[0]), i)]
        bar = _progress(len(windows), "loglikelihood_rolling", self.progress)
        self._score_windows(windows, totals, bar)
        bar.close()
        return [t[0] for t in totals]

    def generate_until(self, requests) -> list[str]:
        """Greedy (or sampled, at the request's temperature) text up to the first `until` string."""
        settings, batches = [], defaultdict(list)
        for i, req in enumerate(requests):
            context, kwargs = req.args[0], dict(req.args[1])
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = max(1, min(int(kwargs.get("max_gen_toks", 64)), self.max_length - 1))
            # do_sample=False is greedy whatever the temperature (as lm-eval's own models read it)
            temperature = 0.0 if kwargs.get("do_sample") is False else float(kwargs.get("temperature", 0.0))
            ids = (self.tok.encode(context) or [self.tok.eod])[-(self.max_length - max_new):]  # room for max_new
            settings.append((ids, until))
            batches[(max_new, temperature)].append(i)
        out: list[str | None] = [None] * len(requests)
        bar = _progress(len(requests), "generate_until", self.progress)
        for (max_new, temperature), members in sorted(batches.items(), key=lambda kv: -kv[0][0]):
            members.sort(key=lambda i: -len(settings[i][0]))  # similar lengths together: little padding
            for b in range(0, len(members), self.batch_size):
                chunk = members[b:b + self.batch_size]  # prompts of any lengths: each decodes as it would alone
                gen = generate(self.model, [self._tensor([settings[i][0]])[0] for i in chunk], max_new,
                               temperature=temperature, eos_id=self.tok.eod, generator=self.generator)
                for row, i in enumerate(chunk):
                    tokens = gen.tokens[row].tolist()
                    if self.tok.eod in tokens:
                        tokens = tokens[: tokens.index(self.tok.eod)]
                    text = self.tok.decode(tokens)
                    cut = min([text.find(s) for s in settings[i][1] if s and s in text] or [len(text)])
                    out[i] = text[:cut]
                bar.update(len(chunk))
        bar.close()
        return out
