"""The project's error types: one base class for everything that is the caller's input.

The CLI turns an `UnmaskError` into one line and exit code 2; anything else is a bug and keeps
its traceback (exit code 1).
"""

from __future__ import annotations

import re


class UnmaskError(ValueError):
    """Bad input from the caller (spec, model folder, prompt, lengths, paths, ...)."""


class SpecError(UnmaskError):
    """A decoder spec or parameter value that is not valid; the message lists valid choices.
    key: the DecodeParams field it is about, where one is (a server names its own field)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def lone_surrogate(text: str) -> str | None:
    """Where text holds a lone surrogate (half of a UTF-16 pair, e.g. from a bad \\ud800
    escape: Python keeps it in a str, no tokenizer can encode it), as 'it contains a lone
    surrogate (U+D800) at character 3'; None when it holds none."""
    m = _SURROGATE.search(text)
    if m is None:
        return None
    return f"it contains a lone surrogate (U+{ord(m.group()):04X}) at character {m.start()}"


_SURROGATE = re.compile("[\ud800-\udfff]")


def is_bearer_token(key: str) -> bool:
    """Whether `key` can travel as an HTTP Bearer token (the server's --api-key, bench-serve's):
    non-empty printable ASCII without spaces, as a header value must be."""
    return bool(key) and key.isascii() and key.isprintable() and not any(c.isspace() for c in key)


class ConfigError(UnmaskError):
    """A config.json that unmask cannot honour; the message names the key and its value."""


class CheckpointError(UnmaskError):
    """A model folder that cannot be loaded; the message names the file or tensor."""


class InputError(UnmaskError):
    """A request the model cannot serve (empty prompt, canvas too long, bad argument, ...)."""


class CanvasTooLong(InputError):
    """A prompt and gen_length that together exceed the model's max_sequence_length (a server
    names the field that set the length)."""


class DecoderMismatch(SpecError, InputError):
    """A decoder key that cannot apply to the model it is sent to (a bidirectional-canvas key on
    a block-causal model, say): a spec error that only the model reveals, so the engine's checks
    (and a server's 400) see it as bad input too."""
