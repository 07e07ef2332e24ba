"""Every code block of the README and the docs site is checked, so the docs cannot rot: Python blocks compile,
blocks marked ``<!-- run -->`` run (on CPU, small sizes), every ``trainstack generate`` command in a shell block
renders a script that shellcheck accepts; the site builds strictly (make docs)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ci_leaves_out

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_BLOCK = re.compile(r"(?P<mark><!-- run -->\n)?```(?P<lang>\w+)[^\n]*\n(?P<code>.*?)\n```", re.DOTALL)


def _blocks(lang: str) -> list[tuple[str, str, bool]]:
    out = []
    for page in PAGES:
        for m in _BLOCK.finditer(page.read_text(encoding="utf-8")):
            if m.group("lang") == lang:
                out.append((f"{page.relative_to(ROOT)}:{m.start()}", m.group("code"), bool(m.group("mark"))))
    return out


PYTHON = _blocks("python")
GENERATE = [(where, line) for where, code, _ in _blocks("bash") for line in code.replace("\\\n", " ").splitlines()
            if line.startswith("trainstack generate")]


@pytest.mark.parametrize(("where", "code", "run"), PYTHON, ids=[w for w, _, _ in PYTHON])
def test_python_blocks_compile(where, code, run):
    compile(code, where, "exec")


# pages whose runnable blocks repeat what a test of their own runs (CI's 40 minutes; make test runs them all)
REPEATED = {"docs/how-to/fsdp.md": "FSDP trains in tests/distributed/test_fsdp.py",
            "docs/migration/lightning.md": "the Lightning port trains in tests/distributed/test_examples.py"}
RUN = [pytest.param(w, c, id=w, marks=[ci_leaves_out(REPEATED[w.split(":")[0]])] if w.split(":")[0] in REPEATED else [])
       for w, c, run in PYTHON if run]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("where", "code"), RUN)
def test_blocks_marked_run_run(where, code, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, f"{where}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"


@pytest.mark.parametrize(("where", "line"), GENERATE, ids=[w for w, _ in GENERATE])
def test_generate_commands_render_scripts_shellcheck_accepts(where, line, tmp_path):
    words = shlex.split(line.split(" #", 1)[0])[2:]
    if "--profile" in words:  # the page's example profile: an empty one (flags override it anyway)
        (tmp_path / words[words.index("--profile") + 1]).write_text("")
    result = subprocess.run([sys.executable, "-m", "trainstack", "generate", *words], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{where}: {line}\n{result.stderr}"
    if shutil.which("shellcheck"):
        check = subprocess.run(["shellcheck", "-s", "bash", "-"], input=result.stdout, capture_output=True,
                               text=True, timeout=60)
        assert check.returncode == 0, f"{where}: {line}\n{check.stdout}"


def test_there_are_snippets_to_check():
    assert len(PYTHON) >= 6 and len(RUN) >= 2 and len(GENERATE) >= 4, (len(PYTHON), len(RUN), len(GENERATE))


@pytest.mark.timeout(300)
def test_the_site_builds_strictly():
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]'); CI builds it with make docs")
    result = subprocess.run([str(mkdocs), "build", "--strict", "--quiet", "--site-dir", "/tmp/trainstack-site-test"],
                            cwd=ROOT, capture_output=True, text=True, timeout=280,
                            env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]


def test_docstrings_hold_no_sphinx_roles_the_site_would_show_raw():
    """The API page renders docstrings as Markdown: a :class:`x` role would show as written."""
    role = re.compile(r":(?:class|meth|func|attr|mod|data|exc|obj):`")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "trainstack").rglob("*.py"))
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if role.search(line)]
    assert not found, found
