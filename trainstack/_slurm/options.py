"""From command-line options (and a site profile) to one ``LaunchSpec``.

Everything the pure renderer must not do happens here: reading the profile, making paths absolute against the
current folder, and asking the file system whether the program is an executable. Errors name the option (click's
``BadParameter``, exit code 2). Torch-free.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError
from .program import parse_program
from .spec import LaunchSpec, SpecError

__all__ = ["build_spec", "load_profile", "check_profile", "PROFILE_ONLY", "check_submittable"]

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
        raise click.BadParameter(f"cannot read {path}: {exc}", param_hint="'--profile'") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise click.BadParameter("YAML profiles need pyyaml (pip install pyyaml)",
                                     param_hint="'--profile'") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}" if where else ""
            raise click.BadParameter(f"{path} is not valid YAML{at}: {getattr(exc, 'problem', exc)}",
                                     param_hint="'--profile'") from None
    else:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            import tomli as tomllib
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise click.BadParameter(f"{path} is not valid TOML: {exc}", param_hint="'--profile'") from None
    if not isinstance(data, dict) or not isinstance(data.get("trainstack", data), dict):
        raise click.BadParameter(f"{path} must hold a table of option values", param_hint="'--profile'")
    table = dict(data.get("trainstack", {}))  # [trainstack] and [trainstack.*] tables, beside top-level keys
    top = {k: v for k, v in data.items() if k != "trainstack"}
    both = sorted(set(top) & set(table))
    if both:
        raise click.BadParameter(f"{path} sets {', '.join(both)} both at the top level and under [trainstack]: keep "
                                 f"one", param_hint="'--profile'")
    return {str(k).replace("-", "_"): v for k, v in {**top, **table}.items()}


def check_profile(path: str, profile: dict[str, Any]) -> None:
    """Every key of a profile is an option, and the profile-only ones (host, cluster, slurm_conf, scratch, ...) are
    text -- a ``slurm_conf`` a file that exists here: a ``BadParameter`` naming the key and the file otherwise, at
    once (not at a cluster's first ask, as a raw exception)."""
    known = {f.name for f in fields(LaunchSpec)} | set(PROFILE_ONLY)
    for key, value in profile.items():
        if key not in known:
            raise click.BadParameter(f"unknown option {key!r} in {path}; valid keys: {', '.join(sorted(known))}",
                                     param_hint="'--profile'")
        if key in PROFILE_ONLY and value is not None and (not isinstance(value, str) or not value.strip()):
            raise click.BadParameter(f"{key} in {path} must be text, got {value!r}", param_hint="'--profile'")
    conf = profile.get("slurm_conf")
    if conf is not None and not Path(conf).expanduser().is_file():
        raise click.BadParameter(f"slurm_conf in {path} names {conf}, which is not a file here (each Slurm command "
                                 f"would retry it for a minute). HINT: the path of that cluster's slurm.conf on this "
                                 f"machine, or host = ... to reach it over ssh.", param_hint="'--profile'")


def _profile_value(key: str, value: Any, path: str) -> Any:
    """A profile value in the shape of its field: one string for a list field becomes one item."""
    if key in _LISTS and isinstance(value, str):
        return shlex.split(value) if key == "program" else [value]
    if key == "time" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # Slurm reads a bare number as minutes
    if key == "env":
        if not isinstance(value, dict):
            raise click.BadParameter(f"env in {path} must be a table of NAME = value pairs, got {value!r}",
                                     param_hint="'--profile'")
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


def build_spec(ctx: click.Context, params: dict[str, Any], site: dict[str, Any] | None = None,
               cwd: Path | None = None) -> tuple[LaunchSpec, str | None]:
    """The spec and the site templates folder: profile values (read once) for options left at their defaults,
    absolute paths, the program classified; any bad value becomes a usage error naming its option."""
    cwd = cwd or Path.cwd()
    params = dict(params)
    profile_path = params.pop("profile", None)
    templates_dir = params.pop("templates_dir", None)
    profile = site if site is not None and profile_path else load_profile(profile_path) if profile_path else {}
    check_profile(str(profile_path), profile)
    for key, value in profile.items():
        source = ctx.get_parameter_source(key) if key in ctx.params else None
        if key not in PROFILE_ONLY and (source is None or source.name in ("DEFAULT", "DEFAULT_MAP")):
            params[key] = _profile_value(key, value, str(profile_path))
    if templates_dir is None and profile.get("templates_dir") is not None:
        templates_dir = _profile_templates(str(profile_path), profile["templates_dir"])
    retries = [f"--{k.replace('_', '-')}" for k in IMPLY_REQUEUE if k in ctx.params
               and ctx.get_parameter_source(k) is click.core.ParameterSource.COMMANDLINE]
    retries += [f"{k} in {profile_path}" for k in IMPLY_REQUEUE if k in profile
                and f"--{k.replace('_', '-')}" not in retries and not (k == "spare_nodes" and not profile[k])]
    said_no = ("requeue" in ctx.params and ctx.get_parameter_source("requeue") is click.core.ParameterSource.COMMANDLINE
               and not params.get("requeue")) or profile.get("requeue") is False
    if retries and said_no:  # asked for retries and against them: a contradiction, never silently resolved
        raise click.BadParameter(f"{' and '.join(retries)} retry a failed attempt (in the allocation or by "
                                 f"requeueing the job), which --no-requeue forbids. HINT: drop one of them.",
                                 param_hint="'--requeue'")
    if retries and not params.get("requeue"):  # retries happen by requeueing: asking for them asks for it
        click.echo(f"note: {' and '.join(retries)} imply --requeue (a failed attempt is retried in the "
                   f"allocation, or by requeueing the job); --requeue is on", err=True)
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
    except SpecError as exc:
        raise click.BadParameter(exc.message, param_hint=f"'{exc.option}'") from None
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="'PROGRAM'") from None
    return spec, templates_dir


def _profile_templates(profile_path: str, value: Any) -> str:
    """A profile's ``templates_dir``, relative to the profile file."""
    folder = (Path(profile_path).parent / str(value)).resolve()
    if not folder.is_dir():
        raise click.BadParameter(f"templates_dir {value!r} in {profile_path} is not a folder",
                                 param_hint="'--profile'")
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
            raise click.BadParameter(f"{item!r} is not KEY=V1,V2,... (e.g. --sweep lr=1e-3,1e-4)",
                                     param_hint="'--sweep'")
        if key in out:
            raise click.BadParameter(f"{key!r} is given twice; put all its values in one --sweep {key}=V1,V2,...",
                                     param_hint="'--sweep'")
        out[key] = values.split(",")
    return out


def _split_env(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="'--env'")
    key, value = item.split("=", 1)
    return key, value


def check_submittable(spec: LaunchSpec) -> None:
    """What sbatch would accept but the job could never run, refused before anything is queued: a program file that
    does not exist where the job runs it, more nodes (with the spares) than the partition has, GPUs asked of a
    partition that has none."""
    chdir = Path(spec.chdir or ".")
    if spec.launcher != "custom" and spec.program:
        program = spec.parsed_program
        head = program.argv[0]
        path = chdir / Path(head).expanduser()
        needs_file = program.kind == "script" or (program.kind == "exec" and head.startswith(("./", "../", "/", "~")))
        if needs_file and not path.exists():
            raise click.BadParameter(f"{head!r} does not exist in {chdir} (the job runs there and would fail at "
                                     f"once with \"can't open file\"). HINT: check the name, or --chdir the folder "
                                     f"that holds it.", param_hint="'PROGRAM'")
    _check_node_count(spec)
    if not spec.cpu and shutil.which("sinfo"):
        partition = spec.partition or default_partition()
        parts = ["-p", partition] if partition else []
        try:
            out = subprocess.run(["sinfo", "-h", *parts, "-o", "%G"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return
        gres = {g.strip() for g in out.stdout.splitlines() if g.strip()}
        if out.returncode == 0 and gres and all("gpu" not in g for g in gres):
            where = f"partition {spec.partition}" if spec.partition else "this cluster"
            raise click.BadParameter(f"--setup {spec.setup} asks for {spec.procs} GPU(s) per node, but no node of "
                                     f"{where} has GPUs (sinfo's GRES: {', '.join(sorted(gres))}). HINT: add --cpu "
                                     f"to train on CPU processes (gloo), or choose a GPU --partition.",
                                     param_hint="'--cpu'")


def default_partition() -> str | None:
    """The cluster's default partition (sinfo marks it ``*``), where a job without ``--partition`` runs; None when
    sinfo cannot say."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    marked = [name[:-1] for name in out.stdout.split() if name.endswith("*")] if out.returncode == 0 else []
    return marked[0] if marked else None


def _check_node_count(spec: LaunchSpec) -> None:
    """``--nodes`` plus ``--spare-nodes`` against the nodes of the partition (sinfo): a job asking for more would
    wait forever ("PartitionConfig")."""
    if not shutil.which("sinfo"):
        return
    partition = spec.partition or default_partition()
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N", *(["-p", partition] if partition else [])],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return
    have = len(set(out.stdout.split()))
    need = spec.nodes + spec.spare_nodes
    if out.returncode != 0 or not have or need <= have:
        return
    where = f"partition {spec.partition}" if spec.partition else f"the default partition ({partition})" \
        if partition else "this cluster"
    if spec.spare_nodes:
        raise click.BadParameter(f"{spec.spare_nodes}: the job would need {spec.nodes} + {spec.spare_nodes} spare = "
                                 f"{need} nodes, {where} has {have}. HINT: --spare-nodes {max(have - spec.nodes, 0)} "
                                 f"at most, or a larger --partition.", param_hint="'--spare-nodes'")
    raise click.BadParameter(f"{spec.nodes}: {where} has {have} node(s). HINT: fewer --nodes, or a larger "
                             f"--partition.", param_hint="'--nodes'")
