"""`trainstack doctor`: each problem driven by controlled facts, and a real run on this machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainstack._common.transport import match_ifname
from trainstack._runtime.doctor import Facts, diagnose, gather_facts, run_doctor, suggest_ifname

IFACES = {"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"], "eth0": ["10.0.0.5"], "ib0": ["192.168.1.5"]}


def _facts(**kw):
    base = dict(environ={}, torch="2.13.0", nccl_available=True, interfaces=IFACES,
                verbs_libs={"libibverbs.so.1": True, "librdmacm.so.1": True}, tools={"scontrol": "/usr/bin/scontrol"})
    return Facts(**(base | kw))


def _problems(facts, **kw):
    return [f.message for f in diagnose(facts, **kw) if f.level == "problem"]


def test_healthy_machine_has_no_problems():
    assert _problems(_facts()) == []


@pytest.mark.parametrize("facts, kw, needle", [
    (_facts(gpus=[]), {"compute_setup": "gpu"}, "no CUDA device is visible"),
    (_facts(environ={"NCCL_SOCKET_IFNAME": "ens"}), {}, "NCCL_SOCKET_IFNAME='ens' matches none"),
    (_facts(environ={"GLOO_SOCKET_IFNAME": "eth9"}), {}, "GLOO_SOCKET_IFNAME='eth9'"),
    (_facts(ib_devices=["mlx5_0"], verbs_libs={"libibverbs.so.1": False, "librdmacm.so.1": True}), {},
     "silently fall back to TCP"),
    (_facts(ancestors=["bash", "slurmstepd"]), {}, "--cleanenv"),
    (_facts(environ={"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "3"}), {}, "SLURM_PROCID is missing"),
    (_facts(gpus=["H100"], nccl_available=False), {}, "no NCCL"),
    (_facts(torch=None), {}, "torch is not installed"),
])
def test_each_problem_is_reported_with_a_fix(facts, kw, needle):
    problems = _problems(facts, **kw)
    assert any(needle in p for p in problems), problems
    assert run_doctor(facts=facts, **kw) == 1


def test_missing_scontrol_in_a_job_is_a_note_not_a_failure():
    facts = _facts(environ={"SLURM_JOB_ID": "7", "SLURM_PROCID": "0"}, tools={"scontrol": None})
    notes = [f for f in diagnose(facts) if f.level == "note"]
    assert notes and "batch shell" in notes[0].message and run_doctor(facts=facts) == 0


def test_ifname_syntax_and_suggestion():
    names = list(IFACES)
    assert match_ifname("eth", names) == ["eth0"]
    assert match_ifname("^docker,lo", names) == ["eth0", "ib0"]
    assert match_ifname("=eth0", names) == ["eth0"] and match_ifname("=eth", names) == []
    assert suggest_ifname(IFACES) == "eth0"


def test_real_report_on_this_machine(capsys):
    facts = gather_facts()
    assert facts.torch and "lo" in facts.interfaces
    code = run_doctor(as_json=True, facts=facts)
    report = json.loads(capsys.readouterr().out)
    assert report["torch"] == facts.torch and report["launcher"].startswith(("local", "slurm", "torchrun"))
    assert code == (1 if any(f["level"] == "problem" for f in report["findings"]) else 0)


def test_cli_doctor_and_env_commands():
    env = subprocess.run([sys.executable, "-m", "trainstack", "env"], capture_output=True, text=True, timeout=120)
    assert env.returncode == 0 and "torch" in env.stdout and "suggested_NCCL_SOCKET_IFNAME" in env.stdout
    bad = subprocess.run([sys.executable, "-m", "trainstack", "doctor"], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "NCCL_SOCKET_IFNAME": "nosuchif"})
    assert bad.returncode == 1 and "NCCL_SOCKET_IFNAME='nosuchif' matches none" in bad.stdout


@pytest.mark.parametrize("environ, needle", [
    ({"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "x", "SLURM_NTASKS": "2"}, "SLURM_PROCID='x'"),
    ({"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
      "SLURM_JOB_NODELIST": "node[1-"}, "node[1-"),
])
def test_a_broken_launcher_environment_is_a_problem_not_a_note(environ, needle, capsys):
    facts = Facts(environ=environ, torch="2.13.0")
    code = run_doctor(facts=facts)
    captured = capsys.readouterr()
    assert code == 1 and needle in captured.out and "no problems found" not in captured.err


def test_hang_settings_are_reported(capsys):
    facts = Facts(environ={"TRAINSTACK_TIMEOUT_S": "900", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                           "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/jobs/j-1/nccl-",
                           "TRAINSTACK_HANG_TIMEOUT": "300"}, torch="2.13.0")
    run_doctor(facts=facts, as_json=True)
    report = json.loads(capsys.readouterr().out)["hangs"]
    assert report["collective timeout"].startswith("900 s") and report["hang watchdog"].startswith("300 s")
    assert "last 2000 collectives" in report["NCCL flight recorder"] and "/jobs/j-1/nccl-" in report[
        "NCCL flight recorder"]
    gpu_job = Facts(environ={"SLURM_JOB_ID": "1"}, torch="2.13.0", gpus=["H100"], nccl_available=True)
    assert any("flight recorder is off" in f.message for f in diagnose(gpu_job))
