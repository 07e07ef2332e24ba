"""What a failure costs on the local Slurm (`make slurm-up`: node1-3 on one host), measured from outside the job: the
seconds from the fault to the first resumed training step, the steps redone (done before the fault, then done
again after the resume: 0 where the survivors' live state is kept), and the bytes the survivors sent to the ranks
that lacked their state. The program: 4 ranks on 2 nodes (tests/slurm/_recovery_train.py, a checkpoint every 5
steps). Cases, one run each (``--repeats`` for more):

* ``in-allocation crash``: rank 1 SIGKILLed; retried as a new job step of the same allocation (the survivors in
  place, rank 1 in a warm standby where the tree has them).
* ``whole-step relaunch``: the same with ``TRAINSTACK_IN_PLACE=0`` (what NCCL, FSDP and HSDP do): every rank of the
  step starts again -- in warm standbys where the tree has them (``TRAINSTACK_STANDBY=2``: a node's ranks).
* ``spare after node loss``: every process of node2's step and its slurmd SIGKILLed, ``--spare-nodes 1``: node3
  takes node2's place in the same allocation.
* ``requeue after node loss``: the same without a spare: the job is requeued without node2, Slurm's hold on the
  requeued job released.
* ``shrink after node loss``: the same without a spare, ``--min-nodes 1``: the run continues on node1 in the same
  allocation (2 ranks, the global batch kept by gradient accumulation).
* ``hsdp crash``, ``hsdp spare after node loss``, ``hsdp shrink after node loss``: the same faults with the program
  under HSDP (one replica group per node, ``STRATEGY=hsdp``): a survivor shards its model again over the new mesh
  and a new rank takes its shard from the other replica group. A baseline tree runs this tree's program (its own
  may not know ``STRATEGY``).
* ``requeue today`` (``--today REF``, ~3 min): a crash under the trainstack of git commit REF (before in-allocation
  recovery): requeued, Slurm's hold and the queue in between.

``--baseline REF`` runs every case also under the trainstack of git commit REF (a worktree), alternating, and prints
both columns and their ratio: the same recovery beside today's main in one run.

The phases of each recovery (the last repetition's) follow the table: notice (the kill to the first failing task's
exit record), detect, teardown, relaunch, restore, first step (`trainstack status --attempts`).

Run: `make bench-recovery` (or `python bench/recovery.py [--today 82813d8] [--baseline 9aef794]
[--launcher srun|torchrun|spawn] [--only crash,spare]`)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _faults import kill_node, kill_rank, rank_pids, reached, restore_nodes, wait_until  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROGRAM = REPO / "tests" / "slurm" / "_recovery_train.py"
FAULT_AT = 22  # rank 0 reached this step: the last checkpoint is step 20


def submit(out: Path, env: dict[str, str], launcher: str, spare: int, trainstack: Path = REPO,
           min_nodes: int | None = None, job_env: dict[str, str] | None = None) -> str:
    """The recovery program as a --requeue job on partition spares; its job id."""
    extra = {**({"PYTHONPATH": str(trainstack)} if trainstack != REPO else {}), **(job_env or {})}
    hsdp = (job_env or {}).get("STRATEGY") == "hsdp"  # that tree's own program (its config knows that tree's
    program = (REPO if hsdp else trainstack) / PROGRAM.relative_to(REPO)  # fields), or this one's for HSDP
    args = [sys.executable, "-m", "trainstack", "submit", "--setup", "multi-node", "--nodes", "2", "--cpu",
            "--procs-per-node", "2", "--launcher", launcher, "--time", "10", "--job-name", "bench-recovery",
            "--log-dir", str(out / "logs"), "--requeue", "--partition", "spares", "--no-snapshot",
            "--env", f"PROBE_OUT={out}", "--env", "STEP_SLEEP=0.3", "--venv", str(Path(sys.executable).parents[1]),
            *[a for k, v in extra.items() for a in ("--env", f"{k}={v}")],
            *(["--spare-nodes", str(spare)] if spare else []),
            *(["--min-nodes", str(min_nodes)] if min_nodes else []), str(program)]
    done = subprocess.run(args, cwd=out, env={**env, **extra}, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"submit failed: {done.stdout}{done.stderr}")
    return done.stdout.split()[1]


def measure(case: str, env: dict[str, str], launcher: str, work: Path, today: Path | None = None) -> dict:
    """One case: submit, fault at step FAULT_AT, wait for the first step after the resume; the row."""
    out = Path(tempfile.mkdtemp(prefix=case.replace(" ", "-") + "-", dir=work))
    out.chmod(0o777)
    node_loss = "node loss" in case
    kind = case.removeprefix("hsdp ")  # the fault; "hsdp ...": the program under HSDP
    whole = kind.startswith("whole-step")
    tree = today or REPO
    job_env = {"TRAINSTACK_IN_PLACE": "0", "TRAINSTACK_STANDBY": "2"} if whole else {}
    job = submit(out, env, launcher, spare=1 if kind.startswith("spare") else 0, trainstack=tree,
                 min_nodes=1 if kind.startswith("shrink") else None,
                 job_env={**job_env, **({"STRATEGY": "hsdp"} if kind != case else {})})
    # the second node of the step: node2, or the spare when the node check at the start named node2 (a loaded box)
    second = lambda: next((h for h in ("node2", "node3") if len(rank_pids(out, h)) == 2), None)  # noqa: E731
    wait_until(lambda: reached(out) >= FAULT_AT and second() is not None, 180, f"step {FAULT_AT}")
    if (tree / "trainstack" / "_runtime" / "standby.py").exists():  # the standbys the recovery will take, ready
        need = {"node3": 2} if kind.startswith("spare") else {"node1": 2, "node2": 2} if whole or \
            (launcher == "torchrun" and "crash" in case) else {"node1": 1} if "crash" in case else {}
        if not wait_ready(out, need, 60):
            print(f"{case}: the warm standbys {need} were not ready 60 s after step {FAULT_AT}", flush=True)
    if node_loss:
        fault = kill_node(out, second(), Path(env["SLURM_CONF"]))
    else:
        fault = kill_rank(out, "node1", 1)
    done_before = reached(out)
    # the first resumed step, from the job's own timeline (steps after the resume take 20 ms: a poll would miss it)
    wait_until(lambda: after(out, "first_step", fault) is not None, 400, "the first resumed step", poll=0.5)
    resumed = after(out, "first_step", fault)["time"] - fault
    resumed_at = (after(out, "resumed", fault) or {"step": done_before})["step"]
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    restarts = shown.split("Restarts=")[1].split()[0] if "Restarts=" in shown else "?"
    subprocess.run([sys.executable, "-m", "trainstack", "cancel", job], env=env, timeout=60, check=False,
                   capture_output=True)  # a plain scancel of a --requeue job would requeue it
    left = restore_nodes(env)
    if left:
        raise RuntimeError(f"nodes {left} did not come back after case {case!r}")
    moved = after(out, "peer_state", fault)
    # the survivors may complete the step in flight after the kill (the lost ranks' gradients were in): none redone
    return {"case": case, "seconds": resumed, "lost": max(0, done_before - resumed_at), "restarts": restarts,
            "job": job, "phases": phases(out, resumed), "bytes": int(moved["bytes"]) if moved else 0}


def wait_ready(out: Path, need: dict[str, int], limit_s: float) -> bool:
    """Wait until ``need`` standbys per host said they are ready (the job folder's standby/<name>.ready)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        names = [p.name for p in (out / "logs").glob("*/standby/*.ready")]
        if all(sum(f"-{host}-" in n for n in names) >= k for host, k in need.items()):
            return True
        time.sleep(0.2)
    return False


def phases(out: Path, resumed: float) -> dict[str, float | None]:
    """The recovery's phases as the job recorded them (``trainstack status --attempts``), after ``notice``: the
    fault (the kill, from outside) to the first failing task's exit record."""
    from trainstack._slurm.attempt import recoveries

    found = [r for path in (out / "logs").glob("*/events.jsonl") for r in recoveries(path.parent)]
    if not found:
        return {}
    notice = round(resumed - found[0]["total"], 2) if found[0]["total"] is not None else None
    return {"notice": notice, **found[0]["phases"]}


def after(out: Path, kind: str, when: float) -> dict | None:
    """The job's first ``kind`` event after ``when`` (its events.jsonl in the job folder), or None."""
    for path in (out / "logs").glob("*/events.jsonl"):
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("kind") == kind and event.get("time", 0) > when:
                return event
    return None


def worktree(ref: str, work: Path) -> Path:
    """A checkout of ``ref`` (the trainstack of that commit), for the ``requeue today`` and baseline cases."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"trainstack-{ref}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), ref], check=True,
                   capture_output=True, timeout=120)
    # its bytecode compiled once, as `make bytecode` does for this tree (PYTHONDONTWRITEBYTECODE=1 would otherwise
    # have every process of the baseline compile it again: an unfair 0.1 s per process)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(path / "trainstack")], check=True,
                   capture_output=True, timeout=300)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launcher", default="srun", choices=("srun", "torchrun", "spawn"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--today", metavar="REF", help="also the requeue of git commit REF (before this feature)")
    parser.add_argument("--baseline", metavar="REF", help="every case also under git commit REF, side by side")
    parser.add_argument("--only", metavar="WORDS", default="crash,whole-step,spare,shrink,requeue",
                        help="the cases whose names hold one of these comma-separated words (default: all but "
                             "HSDP's: --only hsdp)")
    args = parser.parse_args()
    env = dict(os.environ)
    env.setdefault("SLURM_CONF", "/tmp/trainstack-slurm/slurm.conf")
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    work.chmod(0o777)
    words = [w.strip() for w in args.only.split(",")]
    cases = [c for c in ("in-allocation crash", "whole-step relaunch", "spare after node loss",
                         "shrink after node loss", "requeue after node loss", "hsdp crash",
                         "hsdp spare after node loss", "hsdp shrink after node loss")
             if any(w in c for w in words) and (c.startswith("hsdp") == any("hsdp" in w for w in words))]
    today = worktree(args.today, work) if args.today else None
    base = worktree(args.baseline, work / "base") if args.baseline else None
    if today is not None:
        cases.insert(0, "requeue today")
    runs = [(c, None) for c in cases] + ([(c, base) for c in cases if c != "requeue today"] if base else [])
    rows: dict[tuple[str, Path | None], list[dict]] = {run: [] for run in runs}
    try:
        for _ in range(args.repeats):
            for case, tree in sorted(runs, key=lambda r: (cases.index(r[0]), r[1] is None)):
                row = measure(case, env, args.launcher, work, today if case == "requeue today" else tree)
                rows[(case, tree)].append(row)
                print(f"{case}{f' ({args.baseline})' if tree else ''}: {row['seconds']:.1f} s to the first resumed "
                      f"step, steps redone: {row['lost']}, {row['bytes']} bytes from the survivors (job {row['job']}, "
                      f"restarts {row['restarts']})", flush=True)
    finally:
        for tree in (today, base):
            if tree is not None:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    print(f"\n4 ranks on 2 nodes ({args.launcher}), checkpoint every 5 steps, fault at step ~{FAULT_AT}; "
          f"median of {args.repeats}\n")
    names = ("notice", "detect", "teardown", "relaunch", "restore", "first step")
    print("| case | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for (case, tree), found in rows.items():
        last = found[-1].get("phases") or {}
        cells = [f"{last[n]:.1f} s" if last.get(n) is not None else "-" for n in names]
        print(f"| {case}{f' ({args.baseline})' if tree else ''} | " + " | ".join(cells) + " |")
    print()
    if base is None:
        print("| case | fault -> first resumed step | steps redone | bytes moved | Slurm restarts |")
        print("|---|---|---|---|---|")
        for (case, _), found in rows.items():
            print(f"| {case} | {statistics.median(r['seconds'] for r in found):.1f} s | "
                  f"{statistics.median(r['lost'] for r in found):.0f} | {found[-1]['bytes']} | "
                  f"{found[-1]['restarts']} |")
        return
    print(f"| case | this tree | {args.baseline} | ratio | steps redone (this / {args.baseline}) | bytes moved |")
    print("|---|---|---|---|---|---|")
    for case in cases:
        if case == "requeue today":
            continue
        mine, theirs = rows[(case, None)], rows.get((case, base)) or rows.get(("requeue after node loss", base))
        if not theirs:
            continue
        a, b = (statistics.median(r["seconds"] for r in x) for x in (mine, theirs))
        case += " (vs its requeue)" if (case, base) not in rows else ""
        print(f"| {case} | {a:.1f} s | {b:.1f} s | {a / b:.2f}x | {statistics.median(r['lost'] for r in mine):.0f}"
              f" / {statistics.median(r['lost'] for r in theirs):.0f} | {mine[-1]['bytes']} |")


if __name__ == "__main__":
    main()
