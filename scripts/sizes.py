"""Size budget of the package, checked by `make lint`: no class over --max-class lines, no function over
--max-function lines (docstrings included, decorators not), no module over --max-module lines.

    python scripts/sizes.py [--max-class 400] [--max-function 60] [--max-module 700] [--warn-class 360]
                            [--warn-module 630] [PATH ...]

The warnings (not failures) print the headroom of the classes and modules near their ceiling: a feature that lands
in one splits it by responsibility first.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def _span(node: ast.AST) -> int:
    return (getattr(node, "end_lineno", 0) or 0) - node.lineno + 1  # type: ignore[attr-defined]


def violations(path: Path, max_class: int, max_function: int, max_module: int) -> list[str]:
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, filename=str(path))
    out = []
    lines = len(text.splitlines())
    if lines > max_module:
        out.append(f"{path}: module of {lines} lines (max {max_module})")
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and _span(node) > max_class:
            out.append(f"{path}:{node.lineno}: class {node.name} has {_span(node)} lines (max {max_class})")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _span(node) > max_function:
            out.append(f"{path}:{node.lineno}: function {node.name} has {_span(node)} lines (max {max_function})")
    return out


def headroom(path: Path, warn_class: int, warn_module: int, max_class: int, max_module: int) -> list[str]:
    """The classes and the module of ``path`` past their warning line, each with the lines left to its ceiling."""
    text = path.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    out = [f"{path}: module of {lines} lines ({max_module - lines} left)"] if warn_module <= lines <= max_module else []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.ClassDef) and warn_class <= _span(node) <= max_class:
            out.append(f"{path}:{node.lineno}: class {node.name} of {_span(node)} lines ({max_class - _span(node)} "
                       f"left)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", default=["trainstack"])
    parser.add_argument("--max-class", type=int, default=400)
    parser.add_argument("--max-function", type=int, default=60)
    parser.add_argument("--max-module", type=int, default=700)
    parser.add_argument("--warn-class", type=int, default=None, help="print classes at or past this many lines")
    parser.add_argument("--warn-module", type=int, default=None, help="print modules at or past this many lines")
    args = parser.parse_args(argv)
    found: list[str] = []
    near: list[str] = []
    for root in map(Path, args.paths):
        for path in sorted(root.rglob("*.py") if root.is_dir() else [root]):
            found += violations(path, args.max_class, args.max_function, args.max_module)
            if args.warn_class is not None or args.warn_module is not None:
                near += headroom(path, args.warn_class or args.max_class + 1, args.warn_module or args.max_module + 1,
                                 args.max_class, args.max_module)
    for line in near:
        print(f"sizes: near the ceiling: {line}")
    for line in found:
        print(line)
    if found:
        print(f"sizes: {len(found)} over budget (split by responsibility; see docs/contributing/layout.md)",
              file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
