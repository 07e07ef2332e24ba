"""Modules a user can call: ``from trainstack import render`` gives the module, and ``render(spec)`` calls its
function whatever was imported first (the names of the door and of its function are the same). Torch-free leaf."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

__all__ = ["CallableModule", "make_callable"]


class CallableModule(types.ModuleType):
    """A module whose call is its function of the same name."""

    __call_target__: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__call_target__(*args, **kwargs)


def make_callable(name: str, target: Callable[..., Any]) -> None:
    """Make the module ``name`` (already imported: call this at its end) callable as ``target``."""
    module = sys.modules[name]
    module.__call_target__ = target  # type: ignore[attr-defined]
    module.__class__ = CallableModule
