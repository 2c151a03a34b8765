"""Speculative decoding: a draft proposes the next tokens, the model checks them all in one
forward pass, and every token the check accepts saves a decode step.

A round, for one request whose last accepted token is not in the model's KV cache yet:

1. The draft proposes up to `k` tokens: prompt lookup copies what followed the latest earlier
   occurrence of the context's last n-gram (no second model); a draft model (a smaller one
   with the same vocabulary, or the same one with fewer layers or quantized) decodes them.
2. The model runs the last accepted token and the proposals in one pass (`LLM.score`), which
   gives its next-token distribution after each of them.
3. Proposals are accepted in order while the rejection test passes (Leviathan et al. 2023:
   accept x with probability min(1, p(x) / q(x)), p the model's distribution, q the draft's);
   at the first rejection the token is drawn from the rest of p (max(0, p - q), normalized),
   and when all pass, one more from the model's distribution after the last. The tokens made
   follow the model's own distribution exactly, and under greedy decoding they are the tokens
   plain decoding makes.
4. Both KV caches are rolled back (`popn`) past the first rejected proposal.

The number of proposals adapts to what rounds cost and yield (`Pace`): none (a plain decode
step) where checking more tokens would not pay for itself.

Works on anything with the engine's KV-cache steps (`KVModel`), so this module does not import
the engine; the engine calls `speculative_rounds` from its token loop.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Protocol, Sequence

import numpy as np

from ..errors import LLMError
from .config import LLMConfig
from .request import Request, SpeculationStats
from .sampling import Sampler

PROMPT_LOOKUP = "prompt-lookup"


class KVModel(Protocol):
    """The engine's KV-cache steps that speculation uses (`engine.LLM` has them)."""

    config: LLMConfig

    def add_sequence(self) -> int: ...
    def remove_sequence(self, seq_id: int) -> None: ...
    def popn(self, seq_id: int, n: int) -> None: ...
    def sequence_length(self, seq_id: int) -> int: ...
    def prefill(self, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]]) -> np.ndarray: ...
    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> np.ndarray: ...
    def score(self, seq_id: int, tokens: Sequence[int]) -> np.ndarray: ...


@dataclasses.dataclass
class Draft:
    """Where proposals come from: `"prompt-lookup"` or a loaded model with the same
    vocabulary. `k` proposals per round at most (fewer where they do not pay; always `k` when
    not `adaptive`); prompt lookup matches the context's last `ngram` tokens, then fewer, down
    to one."""

    source: str | KVModel
    k: int = 4
    ngram: int = 3
    adaptive: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.source, str) and self.source != PROMPT_LOOKUP:
            raise LLMError(f"a draft is {PROMPT_LOOKUP!r} or a loaded model, not {self.source!r}")
        if not (isinstance(self.k, int) and self.k >= 1):
            raise LLMError(f"a draft proposes k >= 1 tokens a round, not {self.k!r}")
        if not (isinstance(self.ngram, int) and self.ngram >= 1):
            raise LLMError(f"prompt lookup matches n-grams of n >= 1, not {self.ngram!r}")

    @property
    def name(self) -> str:
        return self.source if isinstance(self.source, str) else "draft model"


def lookup_proposals(context: Sequence[int], k: int, ngram: int) -> tuple[list[int], int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the context's last
    n-gram, trying n = `ngram` down to 1, and the n that matched (([], 0): no occurrence)."""
    tokens = np.asarray(context)
    for n in range(min(ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        # Every start of an earlier n-gram equal to the tail, latest first.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == tail).all(axis=1))
        if starts.size:
            start = int(starts[-1]) + n
            return tokens[start:start + k].tolist(), n
    return [], 0


def accept_proposals(sampler: Sampler, model_probs: Sequence[np.ndarray], proposals: Sequence[int],
                     draft_probs: Sequence[np.ndarray] | None) -> list[int]:
    """The tokens a round makes: the accepted proposals, then one drawn by the model (from
    the rest of its distribution after a rejection, or after the last proposal).

    `model_probs[i]` is the model's distribution before proposal i (one more than there are
    proposals); `draft_probs[i]` the draft's, from which proposal i was drawn (None: the
    proposals were not drawn but looked up, a distribution all on the proposed token)."""
    made = []
    for i, token in enumerate(proposals):
        p = model_probs[i]
        q = draft_probs[i] if draft_probs is not None else _one_hot(token, p.size)
        if q[token] > 0 and sampler.uniform() < p[token] / q[token]:
            made.append(token)
            continue
        rest = np.maximum(p - q, 0.0)
        made.append(sampler.draw(rest if rest.sum() > 0 else p))
        return made
    made.append(sampler.draw(model_probs[len(proposals)]))
    return made


class Pace:
    """How many tokens to propose next, from what rounds have cost and yielded so far.

    Each proposal is taken to be accepted with probability a until the first rejection, so k
    proposals make (1 - a^(k+1)) / (1 - a) tokens in expectation (at least the model's own
    one); they cost one check of k + 1 tokens, k proposals and, for k > 0, what proposing costs
    a round besides (`round_s`: a draft model's step on the model's own token). The k in
    0..k_max (0: a plain decode step) with the most tokens per second wins.

    a is estimated per kind of proposal (`kind`: for prompt lookup the length of the n-gram
    that matched, a longer match being a better guess; 0 for a draft model) from the accepted
    proposals and the rejections (at most one a round) of its rounds, counted with decay
    (copied spans come and go within one output) over a uniform prior. A check of n tokens is
    taken to cost what it last cost (an average with the time before); an n not timed yet, what
    the longest check timed below it cost: an optimistic guess, so it gets tried and timed
    (checking a few tokens costs little more than one, which a line through one token and
    k_max would hide). After `PROBE` plain steps in a row one proposal is made again, where a
    higher acceptance would make proposals pay (acceptance changes; their cost does not)."""

    DECAY = 0.5    # weight of earlier rounds' counts against the latest round's
    PROBE = 4      # plain steps in a row before one proposal is tried again

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.check_s: dict[int, float] = {}   # tokens checked -> seconds
        self.propose_s = 0.0                  # seconds a proposal
        self.round_s = 0.0                    # seconds of proposing a round besides its proposals
        self.plain_rounds = 0                 # rounds in a row without proposals
        self.counts: dict[int, tuple[float, float]] = {}  # kind -> (accepted, rejected), decayed

    def record(self, checked: int, check_s: float, proposed: int, accepted: int, propose_s: float,
               kind: int = 0, round_s: float = 0.0) -> None:
        before = self.check_s.get(checked)
        self.check_s[checked] = check_s if before is None else (before + check_s) / 2
        self.plain_rounds = 0 if proposed else self.plain_rounds + 1
        if proposed:
            kept, rejected = self.counts.get(kind, (0.0, 0.0))
            self.counts[kind] = (self.DECAY * kept + accepted,
                                 self.DECAY * rejected + (accepted < proposed))
            self.propose_s, self.round_s = propose_s / proposed, round_s

    def acceptance(self, kind: int = 0) -> float:
        """The estimated chance that a proposal of this kind is accepted."""
        kept, rejected = self.counts.get(kind, (0.0, 0.0))
        return (kept + 1) / (kept + rejected + 2)

    def check_cost(self, tokens: int) -> float:
        """Seconds a check of `tokens` tokens is taken to cost (`check_s` timed at 1)."""
        return self.check_s.get(tokens) or self.check_s[max(n for n in self.check_s if n < tokens)]

    def next_k(self, kind: int = 0, available: int | None = None) -> int:
        """The best k for proposals of this `kind` (at most `available` of them at hand);
        0 until a plain step has been timed."""
        if 1 not in self.check_s:
            return 0
        a = min(self.acceptance(kind), 0.999)

        def rate(k: int, a: float = a) -> float:
            made = (1 - a ** (k + 1)) / (1 - a)
            return made / (self.check_cost(k + 1) + self.propose_s * k + (self.round_s if k else 0.0))

        most = self.k_max if available is None else min(self.k_max, available)
        best = max(range(most + 1), key=rate)
        if best == 0 and self.plain_rounds >= self.PROBE and most:
            return 1 if max(rate(k, 0.999) for k in range(1, most + 1)) > rate(0) else 0
        return best


def _one_hot(token: int, size: int) -> np.ndarray:
    probs = np.zeros(size)
    probs[token] = 1.0
    return probs


class _DraftModel:
    """A draft model's sequence for one request, kept in step with the accepted tokens."""

    def __init__(self, model: KVModel, request: Request):
        self.model, self.request = model, request
        self.seq_id = model.add_sequence()
        self.step_s = 0.0  # seconds of the draft's latest decode step

    def propose(self, k: int) -> tuple[list[int], list[np.ndarray]]:
        """`k` tokens drawn from the draft, and the distribution each was drawn from."""
        context = self.request.prompt + self.request.new
        logits = self._run(context[self.model.sequence_length(self.seq_id):])
        tokens, probs = [], []
        sampler = self.request.sampler  # the same processing (penalty, top-k, top-p) as the model's
        for step in range(k):
            probs.append(sampler.probabilities(logits, context + tokens))
            tokens.append(sampler.draw(probs[-1]))
            if step + 1 < k:
                logits = self._run(tokens[-1:])
        return tokens, probs

    def _run(self, tokens: list[int]) -> np.ndarray:
        """The draft's logits after `tokens`. A round leaves the draft at most two tokens
        behind (its last proposal and the model's own token): those go through decode steps,
        the fast kernels (a quantized draft's prefill dequantizes every weight); the prompt
        through prefill."""
        if len(tokens) > 2:
            return self.model.prefill([self.seq_id], [tokens])[0]
        for token in tokens:
            started = time.perf_counter()
            logits = self.model.decode([self.seq_id], [token])[0]
            self.step_s = time.perf_counter() - started
        return logits

    def keep(self, length: int) -> None:
        """Roll the draft's cache back to the first `length` tokens of the context."""
        self.model.popn(self.seq_id, max(0, self.model.sequence_length(self.seq_id) - length))

    def close(self) -> None:
        self.model.remove_sequence(self.seq_id)


def speculative_rounds(model: KVModel, request: Request, draft: Draft,
                       stats: SpeculationStats) -> Iterator[None]:
    """Advance `request` (prefilled: its last accepted token not yet in the cache) round by
    round until it is done; yields after each round."""
    if not isinstance(draft.source, str) and draft.source.config.vocab_size != model.config.vocab_size:
        raise LLMError(f"the draft model's vocabulary ({draft.source.config.vocab_size} tokens) is "
                       f"not the model's ({model.config.vocab_size})")
    drafter = _DraftModel(draft.source, request) if not isinstance(draft.source, str) else None
    pace = Pace(draft.k)
    try:
        while not request.done:
            context = request.prompt + request.new
            # A round makes one token more than it accepts, and the cache takes every proposal.
            budget = min(draft.k, request.max_new_tokens - len(request.new) - 1,
                         request.context_window - len(context))
            started = time.perf_counter()
            if drafter is not None:
                kind = 0
                wanted = pace.next_k(kind, budget) if draft.adaptive else budget
                proposals, draft_probs = drafter.propose(wanted) if wanted else ([], None)
            else:
                found, kind = lookup_proposals(context, budget, draft.ngram)
                wanted = pace.next_k(kind, len(found)) if draft.adaptive else len(found)
                proposals, draft_probs = found[:wanted], None
            proposed_at = time.perf_counter()
            logits = model.score(request.seq_id, [request.new[-1], *proposals])
            checked_at = time.perf_counter()
            history = list(context)
            model_probs = []
            for i, row in enumerate(logits):
                model_probs.append(request.sampler.probabilities(row, history))
                history.extend(proposals[i:i + 1])
            made = accept_proposals(request.sampler, model_probs, proposals, draft_probs)
            accepted = len(made) - 1
            stats.rounds += 1
            stats.proposed += len(proposals)
            stats.accepted += accepted
            # The cache now holds the last token and every proposal; keep the accepted ones.
            model.popn(request.seq_id, len(proposals) - accepted)
            for token in made:
                request.accept(token)
                if request.done:
                    break
            if drafter is not None:
                drafter.keep(len(context) + accepted)
            # A draft model's price: a step per proposal and one on the model's token (catching
            # up on the prompt, or after plain steps, is no part of a round's price).
            propose_s, round_s = ((proposed_at - started, 0.0) if drafter is None
                                  else (drafter.step_s * len(proposals), drafter.step_s))
            pace.record(len(proposals) + 1, checked_at - proposed_at, len(proposals), accepted, propose_s, kind,
                        round_s)
            yield
    finally:
        if drafter is not None:
            drafter.close()


__all__ = ["Draft", "KVModel", "PROMPT_LOOKUP", "accept_proposals",
           "lookup_proposals", "speculative_rounds"]
