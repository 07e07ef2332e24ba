"""scripts/structure.py, the structural lint: each rule finds what it is about in a module written for it."""

from __future__ import annotations

import importlib.util

from helpers import ROOT

spec = importlib.util.spec_from_file_location("structure", ROOT / "scripts" / "structure.py")
assert spec is not None and spec.loader is not None
structure = importlib.util.module_from_spec(spec)
spec.loader.exec_module(structure)

BAD = '''
from typing import Any

def start(t: Any) -> None:
    t._ddp_model = None
    guard = getattr(t, "_folder", None)
    every = t.config.checkpoint_every
    t.config.__dict__.setdefault("_runs", [])
    started = t.job_dir / "started"
    memory = t.config.memory_checkpoint_every_n_steps
'''


def test_each_rule_finds_its_violation(tmp_path, monkeypatch):
    package = tmp_path / "trainstack" / "_train"
    package.mkdir(parents=True)
    (package / "bad.py").write_text(BAD)
    monkeypatch.setattr(structure, "ROOT", tmp_path)
    found = "\n".join(structure.problems(package / "bad.py"))
    for needle in ("private attribute t._ddp_model", "start(t: Any)", "getattr(t, '_folder')",
                   "reads checkpoint_every", "__dict__", "job-folder name 'started'",
                   "reads memory_checkpoint_every_n_steps"):
        assert needle in found, found


def test_the_package_is_clean():
    assert structure.main() == 0
