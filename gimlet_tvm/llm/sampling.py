"""Choosing the next token from the model's logits, and finding stop strings in the output.

The logits processing follows transformers' (`RepetitionPenaltyLogitsProcessor`, then
`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`), so a setting means what it
means there; the random draw is numpy's, seeded per request for repeatable output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import LLMError

# A temperature below this is greedy, as in vLLM: logits / temperature would overflow float32
# (then the draw's probabilities are NaN, and it picked an id past the vocabulary).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token. `temperature` 0 (or below `GREEDY_BELOW`) is greedy (the most
    likely token, no randomness); otherwise tokens are drawn from the softmax of logits /
    temperature, restricted to the `top_k` most likely (0: all) and to the smallest set
    reaching probability `top_p`.
    `repetition_penalty` > 1 makes tokens already in the prompt or output less likely. `seed`
    makes the draws repeatable; `stop` ends the output before the first of these strings (a
    single string is one stop string)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise LLMError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise LLMError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (isinstance(self.top_k, (int, np.integer)) and self.top_k >= 0):
            raise LLMError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not self.repetition_penalty > 0:
            raise LLMError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not (self.seed is None or isinstance(self.seed, (int, np.integer)) and self.seed >= 0):
            raise LLMError(f"seed must be an integer >= 0 or None, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise LLMError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)


class Sampler:
    """Picks tokens for one request under its `SamplingParams`; holds the request's random
    generator, so the same seed gives the same tokens."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def next_token(self, logits: np.ndarray, history: Sequence[int]) -> int:
        """The next token id, from the logits (shape (vocab,)) of the last position and the
        ids so far (prompt and generated), which the repetition penalty looks at."""
        if self.params.temperature == 0:
            return int(np.argmax(self.process(logits, history)))  # the first of equal maxima, as torch.argmax
        return self.draw(self.probabilities(logits, history))

    def probabilities(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The distribution `next_token` draws from (float64, sums to 1); greedy is all on
        the most likely token. Speculative decoding compares the model's and the draft's."""
        scores = self.process(logits, history)
        if self.params.temperature == 0:
            probs = np.zeros(scores.size)
            probs[np.argmax(scores)] = 1.0
            return probs
        probs = np.exp(scores.astype(np.float64) - scores.max())
        return probs / probs.sum()

    def draw(self, probs: np.ndarray) -> int:
        """A token drawn from `probs` (weights; they need not sum to 1)."""
        cdf = np.cumsum(probs)
        return int(np.searchsorted(cdf, self._rng.random() * cdf[-1], side="right"))

    def uniform(self) -> float:
        """A draw in [0, 1) from the request's generator (a draft token's acceptance test)."""
        return float(self._rng.random())

    def process(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The logits the draw uses: penalized, divided by the temperature, the tokens top-k
        and top-p drop set to -inf (greedy applies the penalty only)."""
        p = self.params
        scores = np.array(logits, dtype=np.float32)
        if p.repetition_penalty != 1.0 and len(history):
            seen = np.unique(np.asarray(history, dtype=np.int64))
            if seen[0] < 0 or seen[-1] >= scores.size:
                outside = seen[(seen < 0) | (seen >= scores.size)]
                raise LLMError(f"token id {outside[0]} is outside the vocabulary (0..{scores.size - 1})")
            picked = scores[seen]
            scores[seen] = np.where(picked < 0, picked * p.repetition_penalty, picked / p.repetition_penalty)
        if p.temperature == 0:
            return scores
        scores /= np.float32(p.temperature)
        if 0 < p.top_k < scores.size:
            # Ties with the k-th largest stay, as in transformers.
            kth = np.partition(scores, scores.size - p.top_k)[scores.size - p.top_k]
            scores[scores < kth] = -np.inf
        if p.top_p < 1.0:
            # From the least likely up, drop tokens while their cumulative probability stays
            # <= 1 - top_p; the most likely token always stays.
            order = np.argsort(scores, kind="stable")
            ranked = scores[order].astype(np.float64)
            cumulative = np.cumsum(np.exp(ranked - ranked[-1]))
            drop = cumulative <= (1.0 - p.top_p) * cumulative[-1]
            drop[-1] = False
            scores[order[drop]] = -np.inf
        return scores


def find_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where the earliest stop string starts in `text`, or None."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found, default=None)


def stop_holdback(text: str, stop: Sequence[str]) -> int:
    """How many characters at the end of `text` could be the start of a stop string, and so
    must wait for more text before they are streamed out."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
