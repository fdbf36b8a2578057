"""Structured output: a response format compiled to a token automaton, and the per-row
constraint that keeps a diffusion canvas completable (docs/decoders.md § Structured output).

A `ResponseFormat` (a JSON schema, any JSON object, or a regular expression) becomes a regular
expression (outlines-core's schema compilation) and then a `TokenAutomaton`: outlines-core's
token-level DFA over the model's vocabulary, as dense arrays, with EOS leading to an end state
that only EOS leaves. A `Constraint` is one request's use of it over its first `budget`
generated slots. Given the canvas (committed tokens, holes of one token each), it propagates
sets of automaton states forward from the left (a hole: any token) and backward from the right
(states from which the rest can still be completed); a hole may take the tokens that lead some
forward-reachable state into a backward one. The sets are interned and their moves memoized on
the automaton (`StateSets`), so a pass is a dictionary lookup a slot, shared by every row. The
engine masks every other token before the rule scores a hole (`TokenMasks`) and keeps only as
many of a step's commits, in commit order, as leave the canvas completable
(`Constraint.restrict`): every canvas it ever holds can still be completed to a word of the
language, so every finished output is one.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from unmask.errors import InputError

MODES = ("complete", "prefix")  # the bidirectional constraint; the longest-valid-prefix baseline
# The length prior's weight (docs/decoders.md § Structured output, "The length prior"): on for
# JSON, whose values the schema leaves unbounded but a model writing prose would run on; off
# for a regular expression, often free text the model writes out of order as it would anyway.
JSON_LENGTH_PENALTY = 2.0
# What one format's automaton may cost (docs/decoders.md § Structured output, "Limits"). The
# automaton is dense: (states x vocabulary) int32 moves and (states x states) float32 hole
# moves, built in time that grows with states squared. Measured on the embedded 2,048-token
# vocabulary: 4,011 states (a string of maxLength 400) build in 1.1 s and ~400 MB; 10,019
# (maxLength 1,000) in 6 s and ~1.3 GB; 50,051 (maxLength 5,000) in 92 s and ~20 GB.
MAX_PATTERN_POSITIONS = 2048  # checked before outlines-core builds its index
MAX_STATES = 4096
MAX_AUTOMATON_BYTES = 1 << 30  # the dense arrays (a 128k vocabulary: ~2,000 states)
AUTOMATA_CACHE_BYTES = 1 << 30  # automata an LLM keeps for later requests of their formats


class GrammarError(InputError):
    """A response format that cannot be compiled (invalid schema or regex, unsupported feature)."""


@dataclass(frozen=True)
class ResponseFormat:
    """What a constrained request's output must match. pattern: the regular expression the
    output matches in full (a schema's is compiled by outlines-core, with no optional
    whitespace: compact JSON, so the schema fixes its keys and punctuation); mode: `complete`
    (the bidirectional constraint) or `prefix` (the longest-valid-prefix baseline)."""

    kind: str  # json_schema | json_object | regex
    pattern: str
    schema: dict | None = None  # the JSON schema (json_schema, json_object) the output validates against
    mode: str = "complete"
    # The length prior: a hole's allowed token loses this much log-weight per token it adds
    # to the shortest way to finish the word (0: the model's constrained distribution as it is)
    length_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise GrammarError(f"grammar mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        w = self.length_penalty
        # 0 <= w is False for NaN: refused with the negatives
        if not (isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w < 1e6):
            raise GrammarError(f"length_penalty must be a number >= 0, got {w!r}")

    @classmethod
    def json_schema(cls, schema: dict | str, mode: str = "complete",
                    length_penalty: float = JSON_LENGTH_PENALTY) -> ResponseFormat:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema is an object, got {type(schema).__name__}")
        return cls("json_schema", schema_regex(json.dumps(schema, sort_keys=False)), schema, mode,
                   length_penalty)

    @classmethod
    def json_object(cls, mode: str = "complete",
                    length_penalty: float = JSON_LENGTH_PENALTY) -> ResponseFormat:
        schema = {"type": "object"}
        return cls("json_object", schema_regex(json.dumps(schema)), schema, mode, length_penalty)

    @classmethod
    def regex(cls, pattern: str, mode: str = "complete",
              length_penalty: float = 0.0) -> ResponseFormat:
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("the regular expression must be a non-empty string")
        try:
            re.compile(pattern)
        except re.error as e:
            raise GrammarError(f"invalid regular expression {pattern!r:.80}: {e}") from None
        return cls("regex", pattern, None, mode, length_penalty)

    def accepts(self, text: str) -> bool:
        """Whether `text` (the output, up to its EOS) is a word of the format's language."""
        if self.kind == "regex" or self.schema is None:
            return re.fullmatch(self.pattern, text, flags=re.DOTALL) is not None
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        import jsonschema

        return jsonschema.Draft202012Validator(self.schema).is_valid(value)


def as_format(value: Any, mode: str = "complete") -> ResponseFormat | None:
    """A ResponseFormat from what callers pass: one already made; OpenAI's `response_format`
    object ({"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema",
    "strict"}}); a pydantic model class (the openai client's `parse`); None or text: None."""
    if value is None or isinstance(value, ResponseFormat):
        return value
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        return ResponseFormat.json_schema(value.model_json_schema(), mode)
    if not isinstance(value, dict):
        raise GrammarError(f"response_format must be an object, got {type(value).__name__}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat.json_object(mode)
    if kind != "json_schema":
        raise GrammarError(f"response_format type must be text, json_object or json_schema, "
                           f"got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise GrammarError("response_format json_schema needs an object with a 'schema'")
    if spec.get("strict") is False:
        # Best-effort adherence is not offered: a schema here is always enforced, and saying
        # so beats silently enforcing what the caller asked to be loose.
        raise GrammarError("json_schema strict: false (best-effort adherence) is not offered; "
                           "unmask always enforces the schema: send strict: true or leave it out")
    return ResponseFormat.json_schema(spec["schema"], mode)


def with_prior(fmt: ResponseFormat | None, length_penalty: float | None) -> ResponseFormat | None:
    """`fmt` with the length prior's weight set (docs/decoders.md § Structured output, "The
    length prior"; None: the format's own default). Every door (the CLI's --length-penalty,
    the server's `length_penalty` field, `LLM.generate(length_penalty=...)`) sets it here: a
    weight without a format, or one that is negative or not a number, is a GrammarError."""
    if length_penalty is None:
        return fmt
    if fmt is None:
        raise GrammarError("length_penalty weighs a response format's values: give a JSON schema, "
                           "json_object or a regular expression with it")
    return replace(fmt, length_penalty=length_penalty)


@lru_cache(maxsize=64)
def schema_regex(schema: str) -> str:
    """The regular expression of a JSON schema (outlines-core), compact (no optional
    whitespace); a GrammarError names an invalid schema or an unsupported feature."""
    import jsonschema
    from outlines_core.json_schema import build_regex_from_schema

    try:
        jsonschema.Draft202012Validator.check_schema(json.loads(schema))
    except jsonschema.SchemaError as e:
        raise GrammarError(f"invalid JSON schema: {e.message}") from None
    try:
        return build_regex_from_schema(schema, "")
    except (ValueError, TypeError) as e:
        raise GrammarError(f"unsupported JSON schema feature: {e}") from None


# --- the token automaton ---------------------------------------------------------------------
def token_bytes(tokenizer: Any) -> dict[int, bytes]:
    """Each ordinary token's bytes (special tokens left out): byte-level BPE tokens through
    GPT-2's byte-to-character table, SentencePiece tokens with their word marker and byte
    fallback (<0xNN>) undone."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    byte_level = _is_byte_level(tokenizer)
    table = _byte_table() if byte_level else {}
    out = {}
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            continue
        if byte_level:
            if all(ch in table for ch in piece):
                out[i] = bytes(table[ch] for ch in piece)
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            out[i] = bytes([int(piece[3:5], 16)])
        else:
            out[i] = piece.replace("\u2581", " ").encode()
    return out


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel" or "ByteLevel" in repr(decoder)


@lru_cache(maxsize=1)
def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves,
    the rest are shifted past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


HOLE = -1  # a hole's token in the passes: any token


@dataclass
class TokenAutomaton:
    """A regular language over token ids, as dense arrays. States 0..n-1 are outlines-core's;
    END (n) follows EOS from a final state and only EOS leaves it; DEAD (n + 1) is every other
    move. trans: (Q, V) int32 next state; succ: (Q, Q) float32 1 where some token moves one
    state to the other (a hole); final: (Q,) bool accepting states, END included; live: (Q,)
    bool states from which a final state can be reached; prefix: the token ids of the
    language's fixed opening (the scaffold), possibly empty."""

    trans: np.ndarray
    succ: np.ndarray
    succ_t: np.ndarray  # succ transposed, contiguous
    start: int
    final: np.ndarray
    live: np.ndarray
    prefix: tuple[int, ...]
    dist: np.ndarray | None = None  # (Q,) fewest tokens to an accepting state (set on construction)
    eos: int = -1  # the EOS token (the one move into END)
    # the bytes of the tokens, for the fixed text after a state (`fixed_tokens`): (V,) each
    # token's first byte (-1: none), (256,) the token of each byte alone (-1: none); and the
    # tokenizer's text -> token ids (None: no fixed text is written)
    first_byte: np.ndarray | None = None
    byte_token: np.ndarray | None = None
    encode: Any = None

    def __post_init__(self) -> None:
        # each state's moves grouped by the state they lead to, built on a state's first use
        # and kept with the automaton (every request of the format): a hole's vector then
        # costs its allowed tokens, not its states x the vocabulary
        self._by_state: dict[int, tuple[np.ndarray, list[np.ndarray]]] = {}
        self.dist = self._distances()
        self.sets = StateSets(self)
        # A hole's vectors by its (F_i, B_i+1) pair of set ids (and the weights by the prior's
        # offset and weight), shared by every row of the format: along a run of holes the sets
        # settle, a canvas's from step to step, and a batch's rows pass through the same ones.
        # Bounded to about 32 MiB of vectors whatever the vocabulary.
        self._holes: dict[tuple, np.ndarray] = {}
        self._holes_max = max(64, (32 << 20) // (4 * self.trans.shape[1]))
        self._forced: dict[tuple[int, int], int] = {}  # (F_i, B_i+1) -> `forced_token`
        self._fixed: dict[int, tuple[int, ...]] = {}  # state -> `fixed_tokens`

    def forget(self) -> None:
        """Drop every kept hole vector, forced token and memoized move (a benchmark's cold
        step)."""
        self._holes.clear()
        self._forced.clear()
        self._fixed.clear()
        self.sets.forget()

    def forced_token(self, f: int, b: int) -> int:
        """The one token a hole between the sets f and b (ids of `sets`) may take, or -1 when
        it has a choice or the one token is EOS (the EOS tail is early exit's, or the forward's).
        Kept by pair (an int each, bounded like the moves)."""
        hit = self._forced.get((f, b))
        if hit is None:
            ok = np.flatnonzero(np.isfinite(self._finish_after(self.sets.of[f], self.sets.of[b])))
            hit = int(ok[0]) if ok.size == 1 and ok[0] != self.eos else -1
            if len(self._forced) >= 1 << 16:
                self._forced.clear()
            self._forced[(f, b)] = hit
        return hit

    def fixed_tokens(self, state: int) -> tuple[int, ...]:
        """The tokenizer's own tokens of the text every word goes on with from `state` (its
        characters while every allowed token starts with the same byte: a key after its
        comma, the quote and colon after it), as many as stay a live path; () when the next
        character is a choice or the word may end there. Kept per state."""
        hit = self._fixed.get(state)
        if hit is None:
            hit = self._fixed[state] = self._live_path(state, self._fixed_text(state))
        return hit

    def _fixed_text(self, s: int) -> str:
        if self.first_byte is None or self.byte_token is None:
            return ""
        out = bytearray()
        while len(out) < 256 and not self.final[s]:
            firsts = np.unique(self.first_byte[self.live[self.trans[s]]])
            if firsts.size != 1 or firsts[0] < 0 or self.byte_token[firsts[0]] < 0:
                break
            out.append(int(firsts[0]))
            s = int(self.trans[s, self.byte_token[firsts[0]]])
        return out.decode("utf-8", errors="ignore")

    def _distances(self) -> np.ndarray:
        """(Q,) float32: the fewest tokens from each state to an accepting one (inf: none; the
        EOS into END is not counted, as an accepting state already ends the word)."""
        dist = np.where(self.final, 0.0, np.inf).astype(np.float32)
        within = self.final.copy()  # states at most k tokens from an accepting one
        for k in range(1, self.n_states):
            grown = within | (self.succ @ within.astype(np.float32) > 0)
            grown[-1] = False  # DEAD
            if (grown == within).all():
                break
            dist[grown & ~within] = k
            within = grown
        return dist

    def finish_after(self, f: int, b: int) -> np.ndarray:
        """(V,) float32: for each token that moves some state of set f into one of set b (ids
        of `sets`), the fewest tokens that can finish the word after it (the least `dist` of
        the states it moves into b); inf for the other tokens."""
        return self._kept((f, b), lambda: self._finish_after(self.sets.of[f], self.sets.of[b]))

    def hole_weights(self, f: int, b: int, offset: int, penalty: float) -> np.ndarray:
        """(V,) float32 log-weights of a hole between the sets f and b (ids): -inf for the tokens
        `finish_after` leaves out; with a penalty, -penalty per slot a token pushes the end of
        the shortest word past where it stands, against the hole's least push. offset: the
        hole's slot + 1 - that end (a token then ends the word at offset + finish_after past
        it); EOS pushes nothing."""
        if not penalty:
            offset = 0
        return self._kept((f, b, offset, penalty),
                          lambda: self._weights(self.finish_after(f, b), offset, penalty))

    def _weights(self, finish: np.ndarray, offset: int, penalty: float) -> np.ndarray:
        ok = np.isfinite(finish)
        if not penalty:
            return np.where(ok, np.float32(0), np.float32(-np.inf))
        push = np.maximum(offset + finish, 0)  # inf where not allowed
        if 0 <= self.eos < push.shape[0] and ok[self.eos]:
            push[self.eos] = 0
        least = push.min() if ok.any() else 0.0
        return np.where(ok, np.float32(-penalty) * (push - least), np.float32(-np.inf))

    def _finish_after(self, f: np.ndarray, b: np.ndarray) -> np.ndarray:
        out = np.full(self.trans.shape[1], np.inf, dtype=np.float32)
        for state in np.flatnonzero(f).tolist():
            nxt, tokens = self._moves_of(state)
            for q, toks in zip(nxt[b[nxt]].tolist(), _pick(tokens, b[nxt]), strict=True):
                out[toks] = np.minimum(out[toks], self.dist[q])
        return out

    def _moves_of(self, state: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """(K,) the states `state` moves to (DEAD left out), and for each the tokens that move
        it there."""
        hit = self._by_state.get(state)
        if hit is None:
            row = self.trans[state]
            order = np.argsort(row, kind="stable")
            nxt, first = np.unique(row[order], return_index=True)
            groups = np.split(order, first[1:])
            live = nxt != self.n_states - 1
            hit = self._by_state[state] = (nxt[live], _pick(groups, live))
        return hit

    def _kept(self, key: tuple, make: Any) -> np.ndarray:
        hit = self._holes.get(key)
        if hit is None:
            if len(self._holes) >= self._holes_max:
                self._holes.clear()
            hit = self._holes[key] = make()
        return hit

    @property
    def n_states(self) -> int:
        return self.trans.shape[0]

    @classmethod
    def build(cls, pattern: str, tokens: dict[int, bytes], vocab: int, eos_id: int,
              encode: Any = None) -> TokenAutomaton:
        """From outlines-core's index of `pattern` over `tokens` (id -> bytes), for a model of
        `vocab` logits. encode: text -> token ids (the tokenizer's), for the scaffold."""
        from outlines_core import Index, Vocabulary

        positions = pattern_positions(pattern)
        if positions > MAX_PATTERN_POSITIONS:
            raise GrammarError(_too_large(f"its regular expression has {positions:,} positions "
                                          "with counted repetitions written out",
                                          f"{MAX_PATTERN_POSITIONS:,}"))
        try:
            index = Index(pattern, Vocabulary(eos_id, {b: [i] for i, b in tokens.items()
                                                        if i != eos_id}))
        except (ValueError, TypeError) as e:
            raise GrammarError(f"cannot compile the constraint {pattern!r:.80}: {e}") from None
        edges = index.get_transitions()
        ids = sorted(set(edges) | {s for m in edges.values() for s in m.values()}
                     | set(index.get_final_states()) | {index.get_initial_state()})
        number = np.full(max(ids) + 1, -1, dtype=np.int32)  # outlines-core's state -> ours
        number[ids] = np.arange(len(ids), dtype=np.int32)
        n = len(ids)
        dense = dense_bytes(n + 2, vocab)
        if n + 2 > MAX_STATES or dense > MAX_AUTOMATON_BYTES:
            raise GrammarError(_too_large(
                f"its automaton has {n + 2:,} states ({dense / 2**20:,.1f} MiB over a "
                f"{vocab:,}-token vocabulary)",
                f"{MAX_STATES:,} states and {MAX_AUTOMATON_BYTES / 2**20:,.0f} MiB"))
        end, dead = n, n + 1
        trans = np.full((n + 2, vocab + 1), dead, dtype=np.int32)  # column vocab: ids past it
        for s, moves in edges.items():
            t = np.fromiter(moves.keys(), dtype=np.int64, count=len(moves))
            nxt = np.fromiter(moves.values(), dtype=np.int64, count=len(moves))
            trans[number[s], np.minimum(t, vocab)] = number[nxt]
        trans = np.ascontiguousarray(trans[:, :vocab])
        trans[:, eos_id] = dead
        final = np.zeros(n + 2, dtype=bool)
        final[[number[s] for s in index.get_final_states()]] = True
        final[end] = True
        trans[final, eos_id] = end
        succ = np.zeros((n + 2, n + 2), dtype=np.float32)
        rows = np.repeat(np.arange(n + 2), vocab)
        succ[rows, trans.reshape(-1)] = 1.0
        live = final.copy()
        while True:  # states from which a final one is reachable
            grown = live | (succ @ live.astype(np.float32) > 0)
            grown[dead] = False
            if (grown == live).all():
                break
            live = grown
        first = np.full(vocab, -1, dtype=np.int16)
        alone = np.full(256, -1, dtype=np.int32)
        for i, b in tokens.items():
            if i < vocab and b:
                first[i] = b[0]
                if len(b) == 1:
                    alone[b[0]] = i
        a = cls(trans, succ, np.ascontiguousarray(succ.T), int(number[index.get_initial_state()]),
                final, live, (), eos=eos_id, first_byte=first, byte_token=alone, encode=encode)
        a.prefix = a._live_path(a.start, literal_prefix(pattern))
        return a

    @property
    def nbytes(self) -> int:
        """What keeping this automaton may cost at most: its dense arrays, each state's moves
        grouped by target (up to the moves again) and the hole vectors' bound."""
        return 2 * self.trans.nbytes + self.succ.nbytes + self.succ_t.nbytes + (32 << 20)

    def walk(self, states: np.ndarray, token: int) -> np.ndarray:
        """(Q,) bool: the states `token` moves `states` (Q,) bool to (DEAD left out)."""
        out = np.zeros_like(states)
        out[self.trans[states, token]] = True
        out[-1] = False
        return out

    def _live_path(self, start: int, text: str) -> tuple[int, ...]:
        """The tokenizer's own tokens of `text` (a fixed opening, a fixed text), as many of them
        as the automaton accepts as a live path from the state `start` (a boundary token may
        merge with what follows the text, so the last ones may be dropped)."""
        ids = list(self.encode(text)) if text and self.encode is not None else []
        state = np.zeros(self.n_states, dtype=bool)
        state[start] = True
        kept = []
        for t in ids:
            if not 0 <= t < self.trans.shape[1]:
                break
            state = self.walk(state, t)
            if not (state & self.live).any():
                break
            kept.append(int(t))
        return tuple(kept)


class StateSets:
    """Sets of a TokenAutomaton's states interned as ids, and the moves between them memoized:
    a pass over a canvas is one dictionary lookup a slot instead of array work. Shared by every
    row of the format: a DFA's forward set stays one state through committed tokens and grows
    only across holes, so a batch's canvases, step after step, pass through the same few sets.
    The memo of moves is bounded (cleared when full); the sets are kept, as constraints hold
    their ids."""

    def __init__(self, a: TokenAutomaton) -> None:
        self.a = a
        self.of: list[np.ndarray] = []  # id -> (Q,) bool
        self.accepting: list[bool] = []  # id -> the set holds an accepting state
        self.single: list[int] = []  # id -> its one state (-1: several or none)
        self._ids: dict[bytes, int] = {}
        self._moves: dict[tuple[int, int, bool], int] = {}  # (id, token or HOLE, backward) -> id
        self._moves_max = 1 << 16  # ~10 MB of keys; the benchmark's formats keep a few hundred
        start = np.zeros(a.n_states, dtype=bool)
        start[a.start] = True
        self.start = self.id(start)

    def forget(self) -> None:
        """Drop the memoized moves (the sets and their ids stay)."""
        self._moves.clear()

    def id(self, states: np.ndarray) -> int:
        """The id of the set states (Q,) bool, interned on first sight."""
        key = np.packbits(states).tobytes()
        i = self._ids.get(key)
        if i is None:
            i = self._ids[key] = len(self.of)
            self.of.append(states)
            self.accepting.append(bool((states & self.a.final).any()))
            one = np.flatnonzero(states)
            self.single.append(int(one[0]) if one.size == 1 else -1)
        return i

    def forward(self, i: int, token: int) -> int:
        """The set `token` (HOLE: any token) moves set i to, DEAD left out."""
        return self.run(i, (token,), False)[-1]

    def backward(self, i: int, token: int) -> int:
        """The states from which `token` (HOLE: some token) moves into set i."""
        return self.run(i, (token,), True)[-1]

    def run(self, i: int, tokens: Iterable[int], back: bool) -> list[int]:
        """The sets from set i on through `tokens` (HOLE: any token), i first: forward (each
        set the next token moves the last to) or backward (tokens read right to left)."""
        out, get = [i], self._moves.get
        for t in tokens:
            j = get((i, t, back))
            i = self._move(i, t, back) if j is None else j
            out.append(i)
        return out

    def meets(self, i: int, j: int) -> bool:
        return bool((self.of[i] & self.of[j]).any())

    def _move(self, i: int, token: int, back: bool) -> int:
        """A move not memoized yet: computed and kept."""
        if len(self._moves) >= self._moves_max:
            self._moves.clear()
        j = self._moves[(i, token, back)] = self.id(self._moved(self.of[i], token, back))
        return j

    def _moved(self, s: np.ndarray, token: int, back: bool) -> np.ndarray:
        a = self.a
        if back:
            if token == HOLE:
                return a.succ @ s.astype(np.float32) > 0
            return s[a.trans[:, token]]
        if token != HOLE:
            return a.walk(s, token)
        out = a.succ_t @ s.astype(np.float32) > 0  # matrix-vector: BLAS's fast case
        out[-1] = False
        return out


def _pick(items: list, keep: np.ndarray) -> list:
    """The items where keep (bool, one per item)."""
    return [x for x, k in zip(items, keep.tolist(), strict=True) if k]


def dense_bytes(n_states: int, vocab: int) -> int:
    """The bytes of an automaton's dense arrays: (Q, V) int32 moves, (Q, Q) float32 hole moves
    and their transpose."""
    return 4 * n_states * vocab + 8 * n_states * n_states


def pattern_positions(pattern: str) -> int:
    """An upper bound on the positions of a regular expression with its counted repetitions
    written out (`a{0,500}` is 500): the automaton's states grow with it, so it is checked
    before outlines-core builds anything. Read with Python's own parser, which is what checks a
    request's regular expression (`ResponseFormat.regex`)."""
    from _sre import MAXREPEAT

    # the parser `re` uses: re._parser from Python 3.11, sre_parse before
    parser = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")

    def size(items: Iterable) -> int:
        n = 0
        for op, av in items:
            name = str(op)
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                lo, hi, sub = av
                n += size(sub) * max(1, lo if hi == MAXREPEAT else hi)
            elif name == "SUBPATTERN":
                n += size(av[-1])
            elif name == "BRANCH":
                n += sum(size(b) for b in av[1])
            elif name == "ATOMIC_GROUP":
                n += size(av)
            elif name in ("ASSERT", "ASSERT_NOT"):
                n += size(av[1])
            else:
                n += 1
        return n

    try:
        return size(parser.parse(pattern))
    except re.error as e:
        raise GrammarError(f"invalid regular expression {pattern!r:.80}: {e}") from None


def _too_large(what: str, limit: str) -> str:
    return (f"the response format is too large: {what}, over unmask's "
            f"limit of {limit} (each character a string's maxLength or a counted repetition "
            f"allows adds states: lower it, or leave the length open)")


class Automata:
    """The automata of the formats an LLM has compiled, kept for later requests of the same
    format and dropped least recently used first past `budget` bytes (`TokenAutomaton.nbytes`),
    so a server asked for many formats holds a bounded few. A request's Constraint holds its own
    automaton, so dropping one never touches a running request. Thread-safe: the server compiles
    on worker threads (two threads may build the same format once each; the second is kept)."""

    def __init__(self, budget: int = AUTOMATA_CACHE_BYTES) -> None:
        self.budget = budget
        self._kept: Any = None  # a cachetools.LRUCache, made on first use (the grammar extra)
        self._lock = threading.Lock()

    def get(self, key: tuple, build: Callable[[], TokenAutomaton]) -> TokenAutomaton:
        with self._lock:
            if self._kept is None:
                from cachetools import LRUCache

                self._kept = LRUCache(maxsize=self.budget, getsizeof=lambda a: a.nbytes)
            hit = self._kept.get(key)
        if hit is None:
            hit = build()
            if hit.nbytes <= self.budget:
                with self._lock:
                    self._kept[key] = hit
        return hit

    def __len__(self) -> int:
        return 0 if self._kept is None else len(self._kept)

    @property
    def nbytes(self) -> int:
        return 0 if self._kept is None else int(self._kept.currsize)


def literal_prefix(pattern: str) -> str:
    """The text every word of `pattern` starts with: its leading literal characters (read with
    Python's own regex parser)."""
    # the parser behind `re`: re._parser from 3.11, sre_parse (deprecated since) before
    parser = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")
    try:
        items = parser.parse(pattern)
    except re.error:
        return ""
    out = []
    for op, arg in items:
        if str(op) != "LITERAL":
            break
        out.append(chr(arg))
    return "".join(out)


# --- one request's constraint ----------------------------------------------------------------
class Constraint:
    """One request's constraint over its first `budget` generated slots (the tokens it may
    return: a server's max_tokens). Slots past the budget are never returned and are not
    constrained. When no word of the language fits the budget, the canvas is kept a prefix of
    one (every live state accepts at the budget): the output is then cut by the length, and
    its finish reason says so."""

    def __init__(self, fmt: ResponseFormat, automaton: TokenAutomaton, budget: int,
                 mask_id: int) -> None:
        self.format, self.a, self.budget, self.mask_id = fmt, automaton, budget, mask_id
        self._set_end(automaton.final)
        holes = np.full(budget, mask_id, dtype=np.int64)
        self.closes = self.feasible(holes)  # some word fits the budget
        if not self.closes:
            self._set_end(automaton.live | automaton.final)
        self.initial = self.scaffold()

    @property
    def mode(self) -> str:
        return self.format.mode

    # --- the state sets (ids of the automaton's `StateSets`) ------------------------------
    def _set_end(self, end: np.ndarray) -> None:
        """The states accepted at the budget; and tail[k], the backward set of k trailing holes
        before it (the right of a canvas is mostly holes: read, not recomputed)."""
        self.end = end.copy()
        sets = self.a.sets
        tail = [sets.id(self.end)]
        for _ in range(self.budget):
            tail.append(sets.backward(tail[-1], HOLE))
        self._tail = tail

    def _tokens(self, gen: np.ndarray) -> tuple[list[int], int]:
        """gen (G,)'s tokens with its holes as HOLE, and one past its last committed slot
        (from there on: holes only)."""
        filled = gen != self.mask_id
        last = np.flatnonzero(filled)
        return np.where(filled, gen, HOLE).tolist(), int(last[-1]) + 1 if last.size else 0

    def _forward(self, toks: list[int], stop: int) -> list[int]:
        """(stop + 1,) the set reachable after each of the first `stop` slots from the start."""
        sets = self.a.sets
        return sets.run(sets.start, toks[:stop], False)

    def _backward(self, toks: list[int], holes_from: int, down_to: int) -> list[int]:
        """(G + 1,) the set from which slots i.. can end accepted, for i >= down_to (before:
        unset); the trailing holes from `holes_from` on read from the tail."""
        g = len(toks)
        down_to = min(down_to, holes_from)
        inside = self.a.sets.run(self._tail[g - holes_from], reversed(toks[down_to:holes_from]),
                                 True)  # sets at holes_from, holes_from - 1, ..., down_to
        return [-1] * down_to + inside[::-1] + self._tail[: g - holes_from][::-1]

    def feasible(self, gen: np.ndarray) -> bool:
        """Whether the canvas's first `budget` generated slots (gen: (>= budget,)) can still be
        completed to an accepted word."""
        # the passes meet where the trailing holes start: the backward set there is the tail's
        toks, holes_from = self._tokens(gen[: self.budget])
        f = self._forward(toks, holes_from)
        return self.a.sets.meets(f[holes_from], self._tail[len(toks) - holes_from])

    def allowed(self, gen: np.ndarray, slots: np.ndarray, vocab: int) -> np.ndarray:
        """(N, vocab) bool: the tokens each hole `slots` (N,) of the generated canvas gen (G,)
        may take and leave the canvas completable (slots past the budget: every token)."""
        return self.weights(gen, slots, vocab, prior=False) > -np.inf

    def weights(self, gen: np.ndarray, slots: np.ndarray, vocab: int,
                prior: bool = True) -> np.ndarray:
        """(N, vocab) float32 log-weights the scored holes `slots` (N,) of the generated
        canvas gen (G,) give their logits (`TokenAutomaton.hole_weights`): -inf where a token
        would leave the canvas incompletable; with the length prior (prior and the format's
        length_penalty), -length_penalty per slot by which an allowed token pushes the end of
        the canvas's shortest word further right, against the hole's least such push; slots
        past the budget: 0."""
        out = np.zeros((slots.shape[0], vocab), dtype=np.float32)
        self.write_weights(out, np.arange(slots.shape[0]), gen, slots, prior)
        return out

    def write_weights(self, out: np.ndarray, rows: np.ndarray, gen: np.ndarray,
                      slots: np.ndarray, prior: bool = True) -> None:
        """`weights` written into the rows `rows` (N,) of out (M, vocab), which hold 0: each
        distinct vector once to all the rows that share it (a run of holes settles into a few
        pairs of sets), one pass over the output, whatever the vocabulary."""
        inside = slots < self.budget
        if not inside.any():
            return
        g = gen[: self.budget]
        toks, holes_from = self._tokens(g)
        penalty = self.format.length_penalty if prior else 0.0
        start = self._word_start(g) if penalty else 0
        f = self._forward(toks, max(int(slots[inside].max()) + 1, start))
        b = self._backward(toks, holes_from, int(slots[inside].min()) + 1)
        shortest = self._shortest(g.shape[0], f[start], start) if penalty else 0
        cols = self.a.trans.shape[1]
        at = rows[inside]
        keys = [(f[i], b[i + 1], i + 1 - shortest if penalty else 0)
                for i in slots[inside].tolist()]
        shared: dict[tuple, list[int]] = {}
        for row, key in zip(at.tolist(), keys, strict=True):
            shared.setdefault(key, []).append(row)
        for (fi, bi, offset), where in shared.items():
            out[where, :cols] = self.a.hole_weights(fi, bi, offset, penalty)
        out[at, cols:] = -np.inf

    def _word_start(self, gen: np.ndarray) -> int:
        """One past the last slot of gen (budget,) committed to a token other than EOS."""
        filled = np.flatnonzero((gen != self.mask_id) & (gen != self.a.eos))
        return int(filled[-1]) + 1 if filled.size else 0

    def _shortest(self, n: int, cur: int, start: int) -> int:
        """The length of the shortest word a canvas of n slots can complete to: the first slot
        k from `start` (`_word_start`) where a forward state accepts (cur: the forward set
        there). Past `start` the canvas holds holes and EOS only, and the word ends at the
        first accepting slot: the walk goes on through holes (an EOS before it would leave
        nothing to complete)."""
        sets = self.a.sets
        for k in range(start, n):
            if sets.accepting[cur]:
                return k
            cur = sets.forward(cur, HOLE)
        return n

    # --- the commit-time check --------------------------------------------------------------
    def restrict(self, gen: np.ndarray, sel: np.ndarray, token: np.ndarray,
                 rank: np.ndarray) -> np.ndarray:
        """(G,) bool: the commits a step keeps of `sel` (G,) (token: (G,) the tokens they
        write; rank: (G,) their commit order, 0 first). complete: the longest run in commit
        order that leaves the canvas completable (at least the first, whose token the mask
        allowed); prefix: the longest run of selected holes from the leftmost hole on, left
        to right, or the leftmost hole alone when the rule did not select it."""
        holes = gen == self.mask_id
        if self.mode == "prefix":
            first = int(np.argmax(holes))
            run = np.flatnonzero(np.cumprod(sel[first:] | ~holes[first:]) & holes[first:]) + first
            order = run if run.size else np.array([first])
        else:
            order = np.flatnonzero(sel)
            order = order[np.argsort(rank[order], kind="stable")]
        n = self._longest(gen, order, token)
        out = np.zeros_like(sel)
        out[order[:n]] = True
        return out

    def _longest(self, gen: np.ndarray, order: np.ndarray, token: np.ndarray) -> int:
        """How many of the commits `order` (slots, in order) leave the canvas completable: the
        feasible ones are a prefix of the order (a commit only removes words), so a binary
        search; at least one."""
        def ok(n: int) -> bool:
            trial = gen.copy()
            trial[order[:n]] = token[order[:n]]
            return self.feasible(trial)

        # one commit alone needs no check: the mask it was scored under allowed its token on
        # this canvas (a block-of-4 model commits one a step more often than not)
        if order.size <= 1 or ok(order.size):
            return int(order.size)
        lo, hi = 1, int(order.size) - 1  # ok(lo) holds: its token was allowed; find the last ok
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # --- what the commits fix ----------------------------------------------------------------
    def settle(self, gen: np.ndarray) -> np.ndarray:
        """gen (G,) with what its commits fixed written into its holes (complete mode; the
        prefix baseline writes only what the model chose): after each committed run that
        leaves the automaton in one state, the fixed text that follows (`fixed_tokens`: the
        tokenizer's own tokens of a key, its quotes and colon) where it keeps the canvas
        completable; then every hole among the commits (and the first after them) whose
        allowed set is one token other than EOS (a closing quote or brace). The trailing holes
        past the first are a choice until the budget's end nears, and are left to the rule.
        No forward decided these: they count in no TPF."""
        if self.mode == "prefix":
            return gen
        out = gen.copy()
        g = out[: self.budget]  # a view: written in place
        if (g == self.mask_id).any():
            self._write_forced(g, *self._write_fixed_text(g))
        return out

    def _near(self, g: np.ndarray) -> tuple[list[int], int, list[int]]:
        """`_tokens` of g, and the forward sets up to its first trailing hole."""
        toks, holes_from = self._tokens(g)
        return toks, holes_from, self._forward(toks, min(holes_from, g.shape[0] - 1) + 1)

    def _write_fixed_text(self, g: np.ndarray) -> tuple[list[int], int, list[int]]:
        """The fixed text after each run of commits written into the holes after it; returns
        the canvas as it is left (`_near`)."""
        toks, holes_from, f = self._near(g)
        holes = g == self.mask_id
        starts = np.flatnonzero(holes[1:] & ~holes[:-1]) + 1  # each run's first hole
        sets = self.a.sets
        for i in ([0] if holes[0] else []) + starts[starts <= holes_from].tolist():
            state = sets.single[f[i]]
            fixed = self.a.fixed_tokens(state) if state >= 0 else ()
            if not fixed:
                continue
            ends = np.flatnonzero(~holes[i:])
            run = int(ends[0]) if ends.size else holes.size - i  # the run's holes
            for n in range(min(len(fixed), run), 0, -1):  # the most that stays completable
                trial = g.copy()
                trial[i : i + n] = fixed[:n]
                if self.feasible(trial):
                    g[:] = trial
                    toks, holes_from, f = self._near(g)  # the passes redone after a write
                    break
        return toks, holes_from, f

    def _write_forced(self, g: np.ndarray, toks: list[int], holes_from: int,
                      f: list[int]) -> None:
        # a forced token is in every completion: writing it changes no other hole's set, so
        # one pass over the sets of the canvas as it was (`_near`: its tokens and forward sets)
        holes = np.flatnonzero(g[: len(f) - 1] == self.mask_id)
        if not holes.size:
            return
        b = self._backward(toks, holes_from, int(holes[0]) + 1)
        for i in holes.tolist():
            t = self.a.forced_token(f[i], b[i + 1])
            if t >= 0:
                g[i] = t

    # --- the scaffold ------------------------------------------------------------------------
    def scaffold(self) -> np.ndarray:
        """(budget,) the canvas a constrained request starts from: the language's fixed opening
        (its tokens, where they fit and keep the canvas completable), then every hole whose
        allowed set is one token, left to right up to the first that has a choice."""
        gen = np.full(self.budget, self.mask_id, dtype=np.int64)
        prefix = np.array(self.a.prefix[: self.budget], dtype=np.int64)
        trial = gen.copy()
        trial[: prefix.size] = prefix
        if prefix.size and self.closes and self.feasible(trial):
            gen = trial
        v = self.a.trans.shape[1]
        for i in range(int((gen != self.mask_id).sum()), self.budget):
            allowed = self.allowed(gen, np.array([i]), v)[0]
            if allowed.sum() != 1:
                break
            gen[i] = int(np.argmax(allowed))
        return gen


class TokenMasks:
    """The allowed tokens of the positions one model call scores: the call's canvases x
    (R, S), whose generated regions start at slot P, and their constraints (None:
    unconstrained)."""

    def __init__(self, x: np.ndarray, P: int, constraints: list[Constraint | None]) -> None:
        self.x, self.P, self.constraints = x, P, constraints

    def at(self, rows: np.ndarray, slots: np.ndarray, vocab: int) -> np.ndarray:
        """(N, vocab) float32 log-weights added to the scored positions' logits (rows, canvas
        slots: (N,) each): `Constraint.weights`, 0 for unconstrained rows."""
        out = np.zeros((rows.shape[0], vocab), dtype=np.float32)
        for r in dict.fromkeys(rows.tolist()):  # each row once, in order
            c = self.constraints[r]
            if c is None:
                continue
            at = np.flatnonzero(rows == r)
            c.write_weights(out, at, self.x[r, self.P :], slots[at] - self.P)
        return out


def masks_for(x: np.ndarray, P: int, constraints: list[Constraint | None]) -> TokenMasks | None:
    """TokenMasks of a call's rows, or None when none is constrained (nothing to mask)."""
    if all(c is None for c in constraints):
        return None
    return TokenMasks(x, P, constraints)


def check_decoder(constraint: Constraint, params: Any) -> None:
    """Refuse a decoder that cannot honour the constraint (GrammarError, one line)."""
    from unmask.decoding.knobs import entry

    if params.suppress_eos:
        raise GrammarError("a response format needs EOS to end its output: drop suppress_eos")
    if constraint.mode == "prefix" and entry("method", params.method).facts.drafts:
        raise GrammarError(f"the longest-valid-prefix mode commits left to right and runs with "
                           f"the plain rules; {params.method!r} drafts (use its rule)")
    if constraint.budget > params.gen_length:
        raise GrammarError(f"the constraint's budget ({constraint.budget} tokens) exceeds "
                           f"gen_length ({params.gen_length})")
