"""What to run, in every form users type after ``--``: ``train.py args``, ``python train.py args``,
``python3 -u train.py``, ``-m pkg.module args``, ``python -m pkg.module``, or an executable (``./run.sh``,
``bash run.sh``, ``accelerate launch ...``).

``parse_program`` turns the words into a ``Program`` (a script, a module or an executable) without touching
the file system; ``is_executable`` (given by the CLI) settles words that could be either. Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["Program", "parse_program", "FORMS", "KINDS", "ambiguous_for_torchrun", "TORCHRUN_OPTIONS"]

KINDS = ("script", "module", "exec")
_INTERPRETER = re.compile(r"^(.*/)?python(\d+(\.\d+)?)?$")
_FLAG_WITH_VALUE = ("-W", "-X")  # python flags that take the next word
_SHELLS = ("bash", "sh", "zsh", "env")

FORMS = """\b
Program forms after `--`:
  train.py --lr 1            a Python script (run with --python, unbuffered)
  python train.py --lr 1     the same; python, python3, python3.11 or the --python value
  python3 -u train.py        interpreter flags are dropped (-u is always used)
  -m pkg.module --lr 1       a module (python -m pkg.module)
  python -m pkg.module       the same
  ./run.sh args, bash run.sh an executable or command, run as is (torchrun: --no-python)
  accelerate launch ...      with --launcher custom: the command each node runs ({num_processes} ...)
"""


@dataclass(frozen=True)
class Program:
    """``kind`` is ``script`` (``argv[0]`` is a .py file), ``module`` (``argv[0]`` is a module name) or ``exec``
    (``argv`` is a whole command); ``argv`` holds the rest of the words, arguments included."""

    kind: str
    argv: tuple[str, ...]

    @property
    def words(self) -> list[str]:
        """The words after the interpreter: ``[script, *args]``, ``["-m", module, *args]`` or the command."""
        return ["-m", *self.argv] if self.kind == "module" else list(self.argv)


def _is_interpreter(word: str, python: str) -> bool:
    return word == python or bool(_INTERPRETER.match(word))


def _strip_interpreter_flags(words: list[str]) -> list[str]:
    """Drop ``-u``, ``-O``, ``-B``, ``-W x``... between the interpreter and the script or ``-m``."""
    i = 0
    while i < len(words) and words[i].startswith("-") and words[i] not in ("-m", "-c", "-"):
        i += 2 if words[i] in _FLAG_WITH_VALUE else 1
    return words[i:]


def parse_program(words: Sequence[str], python: str = "python3",
                  is_executable: Callable[[str], bool] | None = None) -> Program:
    """Classify the program words; anything ambiguous is a ``ConfigError`` with the fix."""
    words = list(words)
    if not words or not words[0].strip():
        raise ConfigError("no program given: put it after --, e.g. -- train.py --epochs 10 (see --help for forms)")
    if _is_interpreter(words[0], python):
        rest = _strip_interpreter_flags(words[1:])
        if not rest:
            raise ConfigError(f"{' '.join(words)!r} names an interpreter but no script: put the script after it, e.g. "
                              f"-- {words[0]} train.py")
        if rest[0] == "-c":
            raise ConfigError("python -c is not supported as a job program: put the code in a file and run "
                              "-- python that_file.py")
        words = rest if rest[0] == "-m" or rest[0].endswith(".py") else ["--script", *rest]
    if words[0] == "-m":
        if len(words) < 2 or words[1].startswith("-"):
            raise ConfigError("-m needs a module name, e.g. -- -m pkg.train --epochs 10")
        return Program("module", tuple(words[1:]))
    if words[0] == "--script":  # `python something`: the user said it is Python
        return Program("script", tuple(words[1:]))
    head = words[0]
    if head.endswith(".py"):
        return Program("script", tuple(words))
    if head in _SHELLS or head.startswith(("./", "/", "../", "~")) or (is_executable and is_executable(head)):
        return Program("exec", tuple(words))
    if head.startswith("-"):
        raise ConfigError(f"{head!r} looks like an option, but options of trainstack come before -- and the program "
                          f"after it. HINT: -- train.py {' '.join(words)}")
    if is_executable is None:  # no file system to ask: a command name on PATH is the likely meaning
        return Program("exec", tuple(words))
    raise ConfigError(f"{head!r} is neither a .py file, an executable found here, nor a module. HINT: for a "
                      f"script write -- {head}.py or -- python {head}; for a module -- -m {head}; for a command "
                      f"on the nodes' PATH -- ./{head} or its full path.")


#: torchrun's long options (torch 2.13; each with its ``_`` spelling). argparse checks every word of the command
#: line against them, the program's arguments included, and stops at an ambiguous abbreviation.
TORCHRUN_OPTIONS = tuple(f"--{name}" for base in (
    "duplicate-stderr-filters", "duplicate-stdout-filters", "event-log-handler", "help", "local-addr",
    "local-ranks-filter", "log-dir", "logs-specs", "master-addr", "master-port", "max-restarts", "module",
    "monitor-interval", "nnodes", "no-python", "node-rank", "nproc-per-node", "numa-binding", "rdzv-backend",
    "rdzv-conf", "rdzv-endpoint", "rdzv-id", "redirects", "role", "run-path", "shutdown-timeout",
    "signals-to-handle", "standalone", "start-method", "tee", "virtual-local-rank")
    for name in dict.fromkeys((base, base.replace("-", "_"))))


def ambiguous_for_torchrun(word: str) -> list[str]:
    """The torchrun options ``word`` abbreviates when it matches more than one of them (argparse's error), else []."""
    if not word.startswith("--") or word == "--":
        return []
    name = word.split("=", 1)[0]
    if name in TORCHRUN_OPTIONS:
        return []
    matches = [opt for opt in TORCHRUN_OPTIONS if opt.startswith(name)]
    return matches if len(matches) > 1 else []
