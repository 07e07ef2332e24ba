"""The package's import graph, lazy (in-function) imports included, checked by `make lint`:

* no cycle between modules (``--fail-on-cycle``);
* the torch-free rooms stay torch-free by construction: nothing reachable from ``trainstack.cli``'s module-level
  imports, ``trainstack.render``, ``trainstack.submit`` or ``trainstack._slurm`` imports torch (``--torch-free``),
  even lazily, except the edges named in ``LAZY_ON_PURPOSE``.

import-linter (`lint-imports`, contracts in `.importlinter`) checks the layers and rooms; this script adds what it
does not: cycles through lazy imports, and the torch-free closure. Imports under ``if TYPE_CHECKING:`` are for the
type checker only (never executed): they are no edge here, so a seam can name the type it takes.

    python scripts/importgraph.py [--fail-on-cycle] [--torch-free] [--print]
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "trainstack"
TORCH_FREE = ("trainstack.cli", "trainstack.render", "trainstack.submit", "trainstack._slurm")
#: Lazy imports that leave the torch-free rooms on purpose: commands that inspect checkpoints or the machine.
LAZY_ON_PURPOSE = {("trainstack.cli.checkpoints", "trainstack.checkpoint"),
                   ("trainstack.cli.doctor", "trainstack._runtime.doctor")}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules it imports (trainstack modules, plus the top-level name of external packages)."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        out: set[str] = set()
        typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                       for stmt in block.body for n in ast.walk(stmt)}  # type: ignore[attr-defined]
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node)
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                out.add(_owner(target, modules))
        out.discard(name)
        out.discard("")
        if name != "trainstack":
            out.discard("trainstack")  # every submodule runs the package's __init__ first: not a design edge
        edges[name] = out
    return edges


def _is_type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _owner(target: str, modules: dict[str, Path]) -> str:
    """The module a dotted name lives in (``trainstack.render.render`` -> ``trainstack.render``)."""
    if not target.startswith("trainstack"):
        return target.split(".")[0]
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Elementary cycles found by a depth-first search (one per strongly connected tangle is enough to fail)."""
    found, state = [], {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in edges:
                continue
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found


def torch_paths(edges: dict[str, set[str]]) -> list[list[str]]:
    """Import chains from a torch-free room to torch (breadth first: the shortest chain per start)."""
    bad = []
    for start in sorted(m for m in edges if m.startswith(TORCH_FREE)):
        seen, queue = {start: [start]}, [start]
        while queue:
            node = queue.pop(0)
            for nxt in sorted(edges.get(node, ())):
                if (node, nxt) in LAZY_ON_PURPOSE or nxt in seen:
                    continue
                seen[nxt] = seen[node] + [nxt]
                if nxt == "torch":
                    bad.append(seen[nxt])
                    queue = []
                    break
                if nxt in edges:
                    queue.append(nxt)
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fail-on-cycle", action="store_true")
    parser.add_argument("--torch-free", action="store_true")
    parser.add_argument("--print", action="store_true", help="print every module's imports")
    args = parser.parse_args(argv)
    modules = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    edges = graph(modules)
    status = 0
    if args.print:
        for name in sorted(edges):
            print(f"{name}: {', '.join(sorted(e for e in edges[name] if e.startswith('trainstack')))}")
    if args.fail_on_cycle:
        for cycle in cycles(edges):
            print("import cycle: " + " -> ".join(cycle))
            status = 1
    if args.torch_free:
        for chain in torch_paths(edges):
            print("torch reached from a torch-free room: " + " -> ".join(chain))
            status = 1
    if status == 0:
        print(f"importgraph: {len(edges)} modules, no cycle" + (", torch-free rooms clean" if args.torch_free else ""))
    return status


if __name__ == "__main__":
    sys.exit(main())
