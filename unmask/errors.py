"""The project's error types: one base class for everything that is the caller's input.

The CLI turns an `UnmaskError` into one line and exit code 2; anything else is a bug and keeps
its traceback (exit code 1).
"""

from __future__ import annotations


class UnmaskError(ValueError):
    """Bad input from the caller (spec, model folder, prompt, lengths, paths, ...)."""


class SpecError(UnmaskError):
    """A decoder spec or parameter value that is not valid; the message lists valid choices."""


class ConfigError(UnmaskError):
    """A config.json that unmask cannot honour; the message names the key and its value."""


class CheckpointError(UnmaskError):
    """A model folder that cannot be loaded; the message names the file or tensor."""


class InputError(UnmaskError):
    """A request the model cannot serve (empty prompt, canvas too long, bad argument, ...)."""


class CanvasTooLong(InputError):
    """A prompt and gen_length that together exceed the model's max_sequence_length (a server
    names the field that set the length)."""
