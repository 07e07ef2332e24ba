"""qadence's ``ml_tools.optimize_step`` path: ``from trainstack.optimize_step import optimize_step`` works unchanged.

Importing this module makes ``trainstack.optimize_step`` the module rather than the function (Python sets a
package attribute for every imported submodule), so the module itself is callable and steps like the function.
"""

from __future__ import annotations

from ._common.modules import make_callable
from ._train.steps import optimize_step

__all__ = ["optimize_step"]


make_callable(__name__, optimize_step)
