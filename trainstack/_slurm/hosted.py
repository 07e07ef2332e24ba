"""``--host``: a trainstack command run on a cluster's login node from a laptop (see ``.ssh``).

``status``/``logs``/``cancel``/``debug``/``why``/``checkpoint inspect`` run there as they would here (one remote
command per call, the same squeue -> sacct -> job-folder logic); ``submit`` first ships the code (the git working
tree, uncommitted changes included, without what git ignores) into ``<remote dir>/code/<repo>`` with rsync --
incremental between submissions -- and submits from there, where the remote submit snapshots it into the job folder
as usual (an edit made after submission reaches neither); ``fetch`` copies a job folder back. Jobs submitted from
here are kept in a private local index (0600). Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from .._common import envvars as envvars
from .._common.files import atomic_write
from .._common.version import __version__
from .progress import Progress
from .ssh import Remote, RemoteError

__all__ = ["run_hosted", "submit_hosted", "fetch_job", "remote_for", "index_path", "remote_table"]


def remote_for(host: str) -> Remote:
    """The host's Remote, with TRAINSTACK_REMOTE_TRAINSTACK (its trainstack executable) and
    TRAINSTACK_SSH_REUSE_ONLY=1 (never open a connection: MFA hosts) applied."""
    return Remote(host, os.environ.get(envvars.REMOTE_TRAINSTACK, "trainstack"),
                  reuse_only=os.environ.get(envvars.SSH_REUSE_ONLY, "") in ("1", "true", "yes"))


def run_hosted(host: str, args: list[str], follow: bool = False) -> int:
    """Run ``trainstack ARGS`` on ``host`` with its output here; its exit status."""
    remote = remote_for(host)
    if follow:
        return remote.follow(args)
    code = remote.stream(remote.trainstack_command(args))
    if code == 255:
        remote.run(["true"])  # says why the connection failed (a RemoteError)
    return code


def _repo_root(cwd: Path) -> Path:
    out = subprocess.run(["git", "-C", str(cwd), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if out.returncode != 0:
        raise RemoteError(f"submit --host ships a git working tree, and {cwd} is not in one. HINT: git init (the "
                          f"files git ignores are not shipped), or submit on the login node.")
    return Path(out.stdout.strip())


def ship(remote: Remote, cwd: Path, remote_dir: str) -> tuple[str, str, int, int]:
    """The working tree (tracked and untracked files, not the ignored ones) into a new folder of its own under
    ``<remote_dir>/code/<repo>/``, unchanged files hard-linked from the previous submission's (rsync
    ``--link-dest``: only what changed is sent); (the folder to submit from, the submission's folder, files,
    bytes sent). Each submission's copy is never written again: its job and every requeue run exactly it."""
    root = _repo_root(cwd)
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"],
                            capture_output=True, check=True).stdout.split(b"\0")
    # names as bytes all the way (any byte but NUL is a valid file name: non-UTF-8, a newline)
    files = [f for f in listed if f and (root / os.fsdecode(f)).is_file()]
    tag = hashlib.sha256(str(root).encode()).hexdigest()[:8]
    base = f"{remote_dir.rstrip('/')}/code/{root.name}-{tag}"
    submission = f"{base}/{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"
    remote.run(["mkdir", "-p", submission])
    with tempfile.NamedTemporaryFile("wb", suffix=".files", delete=False) as fh:
        fh.write(b"\0".join(files) + b"\0")
    try:
        # --checksum: an edit within the same second keeps a file's size and mtime, which rsync would trust;
        # --from0: the list is NUL-separated, as git gave it (a newline in a name cannot split one into two)
        sent = remote.rsync([f"{root}/"], f"{submission}/", files_from=Path(fh.name),
                            extra=["--link-dest=../latest", "--checksum", "--from0"])
    finally:
        os.unlink(fh.name)
    sub = cwd.resolve().relative_to(root.resolve())
    return (f"{submission}/{sub}" if str(sub) != "." else submission), submission, len(files), sent


def submit_hosted(host: str, remote_dir: str, args: list[str], cwd: Path) -> int:
    """Ship the code, then ``trainstack ARGS`` (a submit command line) from it on ``host``; the job goes into the
    local index."""
    remote = remote_for(host)
    theirs = remote.trainstack_version()
    if theirs != __version__:
        print(f"warning: trainstack {theirs} on {host}, {__version__} here: the job is rendered by {host}'s "
              f"version", file=sys.stderr)
    started = time.monotonic()
    folder, submission, files, sent = ship(remote, cwd, remote_dir)
    print(f"shipped {files} file(s) to {host}:{submission} ({sent:,} bytes sent, {time.monotonic() - started:.1f} "
          f"s)", file=sys.stderr)
    latest = submission.rsplit("/", 1)[0] + "/latest"  # the next submission links its unchanged files from here
    token = uuid.uuid4().hex  # the job carries it: a dropped connection cannot make the user submit twice
    cd_and_run = ["sh", "-c", f'ln -sfn "$1" "$2" && cd "$3" && shift 3 && exec env {envvars.REMOTE_SIDE}=1 '
                  f'{envvars.SUBMISSION}={token} "$@"', "sh", submission.rsplit("/", 1)[1], latest, folder,
                  remote.trainstack, *args]
    try:
        out = remote.run(cd_and_run, timeout=300, check=False)
    except RemoteError as exc:
        return _lost_submission(remote, host, remote_dir, folder, token, str(exc))
    sys.stdout.write(out.stdout)
    sys.stderr.write(out.stderr)
    job = next((w for line in out.stdout.splitlines() if line.startswith("job ") for w in line.split()[1:2]), None)
    if out.returncode == 0 and job and job.replace("_", "").isdigit():
        _index_add({"host": host, "job": job, "remote_dir": remote_dir, "code": folder, "time": time.time()})
    return out.returncode


def _lost_submission(remote: Remote, host: str, remote_dir: str, folder: str, token: str, why: str,
                     wait_s: float = 30.0) -> int:
    """The connection dropped while the login node submitted: ask again (a new connection) whether a job carries
    the token -- the remote submit may still be running -- and say which it is; never "failed" when it ran."""
    deadline, job, reached = time.monotonic() + wait_s, None, False
    while time.monotonic() < deadline:
        try:
            out = remote.run([remote.trainstack, "status", "--submission", token], timeout=60, check=False)
            reached = True
            job = json.loads(out.stdout.strip().splitlines()[-1]).get("job") if out.stdout.strip() else None
        except (RemoteError, ValueError, AttributeError):
            job = None
        if job:
            break
        time.sleep(2)
    if job:
        _index_add({"host": host, "job": job, "remote_dir": remote_dir, "code": folder, "time": time.time()})
        print(f"trainstack: the connection to {host} dropped during the submission, but it was submitted: job "
              f"{job} (recorded; trainstack status --host {host} {job})", file=sys.stderr)
        print(f"job {job} (submitted on {host})")
        return 0
    known = (f"no job on {host} carries this submission ({token}): it was not submitted. HINT: submit again" if
             reached else f"{host} cannot be reached to tell whether it was submitted. HINT: once it answers, "
                          f"`trainstack status --host {host}` lists it if it was (its Slurm comment is "
                          f"trainstack-submission:{token})")
    raise RemoteError(f"the connection to {host} dropped during the submission ({why.split('. HINT')[0]}); {known}.")


def fetch_job(host: str, job: str, output: Path | None, what: str = "job") -> Path:
    """Copy from ``host`` job ``job``'s folder (``what="job"``: logs, rank logs, metadata, verdicts), its Trainer's
    run folder (``"run"``: metrics, config, checkpoints) or only the run's checkpoints (``"checkpoints"``)."""
    remote = remote_for(host)
    rows = remote_json(remote.run([remote.trainstack, "status", "--json", job]).stdout, host)
    folder = next((r.get("folder") for r in rows if r.get("folder")), None)
    if not folder:
        raise RemoteError(f"job {job} on {host} has no job folder to fetch (was it submitted by trainstack?)")
    source = folder.rstrip("/")
    if what in ("run", "checkpoints"):
        named = remote.run(["cat", f"{source}/run-folder"], check=False)
        if named.returncode != 0 or not named.stdout.strip():
            raise RemoteError(f"job {job} on {host} names no run folder (a Trainer writes <job folder>/run-folder "
                              f"once it starts). HINT: fetch --what job for its logs.")
        source = named.stdout.strip() + ("/checkpoints" if what == "checkpoints" else "")
    target = output or Path("fetched") / f"{host.replace('@', '_')}-{job}" / what
    target.mkdir(parents=True, exist_ok=True)
    # the compile cache is code a warm start runs: never brought from the cluster into a laptop's run folder
    remote.rsync([f"{source}/"], f"{target}/", pull=True, extra=["--exclude=/compile-cache/"])
    return target


def remote_json(text: str, host: str) -> list:
    """The JSON list a remote ``status --json`` printed, after whatever a login shell printed before it (a banner,
    a module's notice); a clear error when there is none."""
    start = next((i for i, line in enumerate(text.splitlines()) if line.startswith("[")), None)
    try:
        found = json.loads("\n".join(text.splitlines()[start:])) if start is not None else None
    except ValueError:
        found = None
    if not isinstance(found, list):
        raise RemoteError(f"unexpected output from the trainstack on {host} (no job list): {text.strip()[:300]!r}. "
                          f"HINT: `ssh {host} trainstack status --json` shows what it prints; a login script that "
                          f"prints should do so only for interactive shells.")
    return found


def index_path() -> Path:
    """The local index of jobs submitted with --host (0600 in a 0700 folder)."""
    folder = Path(os.environ.get(envvars.REMOTE_INDEX_DIR) or Path.home() / ".cache" / "trainstack")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder / "remote-jobs.json"


def index_rows() -> list[dict[str, Any]]:
    try:
        rows = json.loads(index_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return rows if isinstance(rows, list) else []


def _index_add(row: dict[str, Any]) -> None:
    rows = index_rows()[-499:] + [row]
    atomic_write(index_path(), json.dumps(rows), mode=0o600)


def remote_table(limit: int = 20) -> str | None:
    """The jobs submitted from here with --host, newest last, their state asked from each host in one command
    (HOST, JOB, STATE, PROGRESS, LAST METRIC); None when there are none. A host that cannot be reached says so."""
    rows = index_rows()[-limit:]
    if not rows:
        return None
    lines = ["HOST  JOB  STATE  PROGRESS  LAST METRIC"]
    by_host: dict[str, list[str]] = {}
    for row in rows:
        by_host.setdefault(row["host"], []).append(str(row["job"]))
    for host, jobs in by_host.items():
        try:
            remote = remote_for(host)
            found = remote_json(remote.run([remote.trainstack, "status", "--json", *jobs], timeout=60).stdout,
                                host)
        except (RemoteError, ValueError) as exc:
            lines.append(f"{host}  {', '.join(jobs)}  ?  ({str(exc)[:160]})")
            continue
        for item in found:
            progress = Progress.from_dict(item["progress"]).cell() if item.get("progress") else "-"
            lines.append(f"{host}  {item.get('job')}  {item.get('state')}  {progress}  {item.get('metric') or ''}"
                         .rstrip())
    return "\n".join(lines)
