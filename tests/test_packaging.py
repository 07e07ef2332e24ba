"""The wheel ships the templates, and rendering works from the installed package (never from the cwd)."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
from helpers import ROOT

pytestmark = pytest.mark.timeout(300)


def test_wheel_contains_templates_and_renders_from_them(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, timeout=240, capture_output=True)
    wheel = next(tmp_path.glob("trainstack-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "trainstack/templates/slurm.sbatch.j2" in names
    assert "trainstack/templates/_macros.j2" in names and "trainstack/py.typed" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); os.chdir('/'); import trainstack.render as r; "
            "assert r.template_dirs()[0].parent == r.Path(sys.argv[1]) / 'trainstack', r.template_dirs(); "
            "print(r.render(r.LaunchSpec(program=['t.py']))[:11])")
    out = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("#!/bin/bash"), out.stderr
