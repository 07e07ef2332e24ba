"""The batch host is a node too: a sentinel on another node of the allocation notices when the job's driver is gone.

A ``--requeue`` job keeps its allocation when a node fails (``#SBATCH --no-kill``, so that spares can take over), and
the driver runs on the first node. When *that* node is lost, Slurm kills only the batch step: the job would stay
``RUNNING`` with no process at all, holding the other nodes. So the driver starts this sentinel as a one-task step on
another node (``srun --overlap``); it watches the driver's heartbeat in the job folder (``driver.alive``, touched
every few seconds by a thread of its own) and, when it has been silent for ``SILENT_S`` without the driver having
ended, records the loss (a ``node failure`` verdict blaming the batch host, a ``driver_lost`` event) and requeues the
job leaving that host out -- the same requeue the driver does, through the same Slurm calls. When the driver ends,
the sentinel stands down. Torch-free, stdlib only.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from .._common import jobevents as events
from .._common.jobfiles import DRIVER_SILENT_S, JobFiles
from . import attempt as policy
from .slurmcmd import Slurm
from .verdict import last_step

__all__ = ["SILENT_S", "STEP_NAME", "start", "watch", "main"]

SILENT_S = DRIVER_SILENT_S
STEP_NAME = "trainstack-sentinel"  # the sentinel's job step: never killed with a failed training step


def start(slurm: Slurm, files: JobFiles, allocated: list[str], env: Mapping[str, str], requeue_id: str, need: int,
          restart: int) -> str | None:
    """Start the sentinel on another node of ``allocated`` than the batch host (none with a single node): it
    requeues the job without the batch host should the driver's heartbeat stop. The host it runs on (None: none)."""
    here = env.get("SLURMD_NODENAME") or (allocated[:1] or [""])[0]
    others = [h for h in allocated if h != here]
    if not others:
        return None
    package = str(Path(__file__).resolve().parents[2])  # this trainstack, also where it is a shipped copy
    step_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), package) if p)}
    out = files.path("sentinel.out")  # written by the sentinel's node: the batch host may be gone
    argv = ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={others[0]}", f"--job-name={STEP_NAME}",
            f"--output={out}", "--open-mode=append", sys.executable, "-m", "trainstack._slurm.sentinel",
            str(files.folder), here, requeue_id, str(need), str(restart)]
    slurm.launch(argv, step_env, output=Path(os.devnull))
    return others[0]


def watch(files: JobFiles, slurm: Slurm, batch_host: str, requeue_id: str, need: int, restart: int = 0,
          silent_s: float = SILENT_S, poll_s: float = 2.0, log: Path | None = None) -> str:
    """Watch until the driver ends (``"ended"``) or falls silent: then record, requeue without ``batch_host`` and
    return what was done."""
    while True:
        if files.driver.has_ended():
            return "ended"
        silent = files.driver.silent_for()
        if silent is not None and silent > silent_s:
            break
        time.sleep(poll_s)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the requeue signals this step too: finish the requeue first
    line = (f"the batch host {batch_host} was lost: the job's driver has not answered for {silent:.0f} s; "
            f"requeueing without it")
    keep, note = policy.exclusions([*(r.get("blamed") for r in policy.history(files.folder)), batch_host],
                                   slurm.partition_nodes(), need)
    steps = [e.get("step_index") for e in events.read(files.folder, kind="step_start") if e.get("attempt") == restart]
    index = steps[-1] if steps and isinstance(steps[-1], int) else 0  # the job step the driver was running
    files.append_verdict({"attempt": restart, "step_index": index, "category": "crash", "kind": "node failure",
                          "summary": f"batch host lost: {batch_host} (the job's driver stopped answering)",
                          "cause": f"node failure: batch host lost: {batch_host}", "rank": None, "host": batch_host,
                          "blamed": batch_host, "step": last_step(files.folder), "status": 1,
                          "fault_time": time.time() - silent,
                          "time": time.time(), "retried": True, "excluded": keep,
                          "decision": line + (f"; {note}" if note else "")})
    files.record_event("driver_lost", host=batch_host, silent_s=round(silent, 1), attempt=restart, step_index=index)
    _say(line, log)
    done = slurm.requeue(requeue_id, keep)
    if not done.done:
        _say(f"scontrol requeue {requeue_id} failed: {done.answer}; trainstack cancel the job (it holds its nodes "
             f"with no process of it running)", log)
        files.record_event("driver_lost_requeue_failed", answer=done.answer, attempt=restart)
        return "requeue failed"
    if done.excluded:
        _say(f"the requeued attempt leaves out {','.join(keep)}", log)
    _say(done.hold, log)
    files.driver.ended(f"requeued by the sentinel: {batch_host} lost")
    return "requeued"


def _say(line: str, log: Path | None) -> None:
    """A line in the sentinel's own output and in the job's log (the driver that wrote there is gone)."""
    text = f"trainstack: {line} (sentinel)"
    print(text, flush=True)
    if log is not None:
        try:
            with open(log, "a") as fh:
                fh.write(text + "\n")
        except OSError:
            pass


def main(argv: list[str]) -> int:
    """``python -m trainstack._slurm.sentinel TASK_DIR BATCH_HOST REQUEUE_ID NODES RESTART``."""
    folder, batch_host, requeue_id, need, restart = argv[1], argv[2], argv[3], int(argv[4]), int(argv[5])
    slurm = Slurm(os.environ.get("SLURM_JOB_ID", requeue_id.split("_")[0]))
    files = JobFiles.mine(Path(folder))
    files.record_event("sentinel_start", host=os.environ.get("SLURMD_NODENAME", ""), watching=batch_host,
                       attempt=restart)
    try:
        watch(files, slurm, batch_host, requeue_id, need, restart, log=slurm.log_path())
    except Exception as exc:  # its own output goes to an srun that may be gone: the job's log and events say it
        files.record_event("sentinel_failed", error=f"{type(exc).__name__}: {exc}", attempt=restart)
        _say(f"the sentinel failed ({type(exc).__name__}: {exc}); a lost batch host is no longer requeued "
             f"by it", slurm.log_path())
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
