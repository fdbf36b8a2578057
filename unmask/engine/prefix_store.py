"""Prefix reuse across requests: the K/V of finished blocks of a block-causal model, computed
once, read by every later request whose prompt starts with the same blocks.

For a block-causal model (SDAR, LLaDA2, Fast-dLLM v2) the K/V of a block depends only on the
tokens of that block and of the blocks before it, at their positions (blocks lie on absolute
positions: unmask.engine.layout.CausalBlockLayout). So a block is keyed by a hash chain of whole
blocks of token ids (block i's key hashes block i-1's key and block i's tokens) and its K/V is
exact for any request whose canvas starts with those tokens. The exact block cache stores K/V
only once its block is final (unmask.caching.BlockCache): every whole block of a store row whose
positions all hold K/V is such a block, prompt or generated answer alike.

A hit is *copied* into the request's own K/V store row when it joins (`PrefixStore.restore`), and
its slots marked as holding those tokens: the decoder then forwards only the rest of the prompt,
as it forwards any slot without K/V, in the same model call as the rest of its batch. Nothing a
running request reads lives here, so evicting an entry (LRU, under a byte budget) can never
change or fail a request in flight (docs/engine.md, "Prefix reuse").
"""

from __future__ import annotations

import hashlib
import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from unmask.decoding.knobs import entry
from unmask.decoding.params import DecodeParams
from unmask.engine.batch import DecodeBatch
from unmask.engine.layout import block_size_of
from unmask.engine.request import Request
from unmask.errors import InputError
from unmask.memory import GIB, PREFIX_SHARE, available_ram


def check_budget(gib: float, free_bytes: int | None = None) -> int:
    """A budget in GiB as bytes, or an InputError naming what is wrong with it (0, negative,
    NaN, or more than the memory free on the device)."""
    if isinstance(gib, bool) or not isinstance(gib, (int, float)):
        raise InputError(f"prefix_cache_gib must be a number of GiB, got {type(gib).__name__}")
    if math.isnan(gib) or gib <= 0 or math.isinf(gib):
        raise InputError(f"prefix_cache_gib must be a positive number of GiB, got {gib}; "
                         "turn reuse off with --no-prefix-cache")
    budget = int(gib * GIB)
    if free_bytes is not None and budget > free_bytes:
        raise InputError(f"prefix_cache_gib {gib} exceeds the memory free on the model's device "
                         f"({free_bytes / GIB:.2f} GiB); valid: <= {free_bytes / GIB:.2f}")
    return max(budget, 1)


# Why full-attention families get no store (docs/decoders.md, "Prefix reuse").
BIDIRECTIONAL = ("prefix reuse applies to block-causal models (SDAR, LLaDA2, Fast-dLLM v2) "
                 "only: a bidirectional model's prompt K/V depends on the whole canvas, so a "
                 "stored prefix would be an approximation; drop prefix_cache_gib")


def free_bytes(device: torch.device) -> int:
    """Memory free on `device` now: RAM available (unmask.show) or the GPU's free memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_ram()


def make_prefix_store(model: torch.nn.Module, device: torch.device, enabled: bool = True,
                      gib: float | None = None) -> PrefixStore | None:
    """The store an `LLM` shares between its engines: None when off or for a bidirectional
    model; its budget `gib` GiB, else PREFIX_SHARE of the memory free on the device now. A
    budget given for a model that cannot use it, or with reuse off, is refused by name."""
    if not isinstance(enabled, bool):
        raise InputError(f"prefix_cache must be True or False, got {enabled!r}")
    if not enabled:
        if gib is not None:
            raise InputError("prefix_cache_gib given with the prefix cache off: drop one")
        return None
    block = block_size_of(model)
    if block is None:
        if gib is not None:
            raise InputError(BIDIRECTIONAL)
        return None
    free = free_bytes(device)
    budget = check_budget(gib, free) if gib is not None else max(int(PREFIX_SHARE * free), 1)
    return PrefixStore(block, budget)


def reuses(params: DecodeParams) -> bool:
    """Whether a decoder of these params reads and feeds the store: only the exact block cache
    (a block-causal cache that never reads stale K/V), whose finished blocks are the same bits
    whoever computed them."""
    facts = entry("cache", params.cache).facts
    return facts.block_causal and facts.uses_store and not facts.stale_keys


@dataclass
class PrefixStats:
    """What the store did, for metrics: token positions read from it instead of forwarded,
    blocks and bytes it holds now, blocks it evicted, blocks it took in all."""

    hit_tokens: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    evictions: int = 0
    inserted_blocks: int = 0


@dataclass
class _Chain:
    """A request's progress through the store: how many of its leading blocks the store has
    been offered (or gave it), the key of the last, and how many its canvas holds (0 before it
    joins)."""

    blocks: int = 0
    key: bytes = b""
    limit: int = 0


# The pool's segment, and so the store's size until traffic shows that a larger one would be
# read (PrefixStore): small, since a store of traffic that shares nothing holds (and copies,
# and first touches the memory of) only blocks that are never read; a few of them hold a
# shared system prompt of a small model, and a larger model's grows in a request or two.
SEGMENT_BYTES = 8 << 20


# Blocks whose token ids are made bytes at once when keys are computed (PrefixStore.keys).
KEY_CHUNK = 16


class PromptKeys:
    """The keys of a prompt's leading whole blocks (`PrefixStore.keys`, up to its last token's
    block, which is always forwarded), computed as far as a reader goes and kept, so that a
    request's lookups hash each block once: the admission window's look (`PrefixStore.held`)
    and its restore read the same prompt in turn, ~2 us a block (a ~540-token prompt, ~0.25
    ms; a burst of 16 in the step that admits it: ~4 ms of ~30). Iterating yields the keys in
    order, computing the ones no reader has reached yet."""

    def __init__(self, prompt_ids: Sequence[int], block_size: int) -> None:
        limit = (len(prompt_ids) - 1) // block_size
        self._more = PrefixStore.keys(b"", prompt_ids[: limit * block_size], block_size)
        self._keys: list[bytes] = []

    def __iter__(self) -> Iterator[bytes]:
        i = 0
        while True:
            if i == len(self._keys):
                key = next(self._more, None)
                if key is None:
                    return
                self._keys.append(key)
            yield self._keys[i]
            i += 1


@dataclass
class _Pool:
    """Entries of one block each (block_size, L, 2, H_kv, D), in segments of `per` entries
    (entry e: segment e // per, row e % per). Growing adds a segment and never copies the
    blocks held, as a single doubling tensor did at every growth; a step's blocks are gathered
    straight into their entries."""

    per: int
    segments: list[Tensor] = field(default_factory=list)
    entries: int = 0  # in all segments

    def grow(self, kv: Tensor, block_size: int, capacity: int) -> int:
        """Add a segment like the K/V store kv's blocks, at most up to `capacity` entries in
        all; returns the new count of entries."""
        self.segments.append(kv.new_empty(min(self.per, capacity - self.entries), block_size,
                                          *kv.shape[2:]))
        self.entries += self.segments[-1].shape[0]
        return self.entries

    def write(self, entries: list[int], flat: Tensor, starts: np.ndarray) -> None:
        """Entry entries[i] := the block_size positions of flat, a K/V store's (P, L, 2, H_kv,
        D), from starts[i] on: gathered straight into the entries, one gather a run."""
        bs = self.segments[0].shape[1]
        at = torch.from_numpy(starts[:, None] + np.arange(bs)).to(flat.device)  # (n, bs)
        for seg, row, i, n in self._runs(entries):
            dst = self.segments[seg][row : row + n]  # (n, block_size, L, 2, H_kv, D)
            torch.index_select(flat, 0, at[i : i + n].reshape(-1),
                               out=dst.view(-1, *dst.shape[2:]))

    def read(self, entries: list[int], out: Tensor) -> None:
        """out[i] := entry entries[i] (out: (n, block_size, L, 2, H_kv, D))."""
        for seg, row, i, n in self._runs(entries):
            out[i : i + n] = self.segments[seg][row : row + n]

    def _runs(self, entries: list[int]) -> list[list[int]]:
        """[segment, first row, first index into entries, count] of each run of consecutive
        entries within one segment: one copy each (new blocks take consecutive free entries,
        so a step's or a hit's are mostly one run)."""
        runs: list[list[int]] = []
        last = -2
        for i, e in enumerate(entries):
            if e == last + 1 and e % self.per:
                runs[-1][3] += 1
            else:
                runs.append([e // self.per, e % self.per, i, 1])
            last = e
        return runs


@dataclass
class PrefixStore:
    """K/V of whole blocks (block_size positions, every layer) by hash-chain key, least recently
    used first, at most `budget` bytes.

    The blocks live in a `_Pool` of entries, a block per entry, grown by segments up to the
    budget's count of blocks: a row's newly finished blocks are written with one copy per run
    of consecutive entries (most steps: one), a request's hits read likewise, and an eviction
    frees an entry for the next block (no allocation per block).

    The pool starts with one segment and grows only when a request misses blocks the store let
    go for lack of room (evicted, or not taken in because a step finished more blocks than
    the pool holds): their keys are kept (`_ghosts`, as many as the budget holds blocks), and
    a request whose prompt runs into them asks for that many more entries. Traffic that shares
    nothing never does, so its store stays one segment, whose memory is written again instead
    of new memory touched for the first time, and copies at most a segment a step
    (benchmarks/probe/prefix-store-split.md).
    """

    block_size: int
    budget: int
    stats: PrefixStats = field(default_factory=PrefixStats)
    _entry: OrderedDict[bytes, int] = field(default_factory=OrderedDict, repr=False)  # key ->
    # its block's index in _pool, least recently used first
    _pool: _Pool | None = field(default=None, repr=False)
    _free: list[int] = field(default_factory=list, repr=False)  # entries of _pool unused
    _ghosts: OrderedDict[bytes, None] = field(default_factory=OrderedDict, repr=False)  # keys
    # of blocks let go for lack of room, most recent last
    _wanted: int = field(default=0, repr=False)  # entries requests missed in _ghosts since the
    # pool last grew
    _chains: dict[str, _Chain] = field(default_factory=dict, repr=False)
    _prompts: set[str] = field(default_factory=set, repr=False)  # requests whose prompt's
    # whole blocks were not offered yet
    # engines of one LLM (a server's, LLM.generate's) may run on different threads
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.budget < 1:
            raise InputError(f"a prefix store needs a block size and a budget >= 1, got "
                             f"{self.block_size} and {self.budget}")

    # --- keys ---------------------------------------------------------------------------------
    @staticmethod
    def keys(key: bytes, tokens: Sequence[int] | np.ndarray, block_size: int) -> Iterator[bytes]:
        """The keys of the whole blocks of `tokens` in turn, the first after the block keyed
        `key`: the token ids as int64 bytes made KEY_CHUNK blocks at a time (a lookup stops
        at its first miss), a block's key from a slice of them."""
        width, chunk = block_size * 8, block_size * KEY_CHUNK
        for lo in range(0, len(tokens) - block_size + 1, chunk):
            data = np.asarray(tokens[lo : lo + chunk], dtype=np.int64).tobytes()
            for at in range(0, len(data) - width + 1, width):
                key = hashlib.blake2b(key + data[at : at + width], digest_size=16).digest()
                yield key

    # --- requests joining: hits copied into their store rows ----------------------------------
    def restore(self, b: DecodeBatch, reqs: list[Request]) -> None:
        """Copy each joining request's stored leading blocks into its row of b's K/V store (the
        requests are b's last rows). A prompt's last token is always forwarded: its block is the
        first the decoder forwards (a model that predicts a slot from the one before reads it)."""
        with self._lock:
            self._restore(b, reqs)

    def _restore(self, b: DecodeBatch, reqs: list[Request]) -> None:
        first = len(b) - len(reqs)
        per_position = b.store.kv[0, 0].numel() * b.store.kv.element_size()
        for i, req in enumerate(reqs):
            hits, rest = self._lookup(req)
            self._wanted += self._missed(rest)
            chain = _Chain(len(hits), hits[-1][0]) if hits else _Chain()
            if req.slots * per_position <= self.budget:
                # else its blocks would only evict each other: it runs without storing
                chain.limit = req.slots // self.block_size
                self._chains[req.request_id] = chain
                if chain.blocks < req.prompt_len // self.block_size:
                    self._prompts.add(req.request_id)
            if not hits:
                continue
            for key, _ in reversed(hits):  # a chain's first block is its most recently used
                self._entry.move_to_end(key)
            n = chain.blocks * self.block_size
            row = int(b.store_row[first + i])
            dst = b.store.kv[row, :n].view(len(hits), self.block_size, *b.store.kv.shape[2:])
            self._pool.read([e for _, e in hits], dst)  # (hits, bs, L, 2, H, D)
            b.store.token[row, :n] = req.prompt_ids[:n]
            req.cached_tokens = n
            self.stats.hit_tokens += n

    def held(self, prompt: Request | Sequence[int]) -> int:
        """How many of a prompt's leading tokens the store holds now (whole blocks, up to its last
        token's block, as `restore` would copy them): a read-only look, which moves no entry in
        the LRU order and counts nothing (the admission window asks it before a step)."""
        with self._lock:
            return len(self._lookup(prompt)[0]) * self.block_size

    def _lookup(self, prompt: Request | Sequence[int],
                ) -> tuple[list[tuple[bytes, int]], Iterator[bytes]]:
        """The stored leading blocks of a prompt, (key, entry) each, up to its last token's block
        (always forwarded: `restore`), and the keys of the rest from its first miss on. A
        request's keys are kept on it (`PromptKeys`)."""
        if isinstance(prompt, Request):
            if prompt.prompt_keys is None:
                prompt.prompt_keys = PromptKeys(prompt.prompt_ids, self.block_size)
            keys = iter(prompt.prompt_keys)
        else:
            keys = iter(PromptKeys(prompt, self.block_size))
        hits = []
        for key in keys:
            entry = self._entry.get(key)
            if entry is None:
                return hits, itertools.chain([key], keys)
            hits.append((key, entry))
        return hits, iter(())

    def _missed(self, keys: Iterator[bytes]) -> int:
        """How many of a prompt's blocks from its first miss on (`keys`) the store let go for
        lack of room: up to the first it never had."""
        n = 0
        for key in keys:
            if key in self._ghosts:
                n += 1
            elif key not in self._entry:
                break
        return n

    # --- after a step: finished blocks offered ------------------------------------------------
    def offer(self, b: DecodeBatch, leaving: np.ndarray) -> None:
        """Store the whole blocks of b's rows that hold final K/V and that the store was not
        offered yet (the exact block cache stores a slot's K/V only once its block is final):
        a row's prompt's at the first step they do (so that requests joining while it runs
        read them), the rest when it leaves, finished or stopped (`leaving` (R,) bool: its
        answer's blocks, which the next turn of a chat reads once the answer is returned).
        Most steps have nothing to look at: no per-row work while rows decode."""
        with self._lock:
            if self._prompts or leaving.any():
                self._offer(b, leaving)

    def _offer(self, b: DecodeBatch, leaving: np.ndarray) -> None:
        bs, width = self.block_size, b.store.shape[1]
        starts: list[int] = []  # the new blocks' first positions, flat (row * width + position)
        keys: dict[bytes, None] = {}  # their keys, in order (a key two rows finish: once)
        for i, req in enumerate(b.requests):
            chain = self._chains.get(req.request_id)
            if chain is None or not (leaving[i] or req.request_id in self._prompts):
                continue
            row = int(b.store_row[i])
            token = b.store.token[row]  # (W,) position -> token its K/V came from (-1: none)
            j, end = chain.blocks, min(width // bs, chain.limit)
            if j < end and token[(j + 1) * bs - 1] >= 0:  # blocks are stored whole, in order
                held = (token[j * bs : end * bs] >= 0).reshape(-1, bs).all(-1)  # (end - j,)
                whole = j + (int(held.argmin()) if not held.all() else held.size)
                for k, key in enumerate(self.keys(chain.key, token[j * bs : whole * bs], bs), j):
                    if key in self._entry:  # stored by another request
                        self._entry.move_to_end(key)
                    elif key not in keys:
                        starts.append(row * width + k * bs)
                        keys[key] = None
                    chain.key = key
                chain.blocks = whole
            if chain.blocks >= req.prompt_len // bs:
                self._prompts.discard(req.request_id)
        if keys:
            self._put(b.store.kv, starts, list(keys))

    def forget(self, request_id: str) -> None:
        """A request left: its progress is no longer needed."""
        with self._lock:
            self._chains.pop(request_id, None)
            self._prompts.discard(request_id)

    def _put(self, kv: Tensor, starts: list[int], keys: list[bytes]) -> None:
        """Store the blocks of a K/V store kv (N, W, L, 2, H, D) that start at flat positions
        `starts` (row * W + position) under `keys` (none stored yet), a copy per run of them
        (mostly one a row); least recently used blocks are evicted to make room."""
        bs = self.block_size
        size = bs * kv[0, 0].numel() * kv.element_size()  # bytes a block
        capacity = self.budget // size
        if capacity == 0:  # a block larger than the whole budget is never kept
            return
        if len(keys) > capacity:  # more than the budget holds: the last ones are kept
            starts, keys = starts[-capacity:], keys[-capacity:]
        entries = self._claim(kv, len(keys), capacity)
        self._let_go(keys[len(entries) :], capacity)  # past what the pool holds: remembered
        keys = keys[: len(entries)]
        for key in keys:  # held again: no longer let go (`_missed`)
            self._ghosts.pop(key, None)
        self._pool.write(entries, kv.view(-1, *kv.shape[2:]),
                         np.array(starts[: len(entries)]))
        # a chain's first block most recently used (as a hit leaves it): evicted last
        self._entry.update(zip(reversed(keys), reversed(entries), strict=True))
        self.stats.stored_blocks = len(self._entry)
        self.stats.stored_bytes = len(self._entry) * size
        self.stats.inserted_blocks += len(keys)

    def _claim(self, kv: Tensor, n: int, capacity: int) -> list[int]:
        """Up to n entries of the pool for blocks of the K/V store kv (N, W, L, 2, H, D): free
        ones (a new segment's in order, so a step's blocks take consecutive entries), new ones
        (the pool's first segment, or more while requests missed blocks let go: `_wanted`, at
        most `capacity` entries in all), then the least recently used blocks'. Fewer than n
        when the pool holds fewer blocks than that."""
        if self._pool is None:
            self._pool = _Pool(max(SEGMENT_BYTES // (kv[0, : self.block_size].numel()
                                                     * kv.element_size()), 1))
        got: list[int] = []
        while len(got) < n:
            held = self._pool.entries
            if not self._free and held < capacity and (held == 0 or self._wanted > 0):
                grown = self._pool.grow(kv, self.block_size, capacity)
                self._free = list(range(grown - 1, held - 1, -1))
                self._wanted = max(self._wanted - (grown - held), 0)
            if not self._free:
                break
            take = min(n - len(got), len(self._free))
            got += self._free[: -take - 1 : -1]  # the last `take`, last first
            del self._free[-take:]
        evicted = [self._entry.popitem(last=False) for _ in range(min(n - len(got),
                                                                      len(self._entry)))]
        self._let_go([key for key, _ in evicted], capacity)
        self.stats.evictions += len(evicted)
        # least recently used first is a chain's last block first: sorted, consecutive entries
        # are one run to copy, not one each
        return got + sorted(entry for _, entry in evicted)

    def _let_go(self, keys: list[bytes], capacity: int) -> None:
        """Remember blocks let go for lack of room, forgetting the oldest past `capacity` (the
        budget's count of blocks: one let go longer ago would not be held at the budget
        either). A key costs ~150 bytes, a block's K/V 16 KiB or more."""
        for key in keys[-capacity:]:
            self._ghosts[key] = None
            self._ghosts.move_to_end(key)
        for _ in range(len(self._ghosts) - capacity):
            self._ghosts.popitem(last=False)
