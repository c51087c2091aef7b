"""Reference models the evaluation suite is scored with in the tests: chance level and an oracle."""

from __future__ import annotations

import math

import torch


class UniformModel:
    """Every next token equally likely: the suite's chance level."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def next_token_logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.full((*ids.shape, self.vocab_size), -math.log(self.vocab_size))


class OracleModel:
    """Knows the sequences it is evaluated on: puts all mass on the true next token wherever the
    input is a prefix of one of them (uniform elsewhere). The suite must score it perfectly."""

    def __init__(self, vocab_size: int, sequences: list[list[int]]):
        self.vocab_size = vocab_size
        self.sequences = [tuple(s) for s in sequences]

    def next_token_logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.full((*ids.shape, self.vocab_size), -math.log(self.vocab_size))
        for b, row in enumerate(ids.tolist()):
            full = next((s for s in self.sequences if s[: len(row)] == tuple(row)), None)
            if full is None:
                continue
            for t in range(min(len(row), len(full) - 1)):
                out[b, t] = float("-inf")
                out[b, t, full[t + 1]] = 0.0
        return out
