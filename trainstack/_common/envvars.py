"""Every ``TRAINSTACK_*`` environment variable, in one place: its name, who sets it, and what it does.

Code reads them through these constants; the job templates write the same names (a test checks that every
``TRAINSTACK_*`` name in the package and the templates is listed here, and the docs' reference table is generated
from ``VARIABLES``). Torch-free leaf.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, overload

__all__ = ["Variable", "VARIABLES", "positive_number"] + [
    "COMPUTE_SETUP", "ERROR_REPORT", "FAST_TENSOR_PATH", "HANG_DIR", "HANG_TIMEOUT", "JOB_DIR", "NODE_LOG", "NPROCS",
    "INTERRUPT_FILE", "PIN_MEMORY", "PRELOAD", "PROGRESS", "RANK_LOG", "RUN_DIR", "SNAPSHOT", "START_METHOD",
    "SWEEP_ARGS", "SUBMISSION", "SLURM_FN", "STOP_FILE", "STOP_SIGNALS", "SUBMIT_DIR", "TIMEOUT_S", "COMPILE_CACHE",
    "COMPILE_TIMEOUT", "PEAK_TFLOPS", "HOST", "REMOTE_DIR", "REMOTE_TRAINSTACK", "SSH_CONFIG", "SSH_REUSE_ONLY",
    "REMOTE_INDEX_DIR", "REMOTE_SIDE", "MEMORY_DIR", "NODE_NAME", "STRAGGLER_RATIO", "ATTEMPT", "STEP",
    "STORE_TIMEOUT", "PLANNED_WORLD", "CHECKPOINT_STORE", "LEASE", "CLUSTER", "STAGED", "NCCL_TRANSPORT",
    "FAST_EXIT", "GC_FREEZE", "IN_PLACE", "TASK_RANKS", "STANDBY"]


class Variable(NamedTuple):
    name: str
    set_by: str  # "you" (a knob), or the part of trainstack that sets it for its own processes
    meaning: str


VARIABLES: tuple[Variable, ...] = (
    Variable("TRAINSTACK_HANG_TIMEOUT", "you",
             "Seconds without progress on every rank before the hang watchdog reports and exits (default 600; 0: "
             "off). TrainConfig.hang_timeout / Accelerator(hang_timeout=) win over it."),
    Variable("TRAINSTACK_HANG_DIR", "you",
             "Where an Accelerator loop's hang reports go (default: the working folder; the Trainer uses its run "
             "folder)."),
    Variable("TRAINSTACK_TIMEOUT_S", "you",
             "Collective and rendezvous timeout of the process group, in seconds (default 1800)."),
    Variable("TRAINSTACK_FAST_EXIT", "you",
             "0: a rank of a multi-process run that fails with an uncaught exception exits through Python's own "
             "teardown (1-1.5 s with torch loaded) instead of right after its exit handlers and a flush of its open "
             "files (default 1: the teardown's seconds would run beside a recovery's new processes)."),
    Variable("TRAINSTACK_GC_FREEZE", "you",
             "0: keep Python's garbage collector looking at everything loaded before trainstack's training modules "
             "(default 1: torch's and trainstack's objects, which live as long as the process, are frozen out of its "
             "sight -- gc.freeze -- so later imports (torch._dynamo) and full collections in training do not scan "
             "them again: ~0.3 s less per process start)."),
    Variable("TRAINSTACK_COMPILE_CACHE", "you",
             "With compile: the inductor/triton cache folder (default: <run folder>/compile-cache for the Trainer, "
             "<job folder>/compile-cache in a job; a requeued attempt reuses it). TORCHINDUCTOR_CACHE_DIR wins."),
    Variable("TRAINSTACK_COMPILE_TIMEOUT", "you",
             "With compile: seconds the first (compiling) step may take on every rank before the hang watchdog or "
             "a collective gives up (default 1800)."),
    Variable("TRAINSTACK_PEAK_TFLOPS", "you",
             "The dense peak TFLOP/s of one device for MFU in the live lines (default: the peak table for known "
             "GPUs; none on a CPU, so MFU is not shown)."),
    Variable("TRAINSTACK_HOST", "you",
             "The login node (what you type after ssh) that --host commands run on: submit, status, logs, why, "
             "cancel, debug, fetch, checkpoint inspect."),
    Variable("TRAINSTACK_REMOTE_DIR", "you",
             "With --host: the folder on the login node holding the shipped code (default trainstack-remote, in the "
             "remote home)."),
    Variable("TRAINSTACK_REMOTE_TRAINSTACK", "you",
             "With --host: the login node's trainstack executable (default: trainstack on a non-interactive ssh's "
             "PATH)."),
    Variable("TRAINSTACK_SSH_CONFIG", "you", "With --host: an ssh config file of its own instead of ~/.ssh/config."),
    Variable("TRAINSTACK_SSH_REUSE_ONLY", "you",
             "1: --host never opens an ssh connection, only reuses the one you opened (MFA clusters)."),
    Variable("TRAINSTACK_REMOTE_INDEX_DIR", "you",
             "Where the local index of --host submissions lives (default ~/.cache/trainstack)."),
    Variable("TRAINSTACK_REMOTE_SIDE", "trainstack submit --host",
             "Set on the login node for the submission it runs there: a profile's host is not followed again."),
    Variable("TRAINSTACK_PRELOAD", "you",
             "0 turns the workers' preloaded fork server off (workers are spawned); a comma-separated list of modules "
             "preloads those as well (e.g. transformers)."),
    Variable("TRAINSTACK_START_METHOD", "you",
             "Force how workers start: forkserver, spawn or fork (default: forkserver for scripts, fork in "
             "notebooks)."),
    Variable("TRAINSTACK_MEMORY_DIR", "you",
             "Where memory checkpoints (TrainConfig.memory_checkpoint_every_n_steps) live on each node (default "
             "/dev/shm): a memory file system; trainstack-<uid> in it is private (0700)."),
    Variable("TRAINSTACK_NODE_NAME", "you",
             "The node this process counts as for memory checkpoints' copies on another node (default: "
             "SLURMD_NODENAME, else the hostname): for containers whose hostname is not the node's."),
    Variable("TRAINSTACK_STRAGGLER_RATIO", "you",
             "A rank this many times slower in data, forward or optimizer time per step than the median rank of the "
             "other nodes, in three watchdog readings running, is named a straggler (default 1.5; 0: off)."),
    Variable("TRAINSTACK_STORE_TIMEOUT", "you",
             "Seconds one checkpoint-store request may take (S3's read timeout; the reachability check at start), "
             "default 60; the end of a run waits five times that for its last upload. Training never waits for "
             "the store."),
    Variable("TRAINSTACK_CHECKPOINT_STORE", "trainstack",
             "A run across clusters (trainstack submit --cluster ... --store URL): the run's checkpoint store, used "
             "as TrainConfig.checkpoint_store (which must be unset or the same; resume='auto')."),
    Variable("TRAINSTACK_LEASE", "trainstack",
             "required: a checkpoint store without conditional writes is refused (runs across clusters set it); "
             "otherwise such a store commits without the single-writer lease, said once."),
    Variable("TRAINSTACK_NCCL_TRANSPORT", "job scripts",
             "The NCCL network a job requires (ib, efa, socket; --nccl-transport): every NCCL rank checks its host "
             "before NCCL starts and NCCL's own init lines after, and stops with the reason instead of running on "
             "another network."),
    Variable("TRAINSTACK_STAGED", "trainstack",
             "A folder where the run's newest committed checkpoint may wait, pre-staged from its store while the job "
             "was pending (a run across clusters, the cluster profile's scratch): taken from there if it matches its "
             "marker, else downloaded."),
    Variable("TRAINSTACK_CLUSTER", "trainstack",
             "The cluster an attempt runs on, as the run's records name it (default: SLURM_CLUSTER_NAME)."),
    Variable("TRAINSTACK_PIN_MEMORY", "you", "0 turns off pinned host memory for prepared loaders on CUDA."),
    Variable("TRAINSTACK_FAST_TENSOR_PATH", "you",
             "0 turns off the whole-batch indexing of in-memory TensorDatasets (identical batches either way)."),
    Variable("TRAINSTACK_PROGRESS", "you", "1/0 forces the rich progress bar on or off (default: on a terminal)."),
    Variable("TRAINSTACK_STOP_SIGNALS", "you / requeue scripts",
             "Comma-separated signals that ask for a graceful checkpoint-and-stop (default SIGUSR2)."),
    Variable("TRAINSTACK_STOP_FILE", "requeue scripts",
             "A file whose existence asks for a graceful stop; the trainer writes <file>.saved once its checkpoint "
             "is complete."),
    Variable("TRAINSTACK_NPROCS", "job scripts",
             "The processes the job was allocated; it wins over a program's nprocs (with a warning when they "
             "differ)."),
    Variable("TRAINSTACK_COMPUTE_SETUP", "CPU job scripts", "cpu in --cpu scripts: programs may read it."),
    Variable("TRAINSTACK_ATTEMPT", "job scripts",
             "How many times this job ran its program before (0 on the first run): requeues and retries in the same "
             "allocation alike (SLURM_RESTART_COUNT counts requeues only)."),
    Variable("TRAINSTACK_STEP", "--requeue job scripts",
             "The job step of this allocation that runs the program (0, then 1, 2, ... after retries in the "
             "allocation)."),
    Variable("TRAINSTACK_IN_PLACE", "--requeue srun job scripts (you: 0/false/no/off turns it off)",
             "1: a rank that lost a peer keeps its process and waits for the driver's next job step, which starts "
             "only the crashed ranks afresh; the survivors join its new process group and restore in place. 0: "
             "every rank of a failed step is relaunched."),
    Variable("TRAINSTACK_STANDBY", "you",
             "Warm standbys per node of a --requeue srun job: interpreters that have imported torch and trainstack "
             "and wait to become a rank that must start afresh (a crash's replacement, a spare's ranks, a whole "
             "step relaunched). Default: 1 per training node under srun, a node's ranks on an idle spare and on "
             "every node under torchrun; a count of at least --procs-per-node makes a whole-step relaunch warm "
             "too; 0 turns them off."),
    Variable("TRAINSTACK_TASK_RANKS", "the allocation driver",
             "Set on a job step that starts only some ranks beside survivors restarted in place: the global rank of "
             "each of its srun tasks (comma-separated, by SLURM_PROCID); the world is TRAINSTACK_NPROCS."),
    Variable("TRAINSTACK_PLANNED_WORLD", "--min-nodes job scripts",
             "Set on a step that runs on fewer nodes than planned (no spare left): the planned number of processes. "
             "The Trainer keeps the global batch by multiplying gradient_accumulation_steps by planned/actual "
             "where it divides, and says so."),
    Variable("TRAINSTACK_JOB_DIR", "job scripts",
             "This job's folder (task folder for an array task): rank logs, hang reports, debug requests."),
    Variable("TRAINSTACK_RUN_DIR", "sweep scripts",
             "The run folder of a sweep task (named by its arguments' signature); the Trainer uses it, also over a "
             "log_folder the script sets (every task would share that one)."),
    Variable("TRAINSTACK_SWEEP_ARGS", "sweep scripts",
             "A sweep task's own arguments: part of the run's identity, so a resume with other swept values is "
             "refused."),
    Variable("TRAINSTACK_SUBMISSION", "submit --host (on the login node)",
             "The laptop's token for one submission: the job carries it (sbatch --comment) and the index records "
             "it, so a submission whose connection dropped is found, never made twice."),
    Variable("TRAINSTACK_SNAPSHOT", "trainstack submit",
             "The submitting folder relative to the repository: the job runs <job folder>/code/<this>."),
    Variable("TRAINSTACK_SUBMIT_DIR", "job scripts", "The folder the job was submitted from."),
    Variable("TRAINSTACK_RANK_LOG", "job scripts / the runtime",
             "This process's own log file (set once a process tees its output: not teed twice)."),
    Variable("TRAINSTACK_NODE_LOG", "custom-launcher job scripts", "This node's own log file."),
    Variable("TRAINSTACK_ERROR_REPORT", "the runtime",
             "Where a spawned worker reports why it stopped (a private file the launching process reads as text)."),
    Variable("TRAINSTACK_INTERRUPT_FILE", "the runtime",
             "A private file the launching process creates at the first Ctrl-C: spawned Trainer workers stop at the "
             "next step boundary with a checkpoint."),
    Variable("TRAINSTACK_SLURM_FN", "the generated batch script (slurm_fn with use_distributed_env)",
             "Set to 1 in the job: the script the distributed launch command starts again calls the slurm_fn "
             "function instead of submitting it."),
)

_BY_NAME = {v.name: v for v in VARIABLES}
HANG_TIMEOUT, HANG_DIR, TIMEOUT_S = "TRAINSTACK_HANG_TIMEOUT", "TRAINSTACK_HANG_DIR", "TRAINSTACK_TIMEOUT_S"
PRELOAD, START_METHOD, PIN_MEMORY = "TRAINSTACK_PRELOAD", "TRAINSTACK_START_METHOD", "TRAINSTACK_PIN_MEMORY"
FAST_TENSOR_PATH, PROGRESS = "TRAINSTACK_FAST_TENSOR_PATH", "TRAINSTACK_PROGRESS"
STOP_SIGNALS, STOP_FILE, NPROCS = "TRAINSTACK_STOP_SIGNALS", "TRAINSTACK_STOP_FILE", "TRAINSTACK_NPROCS"
COMPUTE_SETUP, JOB_DIR, RUN_DIR = "TRAINSTACK_COMPUTE_SETUP", "TRAINSTACK_JOB_DIR", "TRAINSTACK_RUN_DIR"
SNAPSHOT, SUBMIT_DIR, RANK_LOG = "TRAINSTACK_SNAPSHOT", "TRAINSTACK_SUBMIT_DIR", "TRAINSTACK_RANK_LOG"
NODE_LOG, ERROR_REPORT, INTERRUPT_FILE = "TRAINSTACK_NODE_LOG", "TRAINSTACK_ERROR_REPORT", "TRAINSTACK_INTERRUPT_FILE"
SLURM_FN, SWEEP_ARGS, SUBMISSION = "TRAINSTACK_SLURM_FN", "TRAINSTACK_SWEEP_ARGS", "TRAINSTACK_SUBMISSION"
COMPILE_CACHE, COMPILE_TIMEOUT = "TRAINSTACK_COMPILE_CACHE", "TRAINSTACK_COMPILE_TIMEOUT"
PEAK_TFLOPS = "TRAINSTACK_PEAK_TFLOPS"
HOST, REMOTE_DIR, REMOTE_TRAINSTACK = "TRAINSTACK_HOST", "TRAINSTACK_REMOTE_DIR", "TRAINSTACK_REMOTE_TRAINSTACK"
SSH_CONFIG, SSH_REUSE_ONLY, REMOTE_INDEX_DIR = ("TRAINSTACK_SSH_CONFIG", "TRAINSTACK_SSH_REUSE_ONLY",
                                                "TRAINSTACK_REMOTE_INDEX_DIR")
REMOTE_SIDE = "TRAINSTACK_REMOTE_SIDE"
MEMORY_DIR, NODE_NAME = "TRAINSTACK_MEMORY_DIR", "TRAINSTACK_NODE_NAME"
STRAGGLER_RATIO = "TRAINSTACK_STRAGGLER_RATIO"
STORE_TIMEOUT = "TRAINSTACK_STORE_TIMEOUT"
CHECKPOINT_STORE, LEASE, CLUSTER = "TRAINSTACK_CHECKPOINT_STORE", "TRAINSTACK_LEASE", "TRAINSTACK_CLUSTER"
STAGED, NCCL_TRANSPORT = "TRAINSTACK_STAGED", "TRAINSTACK_NCCL_TRANSPORT"
FAST_EXIT, GC_FREEZE = "TRAINSTACK_FAST_EXIT", "TRAINSTACK_GC_FREEZE"
ATTEMPT, STEP, PLANNED_WORLD = "TRAINSTACK_ATTEMPT", "TRAINSTACK_STEP", "TRAINSTACK_PLANNED_WORLD"
IN_PLACE, TASK_RANKS, STANDBY = "TRAINSTACK_IN_PLACE", "TRAINSTACK_TASK_RANKS", "TRAINSTACK_STANDBY"
assert all(name in _BY_NAME for name in (HANG_TIMEOUT, HANG_DIR, TIMEOUT_S, PRELOAD, START_METHOD, PIN_MEMORY,
                                         FAST_TENSOR_PATH, PROGRESS, STOP_SIGNALS, STOP_FILE, NPROCS, COMPUTE_SETUP,
                                         JOB_DIR, RUN_DIR, SNAPSHOT, SUBMIT_DIR, RANK_LOG, NODE_LOG, ERROR_REPORT,
                                         INTERRUPT_FILE, COMPILE_CACHE, COMPILE_TIMEOUT,
                                         PEAK_TFLOPS, HOST, REMOTE_DIR, REMOTE_TRAINSTACK, SSH_CONFIG,
                                         SSH_REUSE_ONLY, REMOTE_INDEX_DIR, REMOTE_SIDE, MEMORY_DIR, NODE_NAME,
                                         STRAGGLER_RATIO, ATTEMPT, STEP, STORE_TIMEOUT, PLANNED_WORLD,
                                         CHECKPOINT_STORE, LEASE, CLUSTER, STAGED, NCCL_TRANSPORT, FAST_EXIT,
                                         GC_FREEZE, IN_PLACE, TASK_RANKS, STANDBY))


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def switch(name: str, default: bool = True, env: Mapping[str, str] | None = None) -> bool:
    """The on/off variable ``name`` (1/true/yes/on, 0/false/no/off, any case; ``default`` when unset or empty); a
    ValueError naming the value otherwise -- never read as the opposite of what was meant."""
    import os

    raw = (os.environ if env is None else env).get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _ON or raw in _OFF:
        return raw in _ON
    raise ValueError(f"{name}={raw!r} is neither on ({'/'.join(_ON)}) nor off ({'/'.join(_OFF)})")


@overload
def positive_number(name: str, default: float, allow_zero: bool = False) -> float: ...
@overload
def positive_number(name: str, default: None = None, allow_zero: bool = False) -> float | None: ...
def positive_number(name: str, default: float | None = None, allow_zero: bool = False) -> float | None:
    """The positive (``allow_zero``: or zero) number variable ``name`` holds (``default`` when unset); a ValueError
    saying what is wrong otherwise, for the caller to raise as its own error with its hint."""
    import os

    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 if allow_zero else value > 0):
        raise ValueError(f"{name}={raw!r} must be a {'number >= 0' if allow_zero else 'positive number'}")
    return value
