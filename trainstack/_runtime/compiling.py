"""``torch.compile`` for prepared models: safe on many ranks, warm across requeues.

* **In place** (as ``nn.Module.compile`` would; see ``compile_in_place``): the module object and its
  ``state_dict`` keys stay the plain module's (no ``_orig_mod.``), so checkpoints load anywhere; a model the user
  compiled (an ``OptimizedModule``) is unwrapped to its module first. Order: DDP wraps the compiled module; FSDP2
  compiles each block before ``fully_shard`` (as torchtitan does).
* **The first step compiles**: ``FirstStep`` gives it a long window -- the hang watchdog allows
  ``TRAINSTACK_COMPILE_TIMEOUT`` seconds until every rank finished it, the process group's timeout is raised as long
  -- then a barrier, the short timeout back, and one line with each rank's compile time. A model that fails to
  compile is a ``ConfigError`` naming the op and the ``compile=False`` fix.
* **One cache per run**: inductor's (and triton's) cache folder under the run (or job) folder on shared storage, so
  a requeued attempt -- or any rank -- finds the artifacts the first one compiled. The cache is code a warm start
  runs (modules, shared libraries, pickled graphs): it is created 0700, and a cache (or the folder holding it) that
  another user owns or can write is never used -- the run's cache then goes to a private folder of this user, and
  a ``TRAINSTACK_COMPILE_CACHE`` that fails the check is an error with the fix.
"""

from __future__ import annotations

import collections.abc
import datetime
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._common import envvars as envvars
from .._common.files import untrusted_folder
from ..errors import ConfigError

__all__ = ["compile_options", "unwrap_compiled", "plan", "compile_in_place", "use_cache", "cache_folder", "window",
           "FirstStep", "CACHE_FOLDER"]

#: The cache's folder name under a run or job folder.
CACHE_FOLDER = "compile-cache"
_DEFAULT_WINDOW_S = 1800.0
_OPTIONS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")
_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_options(value: bool | dict[str, Any] | None, owner: str = "compile") -> dict[str, Any] | None:
    """``compile=True`` / a dict of ``torch.compile`` keywords -> the keywords; ``False``/``None`` -> None. A bad
    value or keyword is a ConfigError naming it."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{owner}={value!r} must be True, False or a dict of torch.compile options, e.g. "
                          f"{{'mode': 'max-autotune', 'fullgraph': True}}")
    bad = sorted(set(value) - set(_OPTIONS))
    if bad:
        raise ConfigError(f"{owner} has unknown torch.compile option(s) {bad}; valid: {', '.join(_OPTIONS)}")
    checks: tuple[tuple[str, tuple[Any, ...], str], ...] = (
        ("fullgraph", (bool,), "True or False"), ("dynamic", (bool, type(None)), "True, False or None"),
        ("disable", (bool,), "True or False"), ("options", (dict,), "a dict"),
        ("backend", (str, collections.abc.Callable), "a backend name such as 'inductor', or a backend function"))
    for name, kinds, what in checks:
        if name in value and not isinstance(value[name], kinds):
            raise ConfigError(f"{owner}={{{name!r}: {value[name]!r}}}: {name} must be {what}.")
    if "mode" in value and value["mode"] not in _MODES:
        raise ConfigError(f"{owner}={{'mode': {value['mode']!r}}}: mode must be one of {', '.join(map(repr, _MODES))}.")
    if "mode" in value and "options" in value:
        raise ConfigError(f"{owner}: torch.compile takes 'mode' or 'options', not both.")
    return dict(value)


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, bool]:
    """(the plain module, whether the user had compiled it with ``torch.compile(model)``)."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule":
        return inner, True
    return model, False


def plan(model: nn.Module, options: dict[str, Any] | None) -> tuple[nn.Module, dict[str, Any] | None]:
    """(the module to prepare, the compile options for it): a user-compiled model is unwrapped and compiled again
    in place (default options unless given); the cache goes to the job folder (the Trainer re-points it)."""
    model, user_compiled = unwrap_compiled(model)
    options = options if options is not None else ({} if user_compiled else None)
    if options is not None:
        use_cache(cache_folder(None))
    return model, options


def compile_in_place(model: nn.Module, options: dict[str, Any] | None, blocks: Sequence[nn.Module] = ()) -> None:
    """Compile ``model`` (or each of ``blocks``, for FSDP) in place: the same objects, the same parameter names;
    nothing when ``options`` is None.

    What ``nn.Module.compile`` does, with the traced entry a function of ours: dynamo skips a frame that starts in
    torch's own files (``Module._call_impl``) -- seen on torch 2.13, where ``module.compile()`` ran eagerly."""
    if options is None:
        return
    for module in blocks or (model,):
        module._compiled_call_impl = torch.compile(_entry(module._call_impl), **options)


def _entry(call: Callable[..., Any]) -> Callable[..., Any]:
    def compiled_module_call(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    return compiled_module_call


def cache_folder(run_folder: Path | None, run_id: str | None = None) -> Path | None:
    """Where this run's compile cache lives: TRAINSTACK_COMPILE_CACHE (checked: refused unless private), else
    ``<run folder>/compile-cache``, else ``<job folder>/compile-cache`` in a job -- each only where nobody else can
    write it, else a private folder of this user named by the run; None leaves torch's default (a per-user /tmp
    folder)."""
    if os.environ.get(envvars.COMPILE_CACHE):
        given = Path(os.environ[envvars.COMPILE_CACHE])
        problem = untrusted_folder(given)
        if problem:
            raise ConfigError(f"TRAINSTACK_COMPILE_CACHE={given}: {problem}; a warm start runs the code in it, so a "
                              f"cache someone else can write runs their code as you. HINT: point it at a folder only "
                              f"you can write (chmod go-w, or a new folder), or unset it for the run's own cache.")
        return given
    job = os.environ.get(envvars.JOB_DIR)
    home = Path(run_folder) if run_folder is not None else Path(job) if job else None
    if home is None:
        return None
    problem = untrusted_folder(home / CACHE_FOLDER)
    if not problem:
        return home / CACHE_FOLDER
    private = _user_cache_root() / (run_id or home.resolve().name)
    if os.environ.get("RANK", "0") == "0":
        print(f"trainstack: the compile cache goes to {private}, not {home / CACHE_FOLDER}: {problem} (a warm start "
              f"runs the code in it; others must not be able to change it).", flush=True)
    return private


def _user_cache_root() -> Path:
    """This user's own cache root for compile caches (``$XDG_CACHE_HOME/trainstack/compile``, 0700)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainstack" / "compile"
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    base.chmod(0o700)
    return base


def use_cache(folder: Path | None) -> Path | None:
    """Point inductor (and triton) at ``folder`` before anything compiles -- unless the user set
    TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR themselves (a value this function set is re-pointed: the Trainer
    moves a job folder's cache to its run folder); returns the inductor cache in use (None: torch's default)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        current = os.environ.get(var)
        torch_default = var == "TORCHINDUCTOR_CACHE_DIR" and current is not None and \
            os.path.abspath(current) == os.path.abspath(default_cache_dir())  # inductor writes its default back
        if folder is None or (current and current != _SET_BY_US.get(var) and not torch_default):
            continue
        (folder / sub).mkdir(parents=True, exist_ok=True)
        os.environ[var] = _SET_BY_US[var] = str(folder / sub)
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(current) if current else None


#: The cache variables this process set (and may move), as opposed to the user's.
_SET_BY_US: dict[str, str] = {}


def _from_cache(exc: BaseException, cache: str) -> bool:
    """Whether ``exc`` (or what caused it) was raised loading a file of the compile cache."""
    import traceback

    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return False
        text = "".join(traceback.format_exception(type(seen), seen, seen.__traceback__))
        if cache in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def window() -> float:
    """Seconds the compiling first step may take (TRAINSTACK_COMPILE_TIMEOUT, default 30 minutes)."""
    try:
        return envvars.positive_number(envvars.COMPILE_TIMEOUT, _DEFAULT_WINDOW_S)
    except ValueError as exc:
        raise ConfigError(f"{exc} (seconds). HINT: unset it for the {_DEFAULT_WINDOW_S:.0f} s default.") from None


def explain(exc: BaseException) -> ConfigError | None:
    """A compile failure (dynamo/inductor) as a clear error naming the failing op -- or the damaged cache it came
    from --, or None for any other error."""
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache and _from_cache(exc, cache):
        return ConfigError(f"the compile cache {Path(cache).parent} is damaged ({type(exc).__name__}: "
                           f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}); its files are what "
                           f"a warm start loads. HINT: delete {Path(cache).parent} and run again (the first step "
                           f"compiles afresh).")
    try:
        from torch._dynamo.exc import TorchDynamoException
    except ImportError:  # pragma: no cover - torch without dynamo
        return None
    if not isinstance(exc, TorchDynamoException):
        return None
    text = str(exc).strip().splitlines()
    first = next((line for line in text if line.strip()), type(exc).__name__)
    after = text[next((i for i, line in enumerate(text) if "from user code" in line), len(text)):]
    frames = [line.strip() for line in after if line.strip().startswith("File ")]
    op = next((line.strip() for line in text if "target:" in line or line.strip().startswith("op:")), None)
    where = "".join(f" at {x}" for x in (op, frames[-1] if frames else None) if x)
    return ConfigError(f"torch.compile could not compile the model: {type(exc).__name__}: {first[:300]}{where}. "
                       f"HINT: compile=False trains eagerly; compile={{'fullgraph': False}} lets dynamo fall back "
                       f"around unsupported code; TORCH_LOGS=graph_breaks shows where.")


class FirstStep:
    """The training step, with its first call run as the compile warm-up (see the module docstring); every later
    call goes straight through. Attributes are the wrapped step's."""

    def __init__(self, step: Callable[..., Any], accelerator: Any, say: Callable[[str], None]) -> None:
        self._step, self._acc, self._say, self._done = step, accelerator, say, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._done:
            return self._step(*args, **kwargs)
        return self._warm_up(*args, **kwargs)

    def _warm_up(self, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        grouped = dist.is_available() and dist.is_initialized()
        short = _pg_timeout() if grouped else None
        if grouped and short is not None and short.total_seconds() < window():
            _set_pg_timeout(datetime.timedelta(seconds=window()))
        started = time.monotonic()
        try:
            out = self._step(*args, **kwargs)
        except Exception as exc:
            clear = explain(exc)
            if clear is not None:
                raise clear from exc
            raise
        took = time.monotonic() - started
        times = self._acc.gather(torch.tensor([took], dtype=torch.float64)) if grouped else torch.tensor([took])
        self._acc.barrier()  # every rank finished compiling: the short timeouts hold from here
        if grouped and short is not None:
            _set_pg_timeout(short)
        self._done = True
        per_rank = ", ".join(f"{t:.1f}" for t in times.tolist())
        self._say(f"compiled the first step in {float(times.max()):.1f} s (per rank: {per_rank} s)")
        return out


def _pg_timeout() -> datetime.timedelta | None:
    import torch.distributed.distributed_c10d as c10d

    try:
        device = torch.device("cuda" if c10d.get_backend() == "nccl" else "cpu")
        return c10d._get_default_group()._get_backend(device).options._timeout
    except Exception:  # the backend's options do not say: leave the timeout alone
        return None


def _set_pg_timeout(timeout: datetime.timedelta) -> None:
    import torch.distributed.distributed_c10d as c10d

    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is not None:
        try:
            setter(timeout)
        except Exception:  # a backend that cannot change it keeps the one it was created with
            pass
