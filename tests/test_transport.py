"""A required NCCL transport (issue 53): NCCL's init lines of each outcome (recorded in tests/data/nccl-init) read and
judged, the pre-flight check of a host against real sysfs-shaped folders and this machine's own libraries, the
generated scripts, the runtime's checks before and after NCCL's init, and the verdict that names the cause."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trainstack._common import transport as tr
from trainstack._runtime.carried import carried_header, worker_error
from trainstack._slurm.verdict import verdict
from trainstack.render import LaunchSpec, SpecError, render

DATA = Path(__file__).parent / "data" / "nccl-init"


def _init(name: str) -> tr.NcclInit:
    return tr.read_init((DATA / name).read_text().splitlines())


@pytest.mark.parametrize("log, ok", [("ib-ok.log", "ib"), ("efa-ok.log", "efa"), ("socket-ok.log", "socket"),
                                     ("socket-fallback-no-verbs.log", "socket")])
def test_the_network_nccl_chose_is_the_one_required_or_the_reason_says_what_it_used(log, ok):
    init = _init(log)
    assert tr.judge(ok, init) is None
    for other in set(tr.TRANSPORTS) - {ok}:
        reason = tr.judge(other, init)
        assert reason and f"transport {other} was required but NCCL used" in reason and "Fix:" in reason


def test_a_silent_fallback_to_sockets_names_its_causes():
    init = _init("socket-fallback-no-verbs.log")
    assert init.networks == {"Socket"} and init.devices == ["NET/Socket : Using [0]eth0:10.20.0.12<0>"]
    reason = tr.judge("ib", init)
    assert "NCCL used Socket" in reason and "silent fallback" in reason
    assert "libibverbs could not be opened" in reason and "no InfiniBand/RoCE device" in reason
    assert "plugin" not in reason  # the plugin line concerns efa, not ib


def test_a_required_network_nccl_does_not_have_is_its_own_error_line_and_cause():
    reason = tr.judge("ib", _init("ib-required-no-device.log"))
    assert '"Error: network IB not found."' in reason and "NCCL found no InfiniBand/RoCE device" in reason
    efa = tr.judge("efa", _init("efa-plugin-missing.log"))
    assert "NCCL_NET=AWS Libfabric" in efa and "aws-ofi-nccl module or container hook is not loaded" in efa
    newer = tr.judge("ib", _init("ib-required-nccl-2.28.log"))  # NCCL 2.28 names no network: NCCL_NET's is missing
    assert "(NCCL_NET=IB) and NCCL has no such network" in newer and "Failed to initialize any NET plugin" in newer
    other = tr.judge("socket", _init("ib-required-no-device.log"))
    assert "NCCL_NET named another network" in other and "unset NCCL_NET" in other
    # aws-ofi-nccl 1.12+ reports "Libfabric": the same transport
    assert tr.by_network("Libfabric").name == tr.by_network("AWS Libfabric").name == "efa"
    assert tr.by_network("IB").name == "ib" and tr.by_network("Socket").name == "socket"
    assert tr.by_network("CollNet") is None


def _sysfs(root: Path, devices: dict[str, tuple[str, str]], nics: dict[str, str], efa: tuple[str, ...] = ()) -> str:
    """A /sys tree with RDMA devices (port 1 state, link layer) and network interfaces (operstate)."""
    for dev, (state, layer) in devices.items():
        port = root / "sys/class/infiniband" / dev / "ports/1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
        (port / "link_layer").write_text(layer + "\n")
        if dev in efa:
            driver = root / "sys/bus/pci/drivers/efa"
            driver.mkdir(parents=True, exist_ok=True)
            (root / "sys/class/infiniband" / dev / "device").mkdir()
            (root / "sys/class/infiniband" / dev / "device/driver").symlink_to(driver)
    for nic, state in nics.items():
        (root / "sys/class/net" / nic).mkdir(parents=True)
        (root / "sys/class/net" / nic / "operstate").write_text(state + "\n")
    return str(root)


def test_preflight_reads_the_devices_and_ports_a_host_has(tmp_path):
    none = _sysfs(tmp_path / "none", {}, {"eth0": "up", "lo": "unknown"})
    assert any("no InfiniBand/RoCE device in /sys/class/infiniband" in p for p in tr.preflight("ib", {}, none))
    down = _sysfs(tmp_path / "down", {"mlx5_0": ("1: DOWN", "InfiniBand")}, {"ib0": "down"})
    assert any("no RDMA port is up (mlx5_0 port 1 (InfiniBand) DOWN)" in p for p in tr.preflight("ib", {}, down))
    up = _sysfs(tmp_path / "up", {"mlx5_0": ("4: ACTIVE", "Ethernet"), "rxe0": ("1: DOWN", "Ethernet")}, {})
    assert not [p for p in tr.preflight("ib", {}, up) if "port" in p or "device" in p]
    # an EFA device is not an InfiniBand HCA, and the other way round
    efa = _sysfs(tmp_path / "efa", {"rdmap0s31": ("4: ACTIVE", "Unspecified")}, {}, efa=("rdmap0s31",))
    assert any("no InfiniBand/RoCE device" in p for p in tr.preflight("ib", {}, efa))
    assert not [p for p in tr.preflight("efa", {}, efa) if "device" in p or "port" in p]
    assert any("no EFA device" in p for p in tr.preflight("efa", {}, up))


def test_preflight_of_sockets_follows_nccl_socket_ifname(tmp_path):
    root = _sysfs(tmp_path, {}, {"eth0": "up", "ib0": "down", "lo": "unknown", "docker0": "down"})
    assert tr.preflight("socket", {}, root) == []
    assert tr.preflight("socket", {"NCCL_SOCKET_IFNAME": "eth"}, root) == []
    down = tr.preflight("socket", {"NCCL_SOCKET_IFNAME": "ib"}, root)
    assert len(down) == 1 and "NCCL_SOCKET_IFNAME='ib' selects ['ib0'] that is up" in down[0] and "ib0 down" in down[0]
    assert "selects no interface" in tr.preflight("socket", {"NCCL_SOCKET_IFNAME": "=bond0"}, root)[0]
    assert tr.preflight("socket", {"NCCL_SOCKET_IFNAME": "^docker,lo"}, root) == []


def test_the_libraries_a_transport_loads_are_tried_for_real(tmp_path):
    """ctypes loads what NCCL would dlopen; the verbs provider drivers are files under libibverbs/."""
    loads = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libibverbs.so.1')"],
                           capture_output=True).returncode == 0
    gone = tr.missing_libraries("ib", {}, str(tmp_path))
    assert ("libibverbs.so.1" in gone) is not loads
    assert "libibverbs/libmlx5-rdmav*.so" in gone  # no provider under this empty root
    drivers = tmp_path / "usr/lib/x86_64-linux-gnu/libibverbs"
    drivers.mkdir(parents=True)
    (drivers / "libmlx5-rdmav34.so").write_bytes(b"")
    assert "libibverbs/libmlx5-rdmav*.so" not in tr.missing_libraries("ib", {}, str(tmp_path))
    assert tr.missing_libraries("socket", {}, str(tmp_path)) == []
    efa = tr.missing_libraries("efa", {"NCCL_NET_PLUGIN": "ofi"}, str(tmp_path))
    assert "libnccl-net-ofi.so or ofi" in efa and "libibverbs/libefa-rdmav*.so" in efa


def test_the_runtime_refuses_to_start_nccl_where_the_transport_cannot_work(tmp_path):
    root = _sysfs(tmp_path, {}, {"eth0": "up"})
    assert tr.check_before_init({}, root) is None  # nothing required
    with pytest.raises(tr.TransportError, match=r"NCCL transport ib is required here .*no InfiniBand/RoCE device"):
        tr.check_before_init({tr.REQUIRED_ENV: "ib"}, root)
    assert tr.check_before_init({tr.REQUIRED_ENV: "socket", "NCCL_NET": "Socket"}, root) == "socket"
    with pytest.raises(tr.TransportError, match="NCCL_NET='IB': NCCL would use another network"):
        tr.check_before_init({tr.REQUIRED_ENV: "socket", "NCCL_NET": "IB"}, root)
    with pytest.raises(tr.TransportError, match="not a transport"):
        tr.check_before_init({tr.REQUIRED_ENV: "tcp"}, root)


def test_after_init_the_process_reads_its_own_nccl_lines(tmp_path):
    env = {"NCCL_DEBUG_FILE": str(tmp_path / "nccl.%h.%p.log")}
    own = tmp_path / f"nccl.{socket.gethostname().split('.')[0]}.{os.getpid()}.log"
    other = tmp_path / f"nccl.{socket.gethostname().split('.')[0]}.{os.getpid() + 1}.log"
    other.write_text((DATA / "socket-fallback-no-verbs.log").read_text())  # another process's file: not ours
    own.write_text((DATA / "ib-ok.log").read_text())
    assert tr.own_debug_files(env) == [own]
    tr.confirm_after_init("ib", env)
    own.write_text((DATA / "socket-fallback-no-verbs.log").read_text())
    with pytest.raises(tr.TransportError, match="NCCL used Socket.*silent fallback"):
        tr.confirm_after_init("ib", env)
    own.unlink()  # NCCL failed before writing: torch's error repeats NCCL's last line
    error = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1733, invalid usage\nLast error:\nError: network IB "
                         "not found.")
    with pytest.raises(tr.TransportError, match="NCCL has no such network"):
        tr.confirm_after_init("ib", env, error=error)


def test_a_transport_error_crosses_the_process_boundary_as_itself():
    carried = worker_error(3, carried_header(tr.TransportError("NCCL transport ib is required here")) + "Traceback", 1)
    assert isinstance(carried, tr.TransportError) and carried.rank == 3
    assert str(carried).startswith("NCCL transport ib is required here")


def test_generated_scripts_require_the_transport(tmp_path):
    script = render(LaunchSpec(program=["train.py"], setup="multi-node", nodes=2, gpus_per_node=4,
                               nccl_transport="ib", log_dir=str(tmp_path / "logs")))
    line = next(x for x in script.splitlines() if x.startswith("export NCCL_NET="))
    assert line == (f"export NCCL_NET=IB TRAINSTACK_NCCL_TRANSPORT=ib NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET "
                    f"NCCL_DEBUG_FILE={tmp_path}/logs/nccl.%h.%p.log")
    efa = render(LaunchSpec(program=["train.py"], nccl_transport="efa", nccl_debug="TRACE"))
    assert "export NCCL_NET='AWS Libfabric' TRAINSTACK_NCCL_TRANSPORT=efa NCCL_DEBUG=TRACE" in efa
    assert efa.count("NCCL_DEBUG=") == 1  # --nccl-debug's own line is not repeated
    assert "NCCL_NET" not in render(LaunchSpec(program=["train.py"]))
    with pytest.raises(SpecError, match="--nccl-transport: 'ib' is NCCL's network, and a --cpu job"):
        LaunchSpec(program=["train.py"], cpu=True, nccl_transport="ib")
    with pytest.raises(SpecError, match="--nccl-transport: 'roce' is not one of ib, efa, socket"):
        LaunchSpec(program=["train.py"], nccl_transport="roce")


TRACE = """Traceback (most recent call last):
  File "/home/u/train.py", line 9, in <module>
    accelerator = Accelerator()
  File "/opt/venv/lib/python3.11/site-packages/trainstack/_runtime/spawn.py", line 140, in start
    _transport.confirm_after_init(required, error=exc)
{error}
"""


def test_why_names_the_missing_transport(tmp_path):
    logs = tmp_path / "logs"
    folder = logs / "job-7"
    folder.mkdir(parents=True)
    (folder / "rank-0.out").write_text(TRACE.format(
        error="trainstack._common.transport.TransportError: NCCL transport ib is required here "
              "(TRAINSTACK_NCCL_TRANSPORT=ib, --nccl-transport) and this host cannot provide it: no InfiniBand/RoCE "
              "device in /sys/class/infiniband on this host"))
    (folder / "exit_code").write_text("1\n")
    v = verdict("FAILED", folder, None)
    assert v.kind == "nccl transport" and "no InfiniBand/RoCE device" in v.summary and "on rank 0" in v.summary
    assert any("trainstack doctor --nccl-transport" in h for h in v.hints)
    # a program that is not trainstack's: NCCL's own failure, the cause from its init lines in the log folder
    plain = tmp_path / "plain" / "job-8"
    plain.mkdir(parents=True)
    (plain / "rank-1.out").write_text(TRACE.format(
        error="torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1733, invalid usage, NCCL "
              "version 2.29.7\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n"
              "Error: network IB not found."))
    (plain / "exit_code").write_text("1\n")
    (plain / "nccl.gpu-b07.2201.log").write_text((DATA / "ib-required-no-device.log").read_text())
    # probe 5 D-7, D-8: the shared log folder's files (a concurrent job's, a planted one) are not this job's; a FIFO
    # among this job's own is passed over, not waited on
    (plain.parent / "nccl.gpu-b07.999.log").write_text("NCCL INFO Failed to open libibverbs.so[.1]\n")
    os.mkfifo(plain / "nccl.gpu-b07.998.log")
    v = verdict("FAILED", plain, None)
    assert v.kind == "nccl transport" and "NCCL found no InfiniBand/RoCE device" in v.summary
    assert "could not be opened" not in v.summary, v.summary


def test_many_distinct_nccl_lines_are_read_in_linear_time(tmp_path):
    """Probe 5 D-10: 80 000 distinct device lines took 26 s (a list searched per line); a bounded head is read."""
    import time

    log = tmp_path / "nccl.h.1.log"
    log.write_text("".join(f"h:1:1 [0] NCCL INFO NET/Socket : Using [{i}]eth{i}:10.0.0.1<0>\n" for i in range(80_000)))
    started = time.monotonic()
    init = tr.read_init_files([log])
    assert 50_000 < len(init.devices) <= 80_000 and time.monotonic() - started < 3  # the head: 4 MiB


def test_doctor_and_nccl_check_require_the_transport(tmp_path):
    from trainstack._runtime.doctor import Facts, diagnose

    facts = Facts(environ={}, transport="ib", transport_problems=["no InfiniBand/RoCE device in /sys/class/infiniband"])
    assert [f.message for f in diagnose(facts) if "transport" in f.message] == [
        "NCCL transport ib is required: no InfiniBand/RoCE device in /sys/class/infiniband"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    doctor = subprocess.run([sys.executable, "-m", "trainstack", "doctor", "--nccl-transport", "socket", "--json"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert '"nccl_transport": "socket: ok"' in doctor.stdout
    check = subprocess.run([sys.executable, "-m", "trainstack.nccl_check", "--compute-setup", "cpu", "--expect", "ib"],
                           capture_output=True, text=True, timeout=120, env=env)
    assert check.returncode == 2 and "--expect ib checks NCCL's network, and this run uses gloo" in check.stderr
    from trainstack.nccl_check import require

    environ: dict[str, str] = {}
    require("efa", environ)
    assert environ["NCCL_NET"] == "AWS Libfabric" and environ[tr.REQUIRED_ENV] == "efa"
    assert environ["NCCL_DEBUG_FILE"].endswith("nccl.%h.%p.log")
