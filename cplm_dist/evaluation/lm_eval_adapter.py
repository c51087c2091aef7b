"""lm-evaluation-harness on a CPLM checkpoint (the optional `lm-eval` package).

    python tools/lm_eval_cplm.py --checkpoint runs/x --tasks lambada_openai hellaswag --limit 20

`HarnessAdapter` answers the harness's three request types from the model's full next-token
distribution (`next_token_logprobs`, so the copy head's mass counts) and from greedy generation
with the KV cache; `register()` makes it the harness model "cplm". The adapter itself does not
need lm-eval, so its answers are tested directly against the model.
"""

from __future__ import annotations

import torch

from cplm_dist.evaluation.generation import generate


class HarnessAdapter:
    """Requests are objects with `.args`: (context, continuation), (text,), or (context, gen_kwargs)."""

    def __init__(self, model, tokenizer, max_length: int | None = None):
        self.model, self.tok = model, tokenizer
        self.max_length = max_length or model.model_cfg.max_seq_len

    def _continuation_logprob(self, context_ids: list[int], cont_ids: list[int]) -> tuple[float, bool]:
        """log p(continuation | context) and whether greedy decoding gives it. A continuation longer
        than the model's window is scored in windows of max_length tokens, each token predicted
        once from as much preceding text as fits (context_ids must not be empty)."""
        ids, start = context_ids + cont_ids, len(context_ids)
        total, greedy = 0.0, True
        while start < len(ids):
            end = min(len(ids), start + self.max_length)
            window = ids[max(0, end - self.max_length - 1):end]
            logprobs = self.model.next_token_logprobs(torch.tensor([window[:-1]]))[0]  # (T, V)
            n = end - start
            targets = torch.tensor(window[-n:])
            total += float(logprobs[-n:].gather(-1, targets[:, None]).sum())
            greedy = greedy and bool((logprobs[-n:].argmax(-1) == targets).all())
            start = end
        return total, greedy

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args[0], req.args[1]
            context_ids = self.tok.encode(context) if context else [self.tok.eod]
            out.append(self._continuation_logprob(context_ids, self.tok.encode(continuation)))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Whole-text log-likelihood, in windows of max_length tokens, each token predicted once."""
        return [self._continuation_logprob([self.tok.eod], self.tok.encode(req.args[0]))[0] for req in requests]

    def generate_until(self, requests) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args[0], dict(req.args[1])
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else until
            max_new = max(1, min(int(kwargs.get("max_gen_toks", 64)), self.max_length - 1))
            ids = (self.tok.encode(context) or [self.tok.eod])[-(self.max_length - max_new):]  # room for max_new
            gen = generate(self.model, torch.tensor([ids]), max_new, temperature=float(kwargs.get("temperature", 0.0)),
                           eos_id=self.tok.eod)
            tokens = gen.tokens[0].tolist()
            if self.tok.eod in tokens:
                tokens = tokens[: tokens.index(self.tok.eod)]
            text = self.tok.decode(tokens)
            cut = min([text.find(s) for s in until if s and s in text] or [len(text)])
            out.append(text[:cut])
        return out


def register() -> None:
    """Make `--model cplm --model_args checkpoint=<path>` available to lm-eval."""
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model

    from cplm_dist.data.gpt_data import tokenizer_for
    from cplm_dist.checkpoint import load_checkpoint_config, load_model
    from cplm_dist.parallel import evaluation_tp, init_distributed

    @register_model("cplm")
    class CPLMHarnessModel(LM):
        def __init__(self, checkpoint: str, **_):
            super().__init__()
            load_checkpoint_config(checkpoint)  # a bad checkpoint: one line before joining a process group
            init_distributed(evaluation_tp())
            model, cfg, _ = load_model(checkpoint)
            self.adapter = HarnessAdapter(model, tokenizer_for(cfg))  # loaded and checked against the model

        def loglikelihood(self, requests):
            return self.adapter.loglikelihood(requests)

        def loglikelihood_rolling(self, requests):
            return self.adapter.loglikelihood_rolling(requests)

        def generate_until(self, requests):
            return self.adapter.generate_until(requests)
