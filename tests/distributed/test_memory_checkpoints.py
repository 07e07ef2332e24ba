"""Memory checkpoints under torchrun restarts: a rank killed, a node lost with its memory, both copies lost, a
corrupt copy, kill -9 at random moments, FSDP2 -- each resumed run ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, ci_leaves_out, small_tmpfs, torchrun_exe

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCRIPT = str(Path(__file__).with_name("_memory_train.py"))
KILLS = 4  # random SIGKILLs in one run (ten found nothing six did not; each restart costs ~7 s of the slow lane)


def _torchrun(run_py, out: Path, nprocs: int = 4, restarts: int = 1, check: bool = True, **env: object):
    return run_py([torchrun_exe(), "--standalone", "--nproc_per_node", str(nprocs), "--max-restarts",
                   str(restarts), "--monitor-interval", "0.2", SCRIPT, str(out)], timeout=240, check=check,
                  env={"TRAINSTACK_MEMORY_DIR": str(out.parent / "shm"), **{k: str(v) for k, v in env.items()}})


def _same_final(a: Path, b: Path, nprocs: int) -> None:
    for rank in range(nprocs):
        mine, ref = torch.load(a / f"final-rank{rank}.pt"), torch.load(b / f"final-rank{rank}.pt")
        different = [k for k in ref if not torch.equal(mine[k], ref[k])]
        assert not different, f"rank {rank}: {different} differ from the uninterrupted run"


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs, one per layout, made on first use."""
    made: dict[tuple[str, int], Path] = {}

    def reference(run_py, strategy: str = "ddp", nprocs: int = 4) -> Path:
        if (strategy, nprocs) not in made:
            out = tmp_path_factory.mktemp(f"ref-{strategy}-{nprocs}") / "out"
            _torchrun(run_py, out, nprocs, STRATEGY=strategy)
            made[strategy, nprocs] = out
        return made[strategy, nprocs]

    return reference


def _resumed(output: str) -> list[tuple[int, str]]:
    return [(int(step), how) for step, how in re.findall(r"Resumed from memory at step (\d+) \(([^)]*)\)", output)]


@pytest.mark.alone  # faults timed against the background save thread
def test_each_fault_resumes_from_the_newest_complete_copies_bitwise(run_py, tmp_path, references):
    """One run, five faults on rank 3 (memory every 3 steps, durable every 10), torchrun restarting the group:
    step 5, the process dies -> every rank from its own memory (step 3); step 10, rank 1's newest copy truncated ->
    passed over, named, rank 1 from its peer's copy (step 9); step 14, node n1 lost with its memory -> ranks 2, 3
    from their copies on n0 (step 12); step 15, rank 3 dies inside its memory save before writing it -> step 15's
    set is incomplete, passed over, named: step 12 again; step 20, both nodes' memory lost -> the durable checkpoint
    (step 10), said.
    (A memory set no newer than the durable checkpoint is not used: the durable one is the same state.)
    The end is bitwise the uninterrupted run's; the finished run frees its memory."""
    out = tmp_path / "out"
    proc = _torchrun(run_py, out, restarts=5, FAULTS="5:exit,10:corrupt,14:node,15:midsave,20:both", DURABLE=10)
    assert _resumed(proc.stdout) == [(3, "every rank from its own memory"), (9, "rank 1 from a copy on n1"),
                                     (12, "ranks 2, 3 from a copy on n0"), (12, "ranks 2, 3 from a copy on n0")], \
        proc.stdout[-3000:]
    assert "memory checkpoints passed over: step 15: no copy left of rank(s) 3; the next source was used" \
        in proc.stdout, proc.stdout[-3000:]
    assert re.search(r"memory checkpoints passed over: rank 1's step 9 in its own memory: truncated \(100 of \d+ "
                     r"bytes\); the next source was used", proc.stdout), proc.stdout[-3000:]
    assert "no complete memory checkpoint set newer than the durable checkpoint; resuming from the durable " \
           "checkpoint ckpt-e00000-s000000010" in proc.stdout, proc.stdout[-3000:]
    assert "Resumed from " + str(out / "run" / "checkpoints" / "ckpt-e00000-s000000010.pt") in proc.stdout
    _same_final(out, references(run_py), 4)
    assert not list((tmp_path / "shm").glob("trainstack-*/job-*")), "a finished run frees its memory"


@pytest.mark.parametrize("nprocs", [2, pytest.param(4, marks=ci_leaves_out("two processes confirm the path"))])
def test_fsdp2_resumes_from_memory_bitwise(run_py, tmp_path, references, nprocs):
    out = tmp_path / "out"
    proc = _torchrun(run_py, out, nprocs, FAULTS="8:node" if nprocs == 4 else "8:exit", STRATEGY="fsdp",
                     NODE_SIZE=nprocs // 2, CRASH_RANK=nprocs - 1)
    expected = "ranks 2, 3 from a copy on n0" if nprocs == 4 else "every rank from its own memory"
    assert _resumed(proc.stdout) == [(6, expected)], proc.stdout[-3000:]
    _same_final(out, references(run_py, "fsdp", nprocs), nprocs)


@ci_leaves_out("memory checkpoints after each fault: test_each_fault_resumes_from_the_newest_complete_copies_bitwise")
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill9_at_six_random_moments_loses_at_most_n_steps_each_time(tmp_path, run_py):
    """One run, six SIGKILLs of a random rank at a random moment (mid-step, mid-staging, mid-copy); torchrun
    restarts the group each time; the end is bitwise the uninterrupted run's, and each restart lost <= N steps."""
    out, n = tmp_path / "out", 3
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRAINSTACK_MEMORY_DIR": str(tmp_path / "shm"), "STEPS": "250",
           "SLOW": "0.02"}
    rng = random.Random(1234)
    # compared with an uninterrupted twin of the same length
    twin = tmp_path / "twin"
    _torchrun(run_py, twin, STEPS=250, SLOW=0.02)
    log = open(tmp_path / "torchrun.log", "w")  # a file, not a pipe nobody reads while the run goes on
    child = subprocess.Popen([torchrun_exe(), "--standalone", "--nproc_per_node", "4", "--max-restarts", "10",
                              "--monitor-interval", "0.2", SCRIPT, str(out)], cwd=ROOT, env=env, text=True,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    kills: list[tuple[int, bool]] = []
    progress = out / "progress"

    def attempt_trains(count: int) -> bool:  # the attempt after `count` kills has started and taken a step
        text = progress.read_text() if progress.exists() else ""
        return text.count("start") == count + 1 and not text.rstrip().split("\n")[-1].startswith("start")

    try:
        for _ in range(KILLS):
            deadline = time.monotonic() + 90
            while not attempt_trains(len(kills)) and time.monotonic() < deadline and child.poll() is None:
                time.sleep(0.02)
            if not attempt_trains(len(kills)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                pytest.fail(f"attempt {len(kills)} did not train; kills so far {kills}; progress "
                            f"{progress.read_text().split()[-40:]}\n{(tmp_path / 'torchrun.log').read_text()[-3000:]}")
            pids = {r: int((out / "pids" / f"rank-{r}").read_text()) for r in range(4)}
            time.sleep(rng.uniform(0.0, 0.5))
            rank = rng.randrange(4)
            copying = any(p.name.startswith(".") for p in (tmp_path / "shm").rglob("*"))
            os.kill(pids[rank], signal.SIGKILL)
            kills.append((rank, copying))
        child.wait(timeout=400)
        output = (tmp_path / "torchrun.log").read_text()
    finally:
        log.close()
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert child.returncode == 0, output[-4000:]
    lines = (out / "progress").read_text().split()
    reached, lost = 0, []
    for word, value in zip(lines[::2], lines[1::2], strict=True):
        if word == "start" and reached:
            lost.append(reached - int(value))
        reached = int(value)
    assert len(lost) == KILLS, (lost, kills)
    print(f"steps lost per restart {lost} (N={n}); kills (rank, a copy being written) {kills}")
    assert all(0 <= k <= n for k in lost), f"steps lost per restart {lost} (N={n}); kills (rank, mid-copy) {kills}"
    _same_final(out, twin, 4)


def test_a_memory_file_system_too_small_is_a_clear_error_before_training(run_py, tmp_path):
    with small_tmpfs(tmp_path / "small", "64k"):
        proc = _torchrun(run_py, tmp_path / "out", 2, restarts=0, check=False,
                         TRAINSTACK_MEMORY_DIR=tmp_path / "small")
    assert proc.returncode != 0
    assert re.search(r"memory checkpoints need [\d.]+ KiB in .*small on node n0 .* but only [\d.]+ KiB is free",
                     proc.stdout), proc.stdout[-3000:]
    assert "step 1" not in (tmp_path / "out" / "progress").read_text() if (tmp_path / "out" / "progress").exists() \
        else True


def test_a_memory_folder_others_can_write_into_is_refused(run_py, tmp_path):
    root = tmp_path / "shm" / f"trainstack-{os.getuid()}"
    root.mkdir(parents=True)
    planted = root / "job-planted"
    planted.mkdir()
    os.chown(planted, 65534, 65534)
    root.chmod(0o777)
    proc = _torchrun(run_py, tmp_path / "out", 2, restarts=0, check=False)
    assert proc.returncode != 0
    assert f"memory checkpoints cannot use {root}: {root} is writable by other users (mode 777)" in proc.stdout, \
        proc.stdout[-3000:]
    assert planted.exists(), "nothing of another user's is touched"


def test_a_deleted_runs_memory_checkpoints_are_removed_not_continued(run_py, tmp_path, references):
    """A run killed at step 13 leaves a memory set at step 10; its run folder is deleted and the run started again
    in the same path: the set belongs to another run id, so it is removed with one line, never restored -- the new
    run trains from its own start and ends equal to an uninterrupted run."""
    out = tmp_path / "out"
    crashed = _torchrun(run_py, out, 2, restarts=0, check=False, MEM=5, FAULTS="13:exit", CRASH_RANK=1)
    assert crashed.returncode != 0
    shm = tmp_path / "shm" / f"trainstack-{os.getuid()}"
    assert list(shm.rglob("r00000-s000000010.json")), "the killed run left its step-10 set"
    import shutil

    shutil.rmtree(out / "run")
    (out / "faulted-13").unlink()
    again = _torchrun(run_py, out, 2, restarts=0, MEM=5)
    assert "Resumed from memory" not in again.stdout, again.stdout[-3000:]
    assert re.search(r"memory checkpoints of an earlier run in this path \(step 10\) removed from .*: they belong "
                     r"to another run id", again.stdout), again.stdout[-3000:]
    _same_final(out, references(run_py, nprocs=2), 2)


def test_failing_memory_checkpoints_are_said_counted_and_their_recovery_said(run_py, tmp_path):
    """The memory file system full from step 6 to step 12 (memory checkpoints every 3 steps): the first failed
    save is said on rank 0 with the newest complete set, the recovery is said, metrics.jsonl counts the failures and
    the end summary says how many of the saves failed; training itself never stops."""
    with small_tmpfs(tmp_path / "shm", "2m") as shm:
        run = _torchrun(run_py, tmp_path / "out", 2, restarts=0, check=False, MEM=3, STEPS=18,
                        FAULTS="6:fill,12:unfill", TRAINSTACK_MEMORY_DIR=shm, LOG_EVERY=1)
    out = run.stdout
    # a failure shows what every rank said first (the tail alone showed only the rank that lost its peer)
    assert run.returncode == 0, "\n".join(line for line in out.splitlines() if "Error" in line or "WARNING" in line
                                          or "[rank0]" in line)[-6000:] + "\n...\n" + out[-2000:]
    assert re.search(r"WARNING: the memory checkpoint of step (6|9) failed \(.*\); the newest complete set is step "
                     r"(3|6)", out), out[-3000:]
    assert re.search(r"memory checkpoints work again at step (12|15) \(after [1-3] failed round", out), out[-3000:]
    assert re.search(r"memory checkpoints: [1-3] of [56] failed", out), out[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "run").rglob("metrics.jsonl").__next__().read_text()
            .splitlines()]
    assert any(r.get("memory_checkpoint_failures", 0) >= 1 for r in rows), rows[-3:]


@ci_leaves_out("a restart from memory: test_each_fault_resumes_from_the_newest_complete_copies_bitwise")
def test_a_torchrun_restart_continues_its_run_folder_and_memory_checkpoints(run_py, tmp_path, references):
    """torchrun --max-restarts 1, root_folder only (no log_folder, no Slurm), memory every 5, no durable
    checkpoint, rank 3 killed at step 13: the restarted workers continue the folder the first attempt chose (not a
    new timestamped one) and resume from memory at step 10, ending equal to an uninterrupted run."""
    out = tmp_path / "out"
    run = _torchrun(run_py, out, 4, restarts=1, MEM=5, FAULTS="13:exit", ROOT_FOLDER=1)
    assert _resumed(run.stdout) == [(10, "every rank from its own memory")], run.stdout[-3000:]
    assert "starting from scratch" not in run.stdout.split("Resumed from memory")[1]
    folders = [p for p in (out / "runs").iterdir() if p.is_dir()]
    assert len(folders) == 1, folders  # one run folder for the launch and its restart
    _same_final(out, references(run_py), 4)
