"""From command-line options (and a site profile) to one ``LaunchSpec``.

Everything the pure renderer must not do happens here: reading the profile, making paths absolute against the
current folder, and asking the file system whether the program is an executable. Errors are ``SpecError``s naming
the option (the CLI's usage errors, exit code 2); what the partition holds is ``partition.py``'s. Torch-free,
click-free.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .program import parse_program
from .spec import LaunchSpec, SpecError

__all__ = ["build_spec", "load_profile", "check_profile", "PROFILE_ONLY"]

#: LaunchSpec fields that hold lists: a profile may give one string (one item; the program is split like a shell).
_LISTS = ("bind", "setup_cmd", "program")
_PATHS = ("log_dir", "chdir", "venv")
#: Options a profile may set that are not LaunchSpec fields.
PROFILE_ONLY = ("templates_dir", "host", "remote_dir", "cluster", "slurm_conf", "scratch")
#: options that ask for retries, which happen by requeueing: each turns --requeue on (said)
IMPLY_REQUEUE = ("max_retries", "retry_on", "spare_nodes", "min_nodes")


def load_profile(path: str) -> dict[str, Any]:
    """A TOML or YAML table of option values (under ``[trainstack]`` or at the top level), keys as in the CLI."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError("--profile", f"cannot read {path}: {exc}") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise SpecError("--profile", "YAML profiles need pyyaml (pip install pyyaml)") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}" if where else ""
            raise SpecError("--profile", f"{path} is not valid YAML{at}: {getattr(exc, 'problem', exc)}") from None
    else:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            import tomli as tomllib
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise SpecError("--profile", f"{path} is not valid TOML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("trainstack", data), dict):
        raise SpecError("--profile", f"{path} must hold a table of option values")
    table = dict(data.get("trainstack", {}))  # [trainstack] and [trainstack.*] tables, beside top-level keys
    top = {k: v for k, v in data.items() if k != "trainstack"}
    both = sorted(set(top) & set(table))
    if both:
        raise SpecError("--profile", f"{path} sets {', '.join(both)} both at the top level and under "
                                     f"[trainstack]: keep one")
    return {str(k).replace("-", "_"): v for k, v in {**top, **table}.items()}


def check_profile(path: str, profile: dict[str, Any]) -> None:
    """Every key of a profile is an option, and the profile-only ones (host, cluster, slurm_conf, scratch, ...) are
    text -- a ``slurm_conf`` a file that exists here: a ``BadParameter`` naming the key and the file otherwise, at
    once (not at a cluster's first ask, as a raw exception)."""
    known = {f.name for f in fields(LaunchSpec)} | set(PROFILE_ONLY)
    for key, value in profile.items():
        if key not in known:
            raise SpecError("--profile", f"unknown option {key!r} in {path}; valid keys: {', '.join(sorted(known))}")
        if key in PROFILE_ONLY and value is not None and (not isinstance(value, str) or not value.strip()):
            raise SpecError("--profile", f"{key} in {path} must be text, got {value!r}")
    conf = profile.get("slurm_conf")
    if conf is not None and not Path(conf).expanduser().is_file():
        raise SpecError("--profile", f"slurm_conf in {path} names {conf}, which is not a file here (each Slurm "
                                     f"command would retry it for a minute). HINT: the path of that cluster's "
                                     f"slurm.conf on this machine, or host = ... to reach it over ssh.")


def _profile_value(key: str, value: Any, path: str) -> Any:
    """A profile value in the shape of its field: one string for a list field becomes one item."""
    if key in _LISTS and isinstance(value, str):
        return shlex.split(value) if key == "program" else [value]
    if key == "time" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # Slurm reads a bare number as minutes
    if key == "env":
        if not isinstance(value, dict):
            raise SpecError("--profile", f"env in {path} must be a table of NAME = value pairs, got {value!r}")
        return {str(k): str(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(value)
    return value


def _absolute(value: str | None, cwd: Path) -> str | None:
    return None if value is None else str((cwd / Path(value).expanduser()).resolve(strict=False)) \
        if not str(value).startswith("-") else value


def _is_executable(word: str, venv: str | None, cwd: Path) -> bool:
    """Found on PATH (or in the job's venv), or an executable file here."""
    if shutil.which(word) or (venv and (Path(venv) / "bin" / word).exists()):
        return True
    path = cwd / word
    return path.is_file() and os.access(path, os.X_OK)


def build_spec(params: dict[str, Any], given: set[str], site: dict[str, Any] | None = None,
               cwd: Path | None = None, say: Callable[[str], None] = print) -> tuple[LaunchSpec, str | None]:
    """The spec and the site templates folder from the command's ``params`` (``given``: the names the user typed):
    profile values (read once) for options left at their defaults, absolute paths, the program classified; any bad
    value a ``SpecError`` naming its option (the CLI's usage error)."""
    cwd = cwd or Path.cwd()
    params = dict(params)
    profile_path = params.pop("profile", None)
    templates_dir = params.pop("templates_dir", None)
    profile = site if site is not None and profile_path else load_profile(profile_path) if profile_path else {}
    check_profile(str(profile_path), profile)
    for key, value in profile.items():
        if key not in PROFILE_ONLY and key not in given:
            params[key] = _profile_value(key, value, str(profile_path))
    if templates_dir is None and profile.get("templates_dir") is not None:
        templates_dir = _profile_templates(str(profile_path), profile["templates_dir"])
    retries = [f"--{k.replace('_', '-')}" for k in IMPLY_REQUEUE if k in given]
    retries += [f"{k} in {profile_path}" for k in IMPLY_REQUEUE if k in profile
                and f"--{k.replace('_', '-')}" not in retries and not (k == "spare_nodes" and not profile[k])]
    said_no = ("requeue" in given and not params.get("requeue")) or profile.get("requeue") is False
    if retries and said_no:  # asked for retries and against them: a contradiction, never silently resolved
        raise SpecError("--requeue", f"{' and '.join(retries)} retry a failed attempt (in the allocation or by "
                                     f"requeueing the job), which --no-requeue forbids. HINT: drop one of them.")
    if retries and not params.get("requeue"):  # retries happen by requeueing: asking for them asks for it
        say(f"note: {' and '.join(retries)} imply --requeue (a failed attempt is retried in the "
                   f"allocation, or by requeueing the job); --requeue is on")
        params["requeue"] = True
    env = params.pop("env")
    pairs = env.items() if isinstance(env, dict) else [_split_env(item) for item in env]
    params["sweep"] = _parse_sweep(params.get("sweep") or ())
    program = list(params.pop("program"))
    params["chdir"] = params.get("chdir") or str(cwd)
    for key in _PATHS:
        params[key] = _absolute(params.get(key), cwd)
    try:
        if params.get("launcher") != "custom" and program:
            parsed = parse_program(program, params.get("python") or "python3",
                                   lambda w: _is_executable(w, params.get("venv"), cwd))
            program, params["program_kind"] = parsed.words, parsed.kind
        spec = LaunchSpec(env=dict(pairs), program=program, bind=list(params.pop("bind")),
                          setup_cmd=list(params.pop("setup_cmd")), **params)
    except SpecError:
        raise
    except ConfigError as exc:
        raise SpecError("PROGRAM", str(exc)) from None
    return spec, templates_dir


def _profile_templates(profile_path: str, value: Any) -> str:
    """A profile's ``templates_dir``, relative to the profile file."""
    folder = (Path(profile_path).parent / str(value)).resolve()
    if not folder.is_dir():
        raise SpecError("--profile", f"templates_dir {value!r} in {profile_path} is not a folder")
    return str(folder)


def _parse_sweep(items: Any) -> dict[str, list[str]]:
    """``("lr=1e-3,1e-4", "seed=0,1")`` (or a profile's table ``{lr = [...]}``) -> ``{"lr": [...], "seed": [...]}``."""
    if isinstance(items, dict):
        return {str(k): [str(v) for v in (vals if isinstance(vals, (list, tuple)) else [vals])]
                for k, vals in items.items()}
    out: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = str(item).partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpecError("--sweep", f"{item!r} is not KEY=V1,V2,... (e.g. --sweep lr=1e-3,1e-4)")
        if key in out:
            raise SpecError("--sweep", f"{key!r} is given twice; put all its values in one --sweep {key}=V1,V2,...")
        out[key] = values.split(",")
    return out


def _split_env(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise SpecError("--env", f"{item!r} is not KEY=VALUE")
    key, value = item.split("=", 1)
    return key, value
