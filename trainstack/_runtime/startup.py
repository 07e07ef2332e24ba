"""Whether and how a launch may start new processes: the main-guard checks (a script that starts the run at its
top level would start it again in every worker), and the start method (forkserver or spawn for scripts, fork in
notebooks -- refused where CUDA or autograd's threads already run)."""

from __future__ import annotations

import ast
import gc
import multiprocessing
import os
import sys
from collections.abc import Callable
from types import FrameType

import torch

from .._common import envvars as envvars
from ..errors import LaunchError
from . import preload as _preload

__all__ = ["check_main_guard", "check_not_bootstrapping", "start_method", "MAIN_GUARD", "main_script",
           "freeze_loaded"]

START_METHODS = ("spawn", "fork", "forkserver")

MAIN_GUARD = ("start the run under a main guard, so that the worker processes (which re-import your script) do "
               "not start it again:\n\n"
               "    def train(model, loader, accelerator):\n        ...\n\n"
               "    if __name__ == \"__main__\":\n"
               "        accelerator.distribute(train)(model, loader, accelerator)\n")
MAIN_GUARD_TRAINER = ("start training under a main guard, so that the worker processes (which re-import your "
                       "script) do not start it again:\n\n"
                       "    if __name__ == \"__main__\":\n"
                       "        Trainer(model, optimizer, config, loss_fn=...).fit(train_loader)\n")


def freeze_loaded() -> None:
    """Move what is loaded so far (torch, trainstack: objects that live as long as the process) out of the garbage
    collector's sight (``gc.freeze``): the imports still to come -- torch._dynamo, which the first optimizer pulls
    in, ~1 s -- and every full collection in training then stop scanning it again. ~0.3 s less per process start, in
    every relaunch of a recovery (bench/startup.py); cyclic garbage made before this point is never collected
    (there is next to none). ``TRAINSTACK_GC_FREEZE=0`` keeps Python's default."""
    if os.environ.get(envvars.GC_FREEZE, "1") != "0":
        gc.freeze()


def _guard_hint(fn: Callable) -> str:
    return MAIN_GUARD_TRAINER if getattr(fn, "__module__", "").startswith("trainstack") else MAIN_GUARD


def main_script() -> str | None:
    """The script ``python`` runs, when there is one on disk (not a notebook, ``python -c`` or ``python -``)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return path if path and os.path.isfile(path) else None


def check_main_guard(fn: Callable) -> None:
    """Refuse, before any worker starts, a launch made from the top level of the main script outside
    ``if __name__ == "__main__":`` -- every worker would re-import the script and start the run again. One short
    error in the launching process, with the fix for the API used."""
    path = main_script()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") ==
                                     "__main__"):
        frame = frame.f_back
    if path is None or frame is None or not os.path.samefile(frame.f_code.co_filename, path):
        return
    line = frame.f_lineno
    if any(start <= line <= end for start, end in _main_guarded_lines(path)):
        return
    raise LaunchError(f"{os.path.basename(path)}:{line} starts the distributed run at the top level of the script, "
                      f"outside `if __name__ == \"__main__\":`; every worker process re-imports the script and would "
                      f"start it again. HINT: " + _guard_hint(fn))


def _main_guarded_lines(path: str) -> list[tuple[int, int]]:
    """Line ranges of the script's ``if __name__ == "__main__":`` blocks."""
    try:
        tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return [(0, sys.maxsize)]  # cannot tell: let the launch go on
    spans = []
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_test(node.test):
            spans.append((node.lineno, node.end_lineno or node.lineno))
    return spans


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    values = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and values == ["__main__"]


def check_not_bootstrapping() -> None:
    """Refuse to launch from a worker that is still importing the user's main module (no main guard).

    A spawned child re-imports ``__main__``; without a guard the script's top level would start a whole new run in
    every worker (Python's own check is bypassed because such a child looks like a notebook to us).
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise LaunchError("this script started training at import time, and a worker process re-imported it. "
                          "HINT: " + MAIN_GUARD)


def _autograd_threads() -> list[str]:
    """Names of autograd's per-device worker threads in this process (started by a backward when CUDA exists)."""
    names: list[str] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # not Linux: nothing to inspect
        return names
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as fh:
                name = fh.read().strip()
        except OSError:
            continue
        if name.startswith("pt_autograd_"):
            names.append(name)
    return names


def start_method() -> str:
    """``forkserver`` (preloaded, see ``trainstack._runtime.preload``) or ``spawn`` for scripts; ``fork`` in
    notebooks/REPLs where a new process cannot re-import ``__main__``."""
    forced = os.environ.get(envvars.START_METHOD)
    if forced:
        if forced not in START_METHODS:
            raise LaunchError(f"TRAINSTACK_START_METHOD={forced!r} is not one of {', '.join(START_METHODS)}. "
                              f"HINT: unset it to let trainstack choose (spawn for scripts, fork in notebooks).")
        return forced
    if main_script() is not None:  # a script on disk: new processes can re-import it
        return "forkserver" if _preload.enabled() else "spawn"
    if torch.cuda.is_initialized():
        raise LaunchError(
            "cannot start workers from this notebook: CUDA was already initialised in this kernel, and forked "
            "processes cannot re-initialise it. HINT: restart the kernel and call the distributed function "
            "before anything touches CUDA (no .cuda()/.to('cuda') at top level).")
    threads = _autograd_threads()
    if threads:
        raise LaunchError(
            f"cannot start workers from this notebook: a backward pass already ran in this kernel and started "
            f"autograd's device threads ({', '.join(sorted(threads))}), and forked processes cannot use autograd "
            f"after that (every worker would die with 'Unable to handle autograd's threading in combination with "
            f"fork-based multiprocessing'). HINT: restart the kernel and call the distributed function before any "
            f"loss.backward() in the kernel, or move the code into a script and run it with python.")
    return "fork"
