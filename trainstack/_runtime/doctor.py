"""`trainstack doctor` / `trainstack env`: what runs here, and what will break distributed training.

Every probe reads an explicit ``Facts`` record, so tests drive each problem with controlled inputs;
``gather_facts`` fills it from this machine (``/proc``, ``/sys``, ``ldconfig``, torch).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._common import envvars as envvars
from .._common.transport import REQUIRED_ENV, match_ifname, preflight

__all__ = ["Facts", "Finding", "gather_facts", "diagnose", "run_doctor"]

_ENV_PREFIXES = ("NCCL_", "TORCH_", "GLOO_", "MASTER_", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "SLURM_JOB_ID",
                 "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                 "TORCHELASTIC_RUN_ID", "APPTAINER_", "SINGULARITY_", "PYXIS_", "ENROOT_")
_VIRTUAL = ("lo", "docker", "veth", "virbr", "br-", "cni", "flannel", "cali", "tun", "tap", "vxlan", "kube")


@dataclass
class Facts:
    """Everything the checks look at (all plain data)."""

    environ: dict[str, str]
    python: str = ""
    torch: str | None = None
    cuda: str | None = None
    nccl: str | None = None
    cudnn: int | None = None
    nccl_available: bool = False
    gpus: list[str] = field(default_factory=list)
    interfaces: dict[str, list[str]] = field(default_factory=dict)  # name -> IPv4 addresses (up only)
    ib_devices: list[str] = field(default_factory=list)
    verbs_libs: dict[str, bool] = field(default_factory=dict)
    tools: dict[str, str | None] = field(default_factory=dict)
    ancestors: list[str] = field(default_factory=list)
    in_container: str | None = None
    transport: str | None = None  # the NCCL transport required (--nccl-transport / TRAINSTACK_NCCL_TRANSPORT)
    transport_problems: list[str] = field(default_factory=list)  # why this host cannot provide it


@dataclass
class Finding:
    level: str  # "problem" (exit 1) or "note"
    message: str


def _torch_facts(f: Facts) -> None:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return
    f.torch, f.cuda = torch.__version__, torch.version.cuda
    f.nccl_available = dist.is_available() and dist.is_nccl_available()
    if f.nccl_available:
        try:
            f.nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # pragma: no cover - depends on the CUDA build
            f.nccl = "unknown"
    if torch.cuda.is_available():
        f.gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        f.cudnn = torch.backends.cudnn.version()


def _interfaces() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {name: [] for _, name in socket.if_nameindex()}
    ip = shutil.which("ip")
    if ip:
        res = subprocess.run([ip, "-o", "-4", "addr", "show", "up"], capture_output=True, text=True, timeout=10)
        for line in res.stdout.splitlines():
            parts = line.split()
            if len(parts) > 3 and parts[2] == "inet":
                out.setdefault(parts[1].split("@")[0], []).append(parts[3].split("/")[0])
    return out


def _verbs_libs() -> dict[str, bool]:
    libs = {"libibverbs.so.1": False, "librdmacm.so.1": False}
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        cache = ""
    for lib in libs:
        libs[lib] = lib in cache
    return libs


def _ancestors() -> list[str]:
    names, pid = [], os.getppid()
    for _ in range(32):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        names.append(stat[stat.index("(") + 1: stat.rindex(")")])
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            break
    return names


def _container(environ: Mapping[str, str]) -> str | None:
    if environ.get("APPTAINER_CONTAINER") or environ.get("SINGULARITY_CONTAINER"):
        return "apptainer"
    if environ.get("PYXIS_RUNTIME_PATH") or environ.get("ENROOT_ROOTFS"):
        return "pyxis/enroot"
    if Path("/.dockerenv").exists():
        return "docker"
    return None


def gather_facts(environ: Mapping[str, str] | None = None, nccl_transport: str | None = None) -> Facts:
    env = dict(os.environ if environ is None else environ)
    f = Facts(environ=env, python=platform.python_version())
    f.transport = nccl_transport or env.get(REQUIRED_ENV) or None
    if f.transport:
        f.transport_problems = preflight(f.transport, env)
    _torch_facts(f)
    f.interfaces = _interfaces()
    ib = Path("/sys/class/infiniband")
    f.ib_devices = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    f.verbs_libs = _verbs_libs()
    f.tools = {t: shutil.which(t) for t in ("scontrol", "sbatch", "srun", "nvidia-smi", "apptainer")}
    f.ancestors = _ancestors()
    f.in_container = _container(env)
    return f


def suggest_ifname(interfaces: dict[str, list[str]]) -> str | None:
    real = [n for n, addrs in interfaces.items() if addrs and not n.startswith(_VIRTUAL)]
    return real[0] if real else None


def diagnose(f: Facts, compute_setup: str = "auto") -> list[Finding]:
    """Problems (with their fix) and notes for the facts of one machine/job."""
    out: list[Finding] = []
    env = f.environ
    launcher_error = _launcher_error(env)
    if launcher_error:
        out.append(Finding("problem", f"the launcher variables cannot be used: {launcher_error}. Fix: correct or unset "
                                      f"them (trainstack would refuse to start here)"))
    if f.torch is None:
        out.append(Finding("problem", "torch is not installed in this Python. Fix: pip install torch==<pinned>"))
    if compute_setup == "gpu" and not f.gpus:
        out.append(Finding("problem", "compute_setup='gpu' but no CUDA device is visible. Fix: run on a GPU node, "
                                      "request GPUs (--gpus-per-node), add --nv to apptainer, or use "
                                      "compute_setup='cpu'"))
    names = list(f.interfaces)
    spec = env.get("NCCL_SOCKET_IFNAME")
    if spec and not match_ifname(spec, names):
        out.append(Finding("problem", f"NCCL_SOCKET_IFNAME={spec!r} matches none of this host's interfaces "
                                      f"({', '.join(names)}). Fix: unset it or use e.g. "
                                      f"NCCL_SOCKET_IFNAME={suggest_ifname(f.interfaces) or '<interface>'}"))
    gloo = env.get("GLOO_SOCKET_IFNAME")
    if gloo and gloo not in names:
        out.append(Finding("problem", f"GLOO_SOCKET_IFNAME={gloo!r} is not an interface here ({', '.join(names)})."))
    for problem in f.transport_problems:
        out.append(Finding("problem", f"NCCL transport {f.transport} is required: {problem}"))
    if f.ib_devices and not all(f.verbs_libs.values()):
        missing = [lib for lib, ok in f.verbs_libs.items() if not ok]
        out.append(Finding("problem", f"InfiniBand devices {f.ib_devices} are present but {missing} are missing: NCCL "
                                      "will silently fall back to TCP sockets. Fix: install libibverbs1 "
                                      "ibverbs-providers librdmacm1 (the trainstack images ship them)"))
    in_stepd = "slurmstepd" in f.ancestors
    if in_stepd and "SLURM_JOB_ID" not in env:
        out.append(Finding("problem", "running under slurmstepd but every SLURM_* variable is missing: the container "
                                      "was started with --cleanenv/--containall (or env -i), so every process will "
                                      "think it is rank 0. Fix: drop --cleanenv/--containall, or pass the variables "
                                      "with APPTAINERENV_*/--env"))
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" not in env:
        out.append(Finding("problem", "inside a Slurm step but SLURM_PROCID is missing: the rank cannot be determined. "
                                      "Fix: keep the Slurm environment when entering the container"))
    if f.gpus and "SLURM_JOB_ID" in env and (env.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or "0") == "0":
        out.append(Finding("note", "the NCCL flight recorder is off: a collective that times out leaves no record of "
                                   "which rank was behind. trainstack's generated scripts turn it on "
                                   "(TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1)"))
    if "SLURM_JOB_ID" in env and not f.tools.get("scontrol"):
        out.append(Finding("note", "scontrol is not available here: requeue from inside this environment would fail; "
                                   "trainstack scripts requeue from the batch shell instead"))
    if f.gpus and not f.nccl_available:
        out.append(Finding("problem", "GPUs are visible but this torch build has no NCCL. Fix: install a CUDA build "
                                      "of torch (the trainstack image pins one)"))
    return out


def _launcher_error(environ: Mapping[str, str]) -> str | None:
    from ..environment import detect_environment
    from ..errors import LaunchError

    try:
        detect_environment(environ)
    except LaunchError as exc:
        return str(exc)
    return None


def hang_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """How long a stuck collective or a stuck rank can last here, and what is recorded when it happens."""
    timeout = environ.get(envvars.TIMEOUT_S) or "1800"
    recorder = environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or "0"
    return {
        "collective timeout": f"{timeout} s (TRAINSTACK_TIMEOUT_S; the process group's timeout for NCCL and gloo)",
        "hang watchdog": ("off (TRAINSTACK_HANG_TIMEOUT=0)" if environ.get(envvars.HANG_TIMEOUT) == "0" else
                          f"{environ.get(envvars.HANG_TIMEOUT) or '600'} s without progress on every rank "
                          f"(TRAINSTACK_HANG_TIMEOUT or TrainConfig.hang_timeout)"),
        "NCCL flight recorder": (f"on, last {recorder} collectives per rank, dumped on timeout: "
                                 f"{environ.get('TORCH_NCCL_DUMP_ON_TIMEOUT', '0')} to "
                                 f"{environ.get('TORCH_NCCL_DEBUG_INFO_TEMP_FILE', '/tmp/nccl_trace_rank_')}<rank>"
                                 if recorder != "0" else "off (TORCH_NCCL_TRACE_BUFFER_SIZE unset or 0)"),
        "NCCL heartbeat monitor": f"{environ.get('TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC', '480')} s "
                                  f"(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC)",
    }


def _report(f: Facts) -> dict[str, Any]:
    from ..environment import detect_environment

    error = _launcher_error(f.environ)
    launcher = f"error: {error}" if error else detect_environment(f.environ).describe()
    env = {k: v for k, v in sorted(f.environ.items()) if k.startswith(_ENV_PREFIXES)}
    from .._common.version import __version__

    return {"trainstack": __version__, "python": f.python, "platform": platform.platform(), "torch": f.torch,
            "cuda": f.cuda, "cudnn": f.cudnn, "nccl": f.nccl, "nccl_available": f.nccl_available, "gpus": f.gpus,
            "launcher": launcher, "container": f.in_container, "infiniband": f.ib_devices, "verbs_libs": f.verbs_libs,
            "nccl_transport": (f"{f.transport}: " + ("ok" if not f.transport_problems else "MISSING")
                               if f.transport else "not required (--nccl-transport ib|efa|socket)"),
            "interfaces": f.interfaces, "suggested_NCCL_SOCKET_IFNAME": suggest_ifname(f.interfaces),
            "tools": f.tools, "hangs": hang_settings(f.environ), "environment": env}


def run_doctor(as_json: bool = False, report_only: bool = False, compute_setup: str = "auto",
               facts: Facts | None = None, nccl_transport: str | None = None) -> int:
    """Print the report (and the findings); return 1 when there is a problem (0 with ``report_only``)."""
    f = facts or gather_facts(nccl_transport=nccl_transport)
    report = _report(f)
    findings = [] if report_only else diagnose(f, compute_setup)
    if as_json:
        print(json.dumps({**report, "findings": [asdict(x) for x in findings]}, indent=2, default=str))
    else:
        width = max(len(k) for k in report)
        for key, value in report.items():
            if key == "hangs":  # sentences: one per line
                print(f"{key:<{width}}")
                for k, v in value.items():
                    print(f"  {k}: {v}")
                continue
            if isinstance(value, dict):
                value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
            elif isinstance(value, list):
                value = ", ".join(map(str, value)) or "-"
            print(f"{key:<{width}}  {value}")
        if not report_only:
            print()
            for x in findings:
                print(f"{'PROBLEM' if x.level == 'problem' else 'note   '}  {x.message}")
            problems = sum(x.level == "problem" for x in findings)
            print("no problems found" if not problems else f"{problems} problem(s) found", file=sys.stderr)
    return 1 if any(x.level == "problem" for x in findings) else 0
