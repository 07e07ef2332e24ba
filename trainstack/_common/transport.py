"""NCCL's network transport, required instead of hoped for.

Where the InfiniBand verbs library, the HCA or the site's network plugin is missing (a container without the RDMA
user space, a device not bound in, a hook not loaded), NCCL quietly uses TCP sockets and training runs several times
slower with no error. A required transport closes that door twice: ``NCCL_NET`` names the network, so NCCL itself
fails ("Error: network IB not found.") instead of falling back, and a pre-flight check of this host says *why* before
the process group starts (the library that does not load, the port that is down). After NCCL's init its own INFO
lines say which network it chose; `read_init` reads them and `judge` turns them into the reason.

Torch-free: the generated scripts, ``trainstack doctor``, ``why`` and the runtime all use it.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LaunchError
from . import envvars as envvars

__all__ = ["Transport", "TRANSPORTS", "TransportError", "NcclInit", "transport", "missing_libraries", "preflight",
           "step_env", "read_init", "read_init_files", "judge", "match_ifname", "by_network", "own_debug_files",
           "check_before_init", "confirm_after_init", "REQUIRED_ENV"]

#: The variable a generated script sets to the required transport; the runtime checks it before NCCL starts.
REQUIRED_ENV = envvars.NCCL_TRANSPORT


class TransportError(LaunchError):
    """The required NCCL transport is not available here (the message names what is missing and the fix)."""


@dataclass(frozen=True)
class Transport:
    """One of NCCL's networks: the ``NCCL_NET`` name that makes NCCL fail rather than fall back, the libraries it
    (or its plugin) loads, and the verbs provider drivers the device needs."""

    name: str
    nccl_net: str
    libraries: tuple[str, ...]
    providers: tuple[str, ...]
    describe: str
    fix: str
    aliases: tuple[str, ...] = ()  # other names NCCL may report for this network ("Using network X")

    def is_network(self, reported: str) -> bool:
        return reported.lower() in (self.nccl_net.lower(), *(a.lower() for a in self.aliases))


TRANSPORTS: dict[str, Transport] = {
    "ib": Transport("ib", "IB", ("libibverbs.so.1", "libmlx5.so.1"), ("libmlx5-rdmav*.so",),
                    "InfiniBand/RoCE through NCCL's built-in verbs transport",
                    "install libibverbs1 and ibverbs-providers (the trainstack images ship them)"),
    # aws-ofi-nccl answers to "AWS Libfabric" in every release (1.12+ also to "Libfabric" and "OFI")
    "efa": Transport("efa", "AWS Libfabric", ("libfabric.so.1",), ("libefa-rdmav*.so",),
                     "EFA or Slingshot through the aws-ofi-nccl plugin (libfabric)",
                     "the site's aws-ofi-nccl plugin (libnccl-net-ofi.so) and libfabric must be on LD_LIBRARY_PATH: "
                     "load its module, or the container hook that injects it (CSCS: the aws_ofi_nccl EDF hook; "
                     "pyxis/enroot: the site's hook)", aliases=("Libfabric", "OFI")),
    "socket": Transport("socket", "Socket", (), (), "TCP sockets (NCCL's socket transport)",
                        "set NCCL_SOCKET_IFNAME to an interface that is up (trainstack doctor suggests one)"),
}


def transport(name: str) -> Transport:
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise TransportError(f"nccl_transport={name!r} is not a transport: use one of {', '.join(TRANSPORTS)}") \
            from None


def by_network(reported: str) -> Transport | None:
    """The transport NCCL calls ``reported`` ("IB", "Socket", "AWS Libfabric", ...), if it is one of ours."""
    return next((t for t in TRANSPORTS.values() if t.is_network(reported.strip())), None)


def _loads(library: str) -> bool:
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    return True


def _plugin_names(env: Mapping[str, str]) -> list[str]:
    """The files NCCL tries for its network plugin (NCCL_NET_PLUGIN=ofi -> libnccl-net-ofi.so)."""
    name = env.get("NCCL_NET_PLUGIN")
    if not name:
        return ["libnccl-net.so", "libnccl-net-ofi.so"]
    return [name] if name.endswith(".so") or "/" in name else [f"libnccl-net-{name}.so", name]


def _provider_dirs(root: str) -> list[str]:
    return [d for pattern in ("usr/lib/*/libibverbs", "usr/lib64/libibverbs", "usr/lib/libibverbs")
            for d in glob.glob(os.path.join(root, pattern))]


def missing_libraries(name: str, env: Mapping[str, str] | None = None, root: str = "/") -> list[str]:
    """What the transport loads and this process cannot: library names, and provider drivers as ``libibverbs/X``."""
    t, env = transport(name), os.environ if env is None else env
    gone = [lib for lib in t.libraries if not _loads(lib)]
    if name == "efa" and not any(_loads(p) for p in _plugin_names(env)):
        gone.append(" or ".join(_plugin_names(env)))
    dirs = _provider_dirs(root)
    for pattern in t.providers:
        if not any(glob.glob(os.path.join(d, pattern)) for d in dirs):
            gone.append(f"libibverbs/{pattern}")
    return gone


@dataclass(frozen=True)
class Port:
    device: str
    port: str
    state: str  # "4: ACTIVE"
    link_layer: str  # "InfiniBand" or "Ethernet" (RoCE)

    @property
    def active(self) -> bool:
        return "ACTIVE" in self.state

    def __str__(self) -> str:
        return f"{self.device} port {self.port} ({self.link_layer}) {self.state.split(':')[-1].strip()}"


def rdma_ports(root: str = "/") -> list[Port]:
    """Every RDMA device port sysfs shows (``/sys/class/infiniband/DEV/ports/N``)."""
    out = []
    for dev in sorted(Path(root, "sys/class/infiniband").glob("*")):
        for port in sorted((dev / "ports").glob("*")):
            out.append(Port(dev.name, port.name, _read(port / "state"), _read(port / "link_layer")))
    return out


def _read(path: Path) -> str:
    return path.read_text().strip() if path.is_file() else "?"


def _is_efa(device: str, root: str) -> bool:
    driver = Path(root, "sys/class/infiniband", device, "device/driver")
    return device.startswith("efa") or (driver.is_symlink() and os.readlink(driver).endswith("/efa"))


def _interfaces_up(root: str) -> dict[str, str]:
    out = {}
    for nic in sorted(Path(root, "sys/class/net").glob("*")):
        state = nic / "operstate"
        out[nic.name] = state.read_text().strip() if state.is_file() else "unknown"
    return out


def match_ifname(spec: str, names: Iterable[str]) -> list[str]:
    """Interfaces an NCCL_SOCKET_IFNAME value selects: prefixes, ``^`` excludes, ``=`` exact names."""
    names = list(names)
    exclude = spec.startswith("^")
    exact = spec.lstrip("^").startswith("=")
    items = [s for s in spec.lstrip("^").lstrip("=").split(",") if s]
    hit = [n for n in names if any((n == s) if exact else n.startswith(s) for s in items)]
    return [n for n in names if n not in hit] if exclude else hit


def preflight(name: str, env: Mapping[str, str] | None = None, root: str = "/") -> list[str]:
    """Why the transport cannot work on this host, one sentence per problem with its fix ([] when it can)."""
    t, env = transport(name), os.environ if env is None else env
    problems = []
    gone = missing_libraries(name, env, root)
    if gone:
        problems.append(f"{', '.join(gone)} cannot be loaded here, so NCCL has no {t.nccl_net} network. Fix: {t.fix}")
    if name in ("ib", "efa"):
        ports = [p for p in rdma_ports(root) if _is_efa(p.device, root) == (name == "efa")]
        if not ports:
            kind = "EFA" if name == "efa" else "InfiniBand/RoCE"
            problems.append(f"no {kind} device in /sys/class/infiniband on this host: NCCL would find no "
                            f"{t.nccl_net} device. Fix: run on the cluster's GPU nodes (in a container, the runtime "
                            f"must bring /dev/infiniband: apptainer and pyxis do, docker needs --device)")
        elif not any(p.active for p in ports):
            problems.append(f"no RDMA port is up ({'; '.join(map(str, ports))}): the link is down. Fix: the node "
                            "needs an admin (ibstat shows the port); leave it out with --exclude")
    if name == "socket":
        nics = _interfaces_up(root)
        spec = env.get("NCCL_SOCKET_IFNAME")
        chosen = match_ifname(spec, nics) if spec else [n for n in nics if n != "lo"]
        up = [n for n in chosen if nics[n] in ("up", "unknown")]
        if not up:
            what = f"NCCL_SOCKET_IFNAME={spec!r} selects {chosen or 'no interface'}" if spec else "no interface"
            problems.append(f"{what} that is up ({', '.join(f'{n} {s}' for n, s in nics.items()) or 'none'}). "
                            f"Fix: {t.fix}")
    return problems


def step_env(name: str, debug_file: str, nccl_debug: str | None = None) -> dict[str, str]:
    """What a job step exports to require the transport: NCCL_NET (NCCL fails instead of falling back), the name
    for trainstack's pre-flight check, and NCCL's init lines in per-process files (``why`` reads them)."""
    t = transport(name)
    return {"NCCL_NET": t.nccl_net, REQUIRED_ENV: t.name, "NCCL_DEBUG": nccl_debug or "INFO",
            "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": debug_file}


# NCCL's own lines (NCCL_DEBUG=INFO, subsystems INIT,NET), as 2.18-2.29 print them
_USING_NETWORK = re.compile(r"NCCL INFO Using network (?P<net>.+?)\s*$")
_NET_DEVICES = re.compile(r"NCCL INFO (?P<line>NET/(?:IB|Socket|OFI)\s*: Using .+?)\s*$")
_NOT_FOUND = re.compile(r"(?P<line>Error ?: network (?P<net>.+?) not found\.?)\s*$")  # also as torch repeats it
# NCCL 2.28+ with NCCL_NET naming a network it cannot start (seen on an H200 host without IB, NCCL 2.28.9): the
# init fails with ncclInvalidUsage and this line, naming no network -- the one NCCL_NET named is the one missing
_NO_NET_PLUGIN = re.compile(r"(?P<line>Failed to initialize any NET plugin)")
_CAUSES = (  # (pattern, the transports it explains, the cause in words)
    (re.compile(r"Failed to open libibverbs\.so"), ("ib",),
     "libibverbs could not be opened (the RDMA user space is missing: libibverbs1 and ibverbs-providers)"),
    (re.compile(r"NET/IB\s*: No device found"), ("ib",),
     "NCCL found no InfiniBand/RoCE device (none on the host, or not bound into the container: /dev/infiniband)"),
    (re.compile(r"NET/Plugin\s*:.*(?:Could not find|No plugin found|cannot open shared object|returned 2)"), ("efa",),
     "NCCL's network plugin (libnccl-net*.so) was not found: the site's aws-ofi-nccl module or container hook is "
     "not loaded"),
    (re.compile(r"NET/OFI.*(?:No eligible providers|Unable to find a protocol|fi_getinfo|initPlugin failed)"),
     ("efa",), "the aws-ofi-nccl plugin found no usable libfabric provider (efa/cxi)"),
    (re.compile(r"NET/IB.*(?:ibv_open_device|ibv_query_port|Port \d+ is not active|link is down)", re.IGNORECASE),
     ("ib",), "an RDMA device is present but unusable (port down, or no permission on /dev/infiniband)"),
    (re.compile(r"Bootstrap\s*: no socket interface found|NET/Socket\s*: No usable listening interface"),
     ("socket", "ib", "efa"), "no socket interface matches NCCL_SOCKET_IFNAME"),
)


@dataclass
class NcclInit:
    """What NCCL's init lines of one or more processes say about the network."""

    networks: set[str] = field(default_factory=set)  # "IB", "Socket", "AWS Libfabric", ...
    devices: list[str] = field(default_factory=list)  # "NET/IB : Using [0]mlx5_0:1/IB ; OOB ib0:..."
    causes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # why a network was missing -> transports
    _seen: set[str] = field(default_factory=set, repr=False, compare=False)
    not_found: str | None = None  # "Error: network IB not found." (NCCL_NET named a network it does not have)
    not_found_net: str | None = None  # "IB" (None: the line named none -- NCCL_NET's own network is the one missing)

    def add(self, line: str) -> None:
        if m := _USING_NETWORK.search(line):
            self.networks.add(m["net"])
        elif m := _NET_DEVICES.search(line):
            if m["line"] not in self._seen:  # a set beside the ordered list: distinct lines cost linear time
                self._seen.add(m["line"])
                self.devices.append(m["line"])
        elif m := _NOT_FOUND.search(line):
            self.not_found, self.not_found_net = m["line"], m["net"]
        elif (m := _NO_NET_PLUGIN.search(line)) and not self.not_found:
            self.not_found = m["line"]
        for pattern, transports, cause in _CAUSES:
            if pattern.search(line):
                self.causes[cause] = transports

    def causes_for(self, name: str) -> list[str]:
        return [cause for cause, transports in self.causes.items() if name in transports]

    @property
    def seen(self) -> bool:
        return bool(self.networks or self.not_found or self.devices)


def read_init(lines: Iterable[str]) -> NcclInit:
    init = NcclInit()
    for line in lines:
        init.add(line)
    return init


#: How much of an NCCL debug file is read: its init lines come first.
INIT_BYTES = 4 << 20


def read_init_files(paths: Iterable[Path], extra: str = "", owner: int | None = -1) -> NcclInit:
    """NCCL_DEBUG_FILE outputs (``nccl.HOST.PID.log``; the first ``INIT_BYTES`` of each, where NCCL's init lines are,
    read as untrusted data: ``_files.read_back``, files of ``owner``) plus any other text (a job log: torch repeats
    NCCL's last error there)."""
    from .files import read_back_text

    init = read_init(extra.splitlines())
    for path in paths:
        for line in read_back_text(path, INIT_BYTES, owner, head=True).splitlines():
            if "NCCL " in line:
                init.add(line)
    return init


def judge(name: str, init: NcclInit) -> str | None:
    """None when NCCL used the required transport; otherwise the reason, in a sentence that names the fix."""
    t = transport(name)
    causes = init.causes_for(t.name)
    because = f": {'; '.join(causes)}" if causes else ""
    if init.not_found and init.not_found_net and not t.is_network(init.not_found_net):
        return (f"NCCL transport {t.name} was required but NCCL_NET named another network (\"{init.not_found}\"). "
                f"Fix: unset NCCL_NET; trainstack sets it to {t.nccl_net!r} for --nccl-transport {t.name}")
    if init.not_found:
        return (f"NCCL transport {t.name} was required (NCCL_NET={t.nccl_net}) and NCCL has no such network "
                f"(\"{init.not_found}\"){because}. Fix: {t.fix}")
    wrong = {n for n in init.networks if not t.is_network(n)}
    if wrong:
        return (f"NCCL transport {t.name} was required but NCCL used {', '.join(sorted(wrong))}{because} -- a "
                f"silent fallback. Fix: {t.fix}")
    return None


def own_debug_files(env: Mapping[str, str] | None = None, pid: int | None = None) -> list[Path]:
    """This process's NCCL_DEBUG_FILE (NCCL expands %h to the host name up to its first dot, %p to the pid)."""
    env = os.environ if env is None else env
    pattern = env.get("NCCL_DEBUG_FILE")
    if not pattern:
        return []
    import socket

    host = socket.gethostname()
    pid = os.getpid() if pid is None else pid
    names = {pattern.replace("%h", h).replace("%p", str(pid)) for h in (host, host.split(".")[0])}
    return [Path(n) for n in sorted(names) if Path(n).is_file()]


def check_before_init(env: Mapping[str, str] | None = None, root: str = "/") -> str | None:
    """The required transport (``TRAINSTACK_NCCL_TRANSPORT``) checked on this host before NCCL starts: raises
    ``TransportError`` naming what is missing; returns the transport's name (None when none is required)."""
    env = os.environ if env is None else env
    name = env.get(REQUIRED_ENV)
    if not name:
        return None
    problems = preflight(name, env, root)
    if problems:
        raise TransportError(f"NCCL transport {name} is required here ({REQUIRED_ENV}={name}, --nccl-transport) and "
                             f"this host cannot provide it: " + " ".join(problems))
    net = env.get("NCCL_NET")
    if net and not transport(name).is_network(net):
        raise TransportError(f"{REQUIRED_ENV}={name} but NCCL_NET={env['NCCL_NET']!r}: NCCL would use another "
                             f"network. Fix: unset NCCL_NET (trainstack sets it to {transport(name).nccl_net!r})")
    return name


def confirm_after_init(name: str, env: Mapping[str, str] | None = None, error: BaseException | None = None) -> None:
    """After NCCL's init (or its failure, ``error``): its own lines in this process's debug file must show the
    required network; raises ``TransportError`` with the reason otherwise."""
    init = read_init_files(own_debug_files(env), extra=str(error or ""))
    reason = judge(name, init)
    if reason:
        raise TransportError(reason)
