"""qadence's ``ml_tools.optimize_step`` path: ``from trainstack.optimize_step import optimize_step`` works unchanged.

Importing this module makes ``trainstack.optimize_step`` the module rather than the function (Python sets a
package attribute for every imported submodule), so the module itself is callable and steps like the function.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from ._train.steps import optimize_step

__all__ = ["optimize_step"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return optimize_step(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
