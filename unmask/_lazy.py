"""Package attributes imported on first use (PEP 562), so that importing a package for its
light parts (the CLI's argument definitions) does not pay for torch."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: attribute NAME comes from module where[NAME]."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)  # the next lookup skips this function
        return value

    return __getattr__
