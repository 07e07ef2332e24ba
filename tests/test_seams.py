"""The scheduler seam (issue 65): Slurm's commands are spelled in the Slurm room only (plus the ``slurm.py`` shim and
``doctor``), and the command line reaches them through the neutral room's ``backend()`` -- it imports at most two
modules that run one. Read from the source, so a new call in the wrong place fails here."""

from __future__ import annotations

import ast
import re

from helpers import ROOT

from trainstack._launch.backend import BACKENDS, Backend, backend

PACKAGE = ROOT / "trainstack"
#: A Slurm command as the first word of an argv list: ["sinfo", ...], [sinfo or "sinfo", ...]
RUNS_SLURM = re.compile(r'\[\s*(?:\w+\s+or\s+)?"(sbatch|srun|scontrol|squeue|sacct|scancel|sinfo|sstat)"')
ALLOWED_OUTSIDE = {"slurm.py", "_runtime/doctor.py"}


def _runs_slurm(path) -> bool:
    return bool(RUNS_SLURM.search(path.read_text()))


def test_slurm_commands_are_spelled_in_the_slurm_room_only():
    spelled = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if _runs_slurm(p))
    outside = [p for p in spelled if not p.startswith("_slurm/") and p not in ALLOWED_OUTSIDE]
    assert outside == [], outside
    assert "_slurm/slurmcmd.py" in spelled and "_slurm/submission.py" in spelled  # the check finds what it is about


def _imported(path) -> set[str]:
    """The trainstack modules a CLI module imports (lazy imports too), as files under trainstack/."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            here = path.parent.relative_to(PACKAGE).parts
            base = here[: len(here) - node.level + 1]
            parts = [*base, *(node.module or "").split(".")] if node.module else list(base)
            names = [parts] if node.module else [[*parts, a.name] for a in node.names]
            for name in names:
                for candidate in (PACKAGE.joinpath(*name).with_suffix(".py"), PACKAGE.joinpath(*name, "__init__.py")):
                    if candidate.is_file():
                        found.add(str(candidate.relative_to(PACKAGE)))
    return found


def test_the_command_line_reaches_slurm_through_the_backend():
    imported = set().union(*(_imported(p) for p in (PACKAGE / "cli").glob("*.py")))
    running = sorted(m for m in imported if _runs_slurm(PACKAGE / m))
    assert len(running) <= 2, running
    assert "_launch/backend.py" in imported


def test_the_slurm_backend_answers_every_verb_of_the_protocol():
    verbs = {n for n in vars(Backend) if not n.startswith("_") and callable(getattr(Backend, n))}
    made = backend("slurm")
    assert made.name == "slurm" and verbs <= {n for n in dir(made) if callable(getattr(made, n))}, verbs
    assert set(BACKENDS) == {"slurm"}
    try:
        backend("kubernetes")
    except ValueError as exc:
        assert "no backend for scheduler 'kubernetes'; known: slurm" in str(exc)
    else:
        raise AssertionError("an unknown scheduler was accepted")
