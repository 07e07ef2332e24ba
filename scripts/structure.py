"""Structural checks of the package, run by `make lint` (they replace a line target as the design rule):

* no module writes another object's private attribute (``x._name = ...`` where ``x`` is not ``self``/``cls``),
  except the few torch/Python interop lines in ``INTEROP``;
* no ``t: Any`` / ``trainer: Any`` parameter under ``trainstack/_train`` (the seam is typed: ``Trainer`` through a
  ``TYPE_CHECKING`` import), and no ``getattr(trainer, "_...")`` guard anywhere;
* the run's cadence settings (``checkpoint_every[_n_steps]``, ``val_every[_n_steps]``, ``checkpoint_best_only``)
  are read only by ``TrainConfig`` (which validates them), the ``Schedule`` (which decides) and ``fast_dev_run``
  (which replaces them);
* nothing hides per-run state in a user's object (``__dict__.setdefault``);
* no module but ``trainstack/_common/jobfiles/`` joins a job-folder file name to a path (``folder / "started"``):
  the job folder's contents have one owner, ``JobFiles``.

    python scripts/structure.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trainstack"
#: (file, attribute) of the writes to another object's private attribute that interoperate with torch or Python
INTEROP = {("trainstack/_runtime/spawn.py", "_forkserver_alive_fd"),  # multiprocessing's fork server
           ("trainstack/_runtime/compiling.py", "_compiled_call_impl"),  # torch.compile's in-place module
           ("trainstack/_train/steps.py", "_opt_called"),  # the mark a torch LR scheduler reads
           ("trainstack/_train/steps.py", "_wrapped_by_lr_sched")}
CADENCE = {"checkpoint_every", "checkpoint_every_n_steps", "val_every", "val_every_n_steps", "checkpoint_best_only",
           "memory_checkpoint_every_n_steps"}
CADENCE_READERS = {"trainstack/config.py", "trainstack/_train/schedule.py", "trainstack/_train/devrun.py"}


JOB_FILES = "trainstack/_common/jobfiles/names.py"
JOB_FILES_ROOM = "trainstack/_common/jobfiles/"


def _job_file_names() -> set[str]:
    """The names ``JobFiles`` owns (its upper-case string constants)."""
    tree = ast.parse((ROOT / JOB_FILES).read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Names")
    return {n.value.value for n in cls.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str) and all(isinstance(t, ast.Name) and t.id.isupper() for t in n.targets)}


NAMES = _job_file_names()


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    return [e for t in found for e in (t.elts if isinstance(t, ast.Tuple) else [t])]


def problems(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    out = []
    for node in ast.walk(tree):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and target.attr.startswith("_") and not target.attr.startswith("__")\
                    and not (isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")) \
                    and (rel, target.attr) not in INTEROP:
                out.append(f"{rel}:{node.lineno}: writes another object's private attribute {ast.unparse(target)}")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and rel.startswith("trainstack/_train/"):
            for arg in node.args.args + node.args.kwonlyargs:
                if arg.arg in ("t", "trainer") and arg.annotation is not None and \
                        ast.unparse(arg.annotation) == "Any":
                    out.append(f"{rel}:{node.lineno}: {node.name}({arg.arg}: Any): type the seam (Trainer)")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) \
                and node.args[0].id in ("t", "trainer") and isinstance(node.args[1], ast.Constant) \
                and str(node.args[1].value).startswith("_"):
            out.append(f"{rel}:{node.lineno}: getattr({node.args[0].id}, {node.args[1].value!r}) guards a private "
                       f"attribute: give it an owner")
        if isinstance(node, ast.Attribute) and node.attr in CADENCE and rel not in CADENCE_READERS \
                and isinstance(node.ctx, ast.Load):
            out.append(f"{rel}:{node.lineno}: reads {node.attr}: the Schedule decides the cadence")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                and node.right.value in NAMES and not rel.startswith(JOB_FILES_ROOM):
            out.append(f"{rel}:{node.lineno}: joins the job-folder name {node.right.value!r} to a path: ask JobFiles")
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant) and \
                str(node.values[0].value).startswith(("rank-", "node-")) and not rel.startswith(JOB_FILES_ROOM):
            out.append(f"{rel}:{node.lineno}: spells a per-rank or per-node name: jobfiles.rank_log and the like")
        if isinstance(node, ast.Attribute) and node.attr == "setdefault" and \
                isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__":
            out.append(f"{rel}:{node.lineno}: stores state in another object's __dict__")
    return out


def main() -> int:
    found = [p for path in sorted(PACKAGE.rglob("*.py")) for p in problems(path)]
    for line in found:
        print(line)
    print(f"structure: {len(found)} problem(s)" if found else "structure: clean")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
