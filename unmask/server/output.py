"""What a response makes of its engine requests: each one's text as it grows (`TextStream`),
and the usage and unmask numbers it reports (`usage`, `decode_numbers`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from unmask.api import LLM
from unmask.decoding.params import DecodeParams
from unmask.engine import Request, StepEvent
from unmask.engine.request import useful_length
from unmask.server.engine_client import Handle


class TextStream:
    """The committed prefix of one request as text: what may be sent now, and when to stop.

    Text of at most `limit` tokens (the request's max_tokens: OpenAI clients take it as a hard
    cap, where the decoder's canvas is rounded up to whole blocks), up to the first EOS, cut
    before the first stop string. While decoding, the text is held back where it could still
    change: an incomplete character at the end, or an end that could be the start of a stop
    string.
    """

    def __init__(self, llm: LLM, gen_length: int, stops: list[str] | None,
                 limit: int | None = None) -> None:
        self.llm, self.stops = llm, stops or []
        self.eos = llm.config.eos_token_id
        self.tokens: list[int | None] = [None] * gen_length
        self.limit = gen_length if limit is None else min(limit, gen_length)
        self.sent = ""
        self.stop_hit = False
        self.eos_hit = False  # the text ends at an EOS within the limit
        self.n_tokens = 0  # generated tokens behind the text (up to EOS, the stop or the limit)
        self._prefix = 0  # the committed prefix the text was last made of

    @property
    def final(self) -> bool:
        """Nothing more can be added: a stop string, or the limit reached short of the canvas's
        end (the decoder's later positions are never returned, so it need not decode them)."""
        return self.stop_hit or (not self.eos_hit and self.limit < len(self.tokens)
                                 and self.n_tokens == self.limit)

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "stop" at an EOS or a stop string, "length" at the limit (or the canvas's
        end)."""
        return "stop" if self.stop_hit or self.eos_hit else "length"

    def update(self, ev: StepEvent) -> str:
        """Apply a step's commits; return the new text that is safe to send."""
        for pos, tok in zip(ev.positions, ev.tokens, strict=True):
            self.tokens[pos] = tok
        if ev.prefix == self._prefix:
            # Commits past the prefix only: its text, and so what may be sent, is as it was
            # (a third of the events of the shared-prompt serve benchmark, whose decoder
            # commits by confidence; detokenizing the prefix again took ~40 us of the event
            # loop an event, under cProfile)
            return ""
        self._prefix = ev.prefix
        text, final = self._text(self.tokens[: ev.prefix])
        if not final:
            text = self._hold_back(text)
        return self._advance(text)

    def finish(self, token_ids: list[int] | None) -> str:
        """The rest of the text once the request has finished (token_ids: its final canvas;
        None when it was stopped: the committed prefix is final)."""
        if token_ids is not None and not self.stop_hit:
            self.tokens = list(token_ids)
        prefix = self.tokens
        first_gap = next((i for i, t in enumerate(prefix) if t is None), len(prefix))
        text, _ = self._text(prefix[:first_gap])
        return self._advance(text)

    def _text(self, ids: list[int | None]) -> tuple[str, bool]:
        """(text, final): final once an EOS or a stop string ends the text."""
        ids = [t for t in ids if t is not None][: self.limit]
        n = useful_length(ids, self.eos)
        text = self.llm.detokenize(ids[:n])
        self.eos_hit = n < len(ids)
        final = self.eos_hit or n == self.limit
        # A stop can begin only in unsent text: the sent text never ends where one could begin
        # (_hold_back), and the committed prefix's text only grows. So each step searches the
        # new text, not all of it (whole-text searches cost O(text) a step, O(text^2) a request).
        # The stop that ends first wins (ties: the one that starts first), as it would for text
        # written left to right: where it ends is fixed by the text, not by how many characters
        # a step committed, so decoders that commit the same tokens in other steps (exact and
        # static-1) give the same answer.
        start = len(self.sent)
        found = [(i + len(s), i) for s in self.stops if (i := text.find(s, start)) >= 0]
        cut = min(found)[1] if found else -1
        if cut >= 0:
            text, final, self.stop_hit = text[:cut], True, True
            self.n_tokens = min(n, len(self.llm.tokenizer.encode(text, add_special_tokens=False)))
        else:
            self.n_tokens = n
        return text, final

    def _hold_back(self, text: str) -> str:
        text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence at the end
        keep = len(text)
        for s in self.stops:
            # The longest end of the text that begins s (and is shorter: no stop is in the
            # text): its start j is s[0] in the unsent text (an earlier step held back any that
            # began before), and s.startswith(text[j:]). Each step tries the places where
            # s[0] occurs, not every length up to len(s) with a slice of s apiece, which cost
            # ~4 ms a step for a stop of 9,000 characters.
            j = text.find(s[0], max(len(self.sent), len(text) - len(s) + 1))
            while 0 <= j < keep:
                if s.startswith(text[j:]):
                    keep = j
                    break
                j = text.find(s[0], j + 1)
        return text[:keep]

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):  # never retract: wait until it extends what was sent
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta



@dataclass
class Choice:
    """One engine request of a response, and what has been sent of it."""

    index: int
    handle: Handle
    text: TextStream
    prompt_tokens: int  # counted in usage: a prompt's tokens once, however many choices it has
    first_text: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    outcome: str | None = None

    @property
    def request(self) -> Request:
        return self.handle.request

    def sent_text(self) -> None:
        if self.first_text is None:
            self.first_text = time.perf_counter()


def usage(choices: list[Choice]) -> dict[str, Any]:
    """OpenAI's usage: prompt tokens (each prompt once), completion tokens, and of the prompt
    tokens those read from the prefix store (`prompt_tokens_details.cached_tokens`)."""
    counted = [c for c in choices if c.prompt_tokens]
    prompt = sum(c.prompt_tokens for c in counted)
    completion = sum(c.text.n_tokens for c in choices)
    cached = sum(c.handle.request.cached_tokens for c in counted)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def decode_numbers(choices: list[Choice], params: DecodeParams) -> dict[str, Any]:
    """unmask's own numbers (docs/design.md § Metrics), summed over the response's choices."""
    reqs = [c.request for c in choices]
    nfe = sum(r.nfe for r in reqs)
    decided = sum(r.decided for r in reqs)
    return {"decoder": params.spec, "gen_length": params.gen_length, "nfe": nfe,
            "token_forwards": sum(r.token_forwards for r in reqs),
            "tpf": decided / nfe if nfe else 0.0,
            "seconds": max((r.seconds for r in reqs), default=0.0)}
