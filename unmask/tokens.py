"""Token ids of rendered chats, the text between the tokenizer's added tokens cached.

Every chat request renders its messages through the chat template and tokenizes the whole text,
most of it, request after request, the same shared system prompt (~0.4 ms of Rust for ~1,500
characters, benchmarks/probe/chat-tokens.md). `ChatTokens.encode` splits the text at the
tokenizer's added tokens (`<|user|>`, `<|assistant|>`, ...), tokenizes each piece between them
once, keeping its ids in a bounded LRU keyed by the piece's text, and joins the ids with the added
tokens' ids.

Exact, where `exact_split` finds no reason against it: Hugging Face `tokenizers` itself splits
the text at its added tokens first (leftmost-longest matches on the raw text), then normalizes,
pre-tokenizes and tokenizes each piece on its own (`AddedVocabulary::extract_and_normalize` and
`PreTokenizedString::split` in its source); so a piece encoded alone gives the ids it gets inside
the whole text, unless something ties a piece to its neighbours or to its place in the string:

- an added token with `lstrip`/`rstrip` (it takes the whitespace next to it from the pieces) or
  `single_word` (whether it matches depends on the characters around it);
- an added token with `normalized=True` (matched on the normalized pieces, in a second pass);
- special tokens encoded as text (`encode_special_tokens`, transformers' `split_special_tokens`);
- a Metaspace pre-tokenizer with `prepend_scheme` "first" (it prepends only to the piece that
  starts the string);
- BPE dropout (random merges: no two encodes need agree);
- a normalizer, pre-tokenizer, model or post-processor type this module does not know (a newer
  `tokenizers` may add one that looks at offsets).

Normalizers run per piece, so every known one is allowed; so are ByteLevel with
`add_prefix_space` (it prepends to every piece, the whole text's too) and Metaspace "always" or
"never". The post-processors known add nothing with add_special_tokens=False, the only way
this is called. Any other tokenizer keeps the whole-text encode, the ids unchanged.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

NORMALIZERS = {"BertNormalizer", "Strip", "StripAccents", "NFC", "NFD", "NFKC", "NFKD",
               "Lowercase", "Nmt", "Precompiled", "Replace", "Prepend", "ByteLevel"}
PRE_TOKENIZERS = {"ByteLevel", "BertPreTokenizer", "Whitespace", "WhitespaceSplit",
                  "Punctuation", "Digits", "Split", "CharDelimiterSplit", "UnicodeScripts",
                  "Metaspace", "FixedLength"}
MODELS = {"BPE", "WordPiece", "WordLevel", "Unigram"}
POST_PROCESSORS = {"ByteLevel", "BertProcessing", "RobertaProcessing", "TemplateProcessing"}
# A piece this long or longer is tokenized with the interpreter lock released (tokenizers'
# batch call): ~0.1 ms of Rust and up. A shorter one holds it for microseconds, less than the
# lock's hand-off back would cost the calling thread under contention (the probe's spinner).
RELEASE_LOCK_AT = 256


def _unknown(part: dict | None, kind: str, known: set[str], key: str) -> str | None:
    """Why a normalizer/pre-tokenizer/post-processor spec rules the split out (None: it does
    not); a Sequence is looked through."""
    if part is None:
        return None
    if part["type"] == "Sequence":
        return next(filter(None, (_unknown(p, kind, known, key) for p in part[key])), None)
    if part["type"] not in known:
        return f"{kind} {part['type']} is not known to act on each piece alone"
    if part["type"] == "Metaspace" and part.get("prepend_scheme") == "first":
        return "Metaspace prepend_scheme 'first' prepends only to the string's first piece"
    return None


def exact_split(spec: dict, encode_special_tokens: bool = False) -> str | None:
    """None where encoding the pieces between added tokens one by one gives the whole text's
    ids, else why not. spec: the backend tokenizer's JSON (`Tokenizer.to_str()`)."""
    if encode_special_tokens:
        return "special tokens are encoded as text (split_special_tokens)"
    for t in spec["added_tokens"]:
        flags = [f for f in ("lstrip", "rstrip", "single_word", "normalized") if t.get(f)]
        if flags or not t["content"]:
            return f"added token {t['content']!r} has {', '.join(flags) or 'no content'}"
    model = spec["model"]
    if model["type"] not in MODELS:
        return f"model {model['type']} is not known to tokenize each word alone"
    if model.get("dropout"):
        return "BPE dropout: encodes are random"
    return (_unknown(spec["normalizer"], "normalizer", NORMALIZERS, "normalizers")
            or _unknown(spec["pre_tokenizer"], "pre-tokenizer", PRE_TOKENIZERS, "pretokenizers")
            or _unknown(spec["post_processor"], "post-processor", POST_PROCESSORS, "processors"))


@dataclass
class PieceCache:
    """A thread-safe LRU of pieces' ids, capped in entries and in the characters of its keys
    (the ids of a piece are fewer than its characters, so the keys bound the memory)."""

    max_pieces: int = 512
    max_chars: int = 4_000_000
    chars: int = 0
    _ids: OrderedDict[str, tuple[int, ...]] = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, text: str) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._ids.get(text)
            if ids is not None:
                self._ids.move_to_end(text)
            return ids

    def put(self, text: str, ids: tuple[int, ...]) -> None:
        if len(text) > self.max_chars:
            return
        with self._lock:
            if text in self._ids:  # another thread encoded it meanwhile
                return
            self._ids[text] = ids
            self.chars += len(text)
            while len(self._ids) > self.max_pieces or self.chars > self.max_chars:
                old, _ = self._ids.popitem(last=False)
                self.chars -= len(old)


class ChatTokens:
    """`encode(text)`: the ids of `tokenizer.encode(text, add_special_tokens=False)`, from cached
    pieces where `exact_split` allows it (`why_whole` says why not, else None)."""

    def __init__(self, tokenizer: Any, cache: PieceCache | None = None) -> None:
        """tokenizer: a transformers fast tokenizer. Its added tokens are read now: tokens added
        to it later are not split at (this module's callers add none)."""
        from tokenizers import Tokenizer

        self.tokenizer = tokenizer
        backend = tokenizer.backend_tokenizer
        spec = json.loads(backend.to_str())
        self.why_whole = exact_split(spec, bool(getattr(tokenizer, "split_special_tokens", False))
                                     or backend.encode_special_tokens)
        self.cache = PieceCache() if cache is None else cache  # an empty one is falsy
        # A copy of its own: transformers sets truncation, padding and split_special_tokens on
        # its backend per call, and no other caller's setting should reach the pieces.
        self._backend = Tokenizer.from_str(backend.to_str())
        self._backend.no_truncation()
        self._backend.no_padding()
        self._added = {t["content"]: t["id"] for t in spec["added_tokens"]}
        # longest first: the regex takes the first alternative that matches, tokenizers the
        # longest at the leftmost place; the capturing group keeps the tokens in split's output
        names = sorted(self._added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    def encode(self, text: str) -> list[int]:
        if self.why_whole is not None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        parts = self._split.split(text) if self._split else [text]
        ids: list[int] = []
        for i, part in enumerate(parts):  # pieces at even places, added tokens at odd ones
            if i % 2:
                ids.append(self._added[part])
            elif part:
                ids.extend(self._piece(part))
        return ids

    def _piece(self, text: str) -> tuple[int, ...]:
        ids = self.cache.get(text)
        if ids is None:
            if len(text) >= RELEASE_LOCK_AT:
                enc = self._backend.encode_batch_fast([text], add_special_tokens=False)[0]
            else:
                enc = self._backend.encode(text, add_special_tokens=False)
            ids = tuple(enc.ids)
            self.cache.put(text, ids)
        return ids
