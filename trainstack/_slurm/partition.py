"""What sbatch would accept but the job could never run, refused before anything is queued: a program file missing
where the job runs it, more nodes (with the spares) than the partition has, GPUs asked of a partition without any
(``sinfo``). Errors are ``SpecError``s naming the option. Torch-free."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .spec import LaunchSpec, SpecError

__all__ = ["check_submittable", "default_partition"]


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
            raise SpecError("PROGRAM", f"{head!r} does not exist in {chdir} (the job runs there and would fail at "
                                       f"once with \"can't open file\"). HINT: check the name, or --chdir the folder "
                                       f"that holds it.")
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
            raise SpecError("--cpu", f"--setup {spec.setup} asks for {spec.procs} GPU(s) per node, but no node of "
                                     f"{where} has GPUs (sinfo's GRES: {', '.join(sorted(gres))}). HINT: add --cpu "
                                     f"to train on CPU processes (gloo), or choose a GPU --partition.")


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
        raise SpecError("--spare-nodes", f"{spec.spare_nodes}: the job would need {spec.nodes} + {spec.spare_nodes} "
                                         f"spare = {need} nodes, {where} has {have}. HINT: --spare-nodes "
                                         f"{max(have - spec.nodes, 0)} at most, or a larger --partition.")
    raise SpecError("--nodes", f"{spec.nodes}: {where} has {have} node(s). HINT: fewer --nodes, or a larger "
                               f"--partition.")
