"""One owner for the environment variables: every TRAINSTACK_* name the package or its job templates use is listed
(with who sets it and what it does) in trainstack._common.envvars, and every listed one is used."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainstack._common import envvars as _envvars

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"TRAINSTACK_[A-Z][A-Z0-9_]*[A-Z0-9]")


def _used() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in [*ROOT.glob("trainstack/**/*.py"), *ROOT.glob("templates/*.j2")]:
        if path.as_posix().endswith("_common/envvars.py"):
            continue
        for name in NAME.findall(path.read_text()):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_variable_used_is_listed_with_its_meaning():
    listed = {v.name for v in _envvars.VARIABLES}
    unlisted = {name: sorted(where) for name, where in _used().items() if name not in listed}
    assert not unlisted, f"add these to trainstack/_common/envvars.py: {unlisted}"
    assert all(v.meaning and v.set_by for v in _envvars.VARIABLES)


def test_every_listed_variable_is_used_and_read_through_its_constant():
    used = _used()
    assert not [v.name for v in _envvars.VARIABLES if v.name not in used and v.name not in
                {getattr(_envvars, k) for k in _envvars.__all__ if k.isupper()}]
    for path in ROOT.glob("trainstack/**/*.py"):  # code never spells a name as a bare string: it uses the constant
        assert not re.search(r"[\"']TRAINSTACK_[A-Z_]+[\"']", path.read_text()) or \
            path.as_posix().endswith("_common/envvars.py"), path


def test_number_variables_are_read_in_one_place_with_the_bad_value_named(monkeypatch):
    from trainstack._common.envvars import positive_number

    monkeypatch.delenv("TRAINSTACK_TIMEOUT_S", raising=False)
    assert positive_number("TRAINSTACK_TIMEOUT_S", 1800.0) == 1800.0 and positive_number("TRAINSTACK_TIMEOUT_S") is None
    monkeypatch.setenv("TRAINSTACK_TIMEOUT_S", "0")
    assert positive_number("TRAINSTACK_TIMEOUT_S", allow_zero=True) == 0.0
    for bad in ("0", "-1", "ten", "nan"):
        monkeypatch.setenv("TRAINSTACK_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match=f"TRAINSTACK_TIMEOUT_S='{bad}' must be a positive number"):
            positive_number("TRAINSTACK_TIMEOUT_S", 1800.0)
