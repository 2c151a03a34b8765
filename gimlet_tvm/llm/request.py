"""One completion request's state, apart from any KV cache: the prompt, the tokens chosen so
far, their text, and when it is done.

The engine's token loop, a server's scheduler and speculative decoding all drive requests
the same way: they run the model, then `choose` a token from the logits and `accept` it, which
decides whether the request has ended (an end token, a stop string, its token budget or the
context window).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from .sampling import Sampler, SamplingParams, find_stop, stop_holdback
from .tokenizer import Tokenizer


@dataclasses.dataclass
class SpeculationStats:
    """What the draft proposed and the model accepted, over a request."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclasses.dataclass
class Request:
    """A prompt (token ids) being completed. `seq_id` is its sequence in the KV cache once
    added; `new` the tokens accepted so far; `finish_reason` is None while it runs, then
    "stop" (end token or stop string) or "length"."""

    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    tokenizer: Tokenizer | None
    context_window: int
    seq_id: int = -1
    new: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    speculation: SpeculationStats | None = None   # set when a draft proposes its tokens
    kv_bytes_moved: int = 0                        # KV pages sent from the prefill device

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.params)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def choose(self, logits: np.ndarray) -> int:
        """The next token from the logits after the last accepted one."""
        return self.sampler.next_token(logits, self.prompt + self.new)

    def accept(self, token: int) -> None:
        """Take `token` as the next one, or end the request with it."""
        ends = self.tokenizer.eos_token_ids if self.tokenizer is not None else frozenset()
        if token in ends:
            self.finish_reason = "stop"
            return
        self.new.append(token)
        if self.tokenizer is not None:
            self.text = self.tokenizer.decode(self.new)
            cut = find_stop(self.text, self.params.stop) if self.params.stop else None
            if cut is not None:
                self.text, self.finish_reason = self.text[:cut], "stop"
                return
        if len(self.new) >= self.max_new_tokens or len(self.prompt) + len(self.new) >= self.context_window:
            self.finish_reason = "length"

    def visible_text(self) -> str:
        """The text that can be shown now: all of it once done; before, not a trailing half
        character, nor a tail that may still grow into a stop string."""
        if self.done:
            return self.text
        text = self.text.rstrip("\ufffd")
        return text[:len(text) - stop_holdback(text, self.params.stop)]

