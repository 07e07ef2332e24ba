"""Render Slurm sbatch scripts from ``templates/slurm.sbatch.j2`` -- a pure function of one ``LaunchSpec``.

The spec validates itself (``trainstack._slurm.spec``), so inconsistent requests fail before anything is written
or submitted, naming the option to fix. ``render`` reads the templates and nothing else: paths are used as given
(the CLI makes them absolute), the version comes from the caller. Every user value that reaches the shell goes
through the ``q`` filter (``shlex.quote``). Does not import torch.

The module is callable: ``from trainstack import render`` then ``render(spec)`` works whatever was imported first.
"""

from __future__ import annotations

import re
import shlex
from importlib import resources
from pathlib import Path
from typing import Any

from ._common.modules import make_callable
from ._common.version import __version__
from ._slurm.jobfolder import safe_name
from ._slurm.plan import build_plan
from ._slurm.spec import CONTAINERS, LAUNCHERS, PLACEHOLDERS, SETUPS, LaunchSpec, SpecError

__all__ = ["LaunchSpec", "SpecError", "render", "template_dirs", "safe_name", "SETUPS", "LAUNCHERS", "CONTAINERS",
           "PLACEHOLDERS", "TEMPLATE"]

TEMPLATE = "slurm.sbatch.j2"


def template_dirs(extra: str | Path | None = None) -> list[Path]:
    """Search order: ``--templates-dir``, the templates shipped in the wheel, the repository's ``templates/``."""
    dirs = [Path(extra)] if extra else []
    packaged = resources.files("trainstack") / "templates"
    if packaged.is_dir():
        dirs.append(Path(str(packaged)))
    repo = Path(__file__).resolve().parents[1] / "templates"
    if repo.is_dir():
        dirs.append(repo)
    return dirs


def _quote(value: Any) -> str:
    return shlex.quote(str(value))


def _always_quote(value: Any) -> str:
    """Single-quote even "safe" text (commas inside bash arrays upset shellcheck SC2054)."""
    return "'" + str(value).replace("'", "'\"'\"'") + "'"


def _sbatch_value(value: Any) -> str:
    """Values inside ``#SBATCH`` lines: sbatch splits on whitespace, so quote only when needed."""
    text = str(value)
    return text if re.fullmatch(r"[A-Za-z0-9_.,:@%/=+-]+", text) else '"' + text.replace('"', "'") + '"'


def render(spec: LaunchSpec, templates_dir: str | Path | None = None, command_line: str | None = None,
           version: str = __version__) -> str:
    """The sbatch script for ``spec``: deterministic for the same arguments, no file written, no cwd read."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader([str(d) for d in template_dirs(templates_dir)]),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True,
                             lstrip_blocks=True, autoescape=False)
    env.filters["q"] = _quote
    env.filters["sb"] = _sbatch_value
    env.filters["qq"] = _always_quote
    try:
        template = env.get_template(TEMPLATE)
    except jinja2.TemplateNotFound as exc:
        raise SpecError("--templates-dir",
                        f"template {exc.name!r} not found in {template_dirs(templates_dir)}") from None
    one_line = " ".join((command_line or "").split())  # a newline in a comment would start a command
    driver_python = spec.python if spec.container == "none" else "python3"  # the batch host's, not the image's
    return template.render(**spec.context(), version=version, command_line=one_line, plan=build_plan(spec),
                           driver_python=driver_python)


make_callable(__name__, render)
