"""One writer per run, wherever it runs: a lease object in the run's checkpoint store, taken with the store's own
conditional writes, and the epoch it gives written into every commit marker.

Each attempt of a run (another job, another cluster) takes the lease at its start: ``lease.json`` is created only if
absent (S3 ``If-None-Match: *``) or replaced only if unchanged since it was read (``If-Match: <ETag>``), so two
attempts that start together cannot both win; the winner's epoch is one more than the last, and the record keeps
every epoch with the step its lineage starts from (the newest committed checkpoint when it was taken). A writer
checks that the lease still holds its epoch before it writes a commit marker, and stops -- without committing --
when another attempt took the run over. A marker written by a stale writer in the instant between that check and
the write is outside the lineage: readers pass over any marker whose epoch is older than a later epoch that starts
before its step. So two clusters running one run at once end with exactly one committed lineage.

Each epoch also leaves ``attempts/epoch-NNNN.json`` beside it: where it ran (cluster, job, host) and what on (GPU
model, driver, CUDA, NCCL, torch, processes), so ``trainstack status STORE_URL`` shows the run across clusters and
each attempt says which of its guarantees held. A local folder (a shared file system) gets the same semantics from
an exclusive lock beside the lease; a store with no conditional writes trainstack knows is refused for a lease,
loudly. Torch-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import posixpath
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, ConfigError
from . import envvars as envvars

__all__ = ["Lease", "StaleLease", "LeaseConflict", "history", "attempts", "in_lineage", "portability",
           "LEASE"]

LEASE = "lease.json"
ATTEMPTS = "attempts"
log = logging.getLogger("trainstack")


class StaleLease(CheckpointError):
    """Another attempt took this run over: this writer must not commit (the message names the new holder)."""


class LeaseConflict(CheckpointError):
    """A conditional write lost a race (the object changed or appeared since it was read)."""


def _protocols(fs: Any) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


class _Conditional:
    """The two conditional operations a lease needs, on the store's own fsspec filesystem: read an object with its
    tag, and write it only if it is absent (``tag=None``) or still carries ``tag``."""

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs, self.root, self.url = fs, root.rstrip("/"), url
        protocols = _protocols(fs)
        if "s3" in protocols or "s3a" in protocols:
            self.kind = "s3"
        elif "file" in protocols or "local" in protocols:
            self.kind = "local"
        else:
            raise ConfigError(f"checkpoint store {url}: trainstack knows no conditional write for {protocols[0]}:// "
                              f"(it uses S3's If-None-Match/If-Match and a lock on a shared file system), so it "
                              f"cannot keep one writer per run there. HINT: an s3:// store (any S3-compatible server "
                              f"with conditional writes) or a shared folder.")

    def _key(self, name: str) -> tuple[str, str]:
        bucket, _, prefix = self.root.partition("/")
        return bucket, posixpath.join(prefix, name) if prefix else name

    def read(self, name: str) -> tuple[bytes, str] | None:
        if self.kind == "s3":
            bucket, key = self._key(name)
            try:
                got = self.fs.call_s3("get_object", Bucket=bucket, Key=key)
            except FileNotFoundError:
                return None
            from fsspec.asyn import sync

            data = sync(self.fs.loop, got["Body"].read)  # aiobotocore's stream, read on s3fs's own loop
            return bytes(data), str(got["ETag"])
        path = posixpath.join(self.root, name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        return data, hashlib.sha256(data).hexdigest()

    def write(self, name: str, data: bytes, tag: str | None) -> str:
        if self.kind == "s3":
            bucket, key = self._key(name)
            condition = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
            try:
                put = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
            except Exception as exc:  # noqa: BLE001 -- s3fs translates botocore's errors its own way
                if _precondition_failed(exc):
                    raise LeaseConflict(f"{self.url}/{name} changed since it was read") from None
                raise
            return str(put["ETag"])
        os.makedirs(self.root, exist_ok=True)
        path = posixpath.join(self.root, name)
        with self._locked():
            current = self.read(name)
            if (current is None) != (tag is None) or (current is not None and current[1] != tag):
                raise LeaseConflict(f"{path} changed since it was read")
            temp = f"{path}.{os.getpid()}.tmp"
            with open(temp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        return hashlib.sha256(data).hexdigest()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        import fcntl

        with open(posixpath.join(self.root, ".lease.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _precondition_failed(exc: BaseException) -> bool:
    """S3's 412 (the condition did not hold) or 409 (a concurrent conditional write), as s3fs or botocore say it."""
    if isinstance(exc, FileExistsError):  # s3fs's translation of PreconditionFailed
        return True
    text = f"{type(exc).__name__} {exc} {getattr(exc, 'response', '')}"
    return any(word in text for word in ("PreconditionFailed", "pre-conditions", "ConditionalRequestConflict"))


@dataclass
class Lease:
    """This attempt's hold on a run's store. ``take`` once at the start (rank 0), ``check`` before each commit."""

    fs: Any
    root: str
    url: str
    holder: dict[str, Any]
    epoch: int = 0

    def __post_init__(self) -> None:
        self._io = _Conditional(self.fs, self.root, self.url)

    def take(self, base_step: int | None, fingerprint: dict[str, Any] | None = None, tries: int = 5) -> int:
        """Become the run's writer: the next epoch -- above every epoch the lease and the attempt records ever
        named, so none is used twice even if ``lease.json`` was rewritten -- starting the lineage at ``base_step``
        (the newest committed checkpoint's step, None for a fresh run). Retried when another attempt takes it at the
        same moment."""
        for _ in range(tries):
            current = self._io.read(LEASE)
            try:
                found = json.loads(current[0]) if current else {}
            except ValueError:
                found = {}
            epochs = _epochs(found.get("epochs") if isinstance(found, dict) else None, self.url)
            epoch = max([e["epoch"] for e in epochs] + [_recorded_epoch(self.fs, self.root)], default=0) + 1
            entry = {"epoch": epoch, "base_step": base_step, "taken": time.time(), **self.holder}
            record = {"epoch": epoch, "holder": self.holder, "epochs": [*epochs, entry]}
            try:
                self._io.write(LEASE, json.dumps(record, indent=1).encode(), current[1] if current else None)
            except LeaseConflict:
                continue
            self.epoch = epoch
            attempt = {**entry, "fingerprint": fingerprint or {}}
            if self._io.kind == "local":  # object stores have no folders
                self.fs.makedirs(posixpath.join(self.root, ATTEMPTS), exist_ok=True)
            try:  # created, never replaced: an attempt's record is its own
                self._io.write(posixpath.join(ATTEMPTS, f"epoch-{epoch:04d}.json"),
                               json.dumps(attempt, indent=1).encode(), None)
            except LeaseConflict:
                raise CheckpointError(f"{self.url}: the attempt record of epoch {epoch} already exists although the "
                                      f"lease was just taken at that epoch: another writer is tampering with the "
                                      f"store") from None
            return epoch
        raise LeaseConflict(f"{self.url}: the lease changed {tries} times while this attempt tried to take it")

    def note(self, **fields: Any) -> None:
        """Add ``fields`` to this attempt's record (its own object: no other writer touches it)."""
        path = posixpath.join(self.root, ATTEMPTS, f"epoch-{self.epoch:04d}.json")
        record = _record(self.fs, path)
        self.fs.pipe_file(path, json.dumps({**(record if isinstance(record, dict) else {}), **fields},
                                           indent=1).encode())

    def check(self) -> None:
        """Raise ``StaleLease`` when another attempt holds the run now: called before every commit marker."""
        current = self._io.read(LEASE)
        try:
            record = json.loads(current[0]) if current else {}
        except ValueError:
            record = {}
        record = record if isinstance(record, dict) else {}
        if record.get("epoch") != self.epoch:
            holder = record.get("holder") or {}
            raise StaleLease(f"another attempt took this run over: {self.url} is held at epoch {record.get('epoch')} "
                             f"by {_where(holder)}, and this writer holds epoch {self.epoch}. It stops without "
                             f"committing, so the run keeps one lineage (trainstack status {self.url}).")


def holder_here(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, Any]:
    """Who is taking the lease: the cluster, job and host (Slurm's names where they are)."""
    return {"cluster": environ.get(envvars.CLUSTER) or environ.get("SLURM_CLUSTER_NAME") or "local",
            "job": environ.get("SLURM_JOB_ID"), "host": socket.gethostname(), "pid": os.getpid()}


def _where(holder: dict[str, Any]) -> str:
    job = f" job {holder['job']}" if holder.get("job") else ""
    return f"{holder.get('cluster', '?')}{job} on {holder.get('host', '?')}"


#: A lease record or an attempt record is small: more is not one trainstack wrote.
RECORD_BYTES = 16 << 20


def _record(fs: Any, path: str) -> object:
    """A record read back from the store as data: bounded, JSON; ``Unreadable`` naming it otherwise (a missing one
    raises FileNotFoundError)."""
    raw = fs.cat_file(path, start=0, end=RECORD_BYTES + 1)
    if len(raw) > RECORD_BYTES:
        raise Unreadable(f"{path} holds more than {RECORD_BYTES} bytes: not a record trainstack wrote")
    try:
        return json.loads(raw)
    except ValueError:
        raise Unreadable(f"{path} is not JSON: a damaged or foreign record") from None


class Unreadable(CheckpointError):
    """A record in the store that is not one trainstack wrote (passed over, said)."""


def history(fs: Any, root: str, url: str | None = None) -> list[dict[str, Any]]:
    """The lease's epochs, oldest first ([] for a store no attempt took a lease on, or an unreadable lease --
    said, naming it)."""
    path = posixpath.join(root.rstrip("/"), LEASE)
    try:
        record = _record(fs, path)
    except FileNotFoundError:
        return []
    except Unreadable as exc:
        log.warning("trainstack: passing over the lease: %s", exc)
        return []
    if not isinstance(record, dict):
        log.warning("trainstack: passing over the lease: %s is not a lease record", url or path)
        return []
    return _epochs(record.get("epochs", []), url or path)


def _epochs(value: object, where: str = "the lease") -> list[dict[str, Any]]:
    """The well-formed epochs of a lease record's ``epochs`` (the store is data, checked before it is used): each
    a positive integer, strictly increasing, with a base step that is a non-negative integer or None; anything else
    is passed over, said."""
    if not isinstance(value, list):
        return []
    kept: list[dict[str, Any]] = []
    for e in value:
        epoch = e.get("epoch") if isinstance(e, dict) else None
        base = e.get("base_step") if isinstance(e, dict) else None
        if type(epoch) is int and epoch > 0 and (base is None or (type(base) is int and base >= 0)) and \
                (not kept or epoch > kept[-1]["epoch"]):
            kept.append(e)
        else:
            log.warning("trainstack: passing over an epoch of %s that is not a positive integer above the one "
                        "before it with a step from which it starts: %.120r", where, e)
    return kept


def attempts(fs: Any, root: str, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """Every attempt's record (``attempts/epoch-NNNN.json``), oldest first; a record that is not a JSON object is
    passed over (named in ``problems`` when given, else said)."""
    folder = posixpath.join(root.rstrip("/"), ATTEMPTS)
    fs.invalidate_cache(folder)
    try:
        names = sorted(fs.ls(folder, detail=False))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            record = _record(fs, name)
        except (FileNotFoundError, Unreadable) as exc:
            record = str(exc) if not isinstance(exc, FileNotFoundError) else None
        if isinstance(record, dict):
            found.append(record)
        elif record is not None:
            why = record if isinstance(record, str) else f"{name} is not an object: {str(record)[:80]!r}"
            problems.append(why) if problems is not None else log.warning("trainstack: passing over %s", why)
    return found


def _recorded_epoch(fs: Any, root: str) -> int:
    """The highest epoch an attempt record is named for (0 without one)."""
    folder = posixpath.join(root.rstrip("/"), ATTEMPTS)
    fs.invalidate_cache(folder)  # s3fs caches listings: a record written since must count
    try:
        names = fs.ls(folder, detail=False)
    except FileNotFoundError:
        return 0
    numbers = [posixpath.basename(n)[6:-5] for n in names if posixpath.basename(n).startswith("epoch-")
               and n.endswith(".json")]
    return max((int(n) for n in numbers if n.isdigit() and len(n) < 12), default=0)


def in_lineage(step: int, epoch: int | None, epochs: list[dict[str, Any]]) -> bool:
    """A marker of ``epoch`` at ``step`` belongs to the run's one lineage unless a later epoch started before it:
    a writer that lost the lease committed it (markers from before leases have no epoch: 0)."""
    mine = epoch or 0
    return not any(e["epoch"] > mine and (e.get("base_step") or 0) < step for e in epochs)


# What must match for a resumed attempt to be bitwise equal to one that never moved; the data position and the
# optimizer state hold across any of them (exact resume at any world size).
_BITWISE = ("gpu", "driver", "cuda", "nccl", "torch", "world_size", "layout")


def portability(before: dict[str, Any] | None, now: dict[str, Any]) -> str:
    """The guarantee an attempt keeps relative to the one before it, in one sentence."""
    if not before:
        return "first attempt of this run"
    changed = [f"{k} {before.get(k)} -> {now.get(k)}" for k in _BITWISE if before.get(k) != now.get(k)]
    exact = "exact data position and optimizer state hold"
    if not changed:
        return f"{exact}; bitwise equality held (same GPU model, driver, CUDA, NCCL, torch and layout)"
    return f"{exact}; bitwise equality NOT guaranteed: {', '.join(changed)}"


def describe(url: str) -> list[str]:
    """``trainstack status STORE_URL``: the run's attempts across clusters, each with what it kept."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    try:
        fs.ls(root, detail=False)
    except FileNotFoundError:
        return [f"{url}: no such bucket or prefix (nothing is stored there)"]
    except Exception as exc:  # noqa: BLE001 -- botocore's connection errors and the like
        raise CheckpointError(f"cannot read the checkpoint store {url}: {type(exc).__name__}: {exc}. HINT: check the "
                              f"endpoint (AWS_ENDPOINT_URL) is up and reachable, and the credentials.") from None
    problems: list[str] = []
    records = attempts(fs, root, problems)
    try:
        lease = _record(fs, posixpath.join(root.rstrip("/"), LEASE))
    except FileNotFoundError:
        lease = {}
    except Unreadable as exc:
        return [f"{url}: {exc}"]
    if not isinstance(lease, dict):
        return [f"{url}: its {LEASE} is not a lease record ({str(lease)[:80]!r}): not one trainstack wrote"]
    epochs = {e["epoch"]: e for e in _epochs(lease.get("epochs", []), url)}
    if not epochs:
        return [f"{url}: no attempt took a lease here (not a run's checkpoint store, or a run from before leases)"]
    current = max(epochs)
    lines = [f"{url}: {len(epochs)} attempt(s); the writer now is epoch {current} ({_where(epochs[current])})"]
    before: dict[str, Any] | None = None
    for record in records:
        if not isinstance(record, dict):
            lines.append(f"  (an attempt record that is not an object: {str(record)[:80]!r})")
            continue
        base = record.get("base_step")
        start = f"from step {base:,}" if isinstance(base, int) else "fresh"
        when = _when(record.get("taken"))
        given = record.get("fingerprint")
        fingerprint: dict[str, Any] = given if isinstance(given, dict) else {}
        lines.append(f"  epoch {record.get('epoch', '?')}: {_where(record)}, {start}, at {when}; "
                     f"{portability(before, fingerprint)}")
        before = fingerprint
    return lines + [f"  (passed over: {why})" for why in problems]


def _when(taken: object) -> str:
    """A record's time as local time, or 'an unknown time' (a forged 1e300 or NaN is data, not a crash)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(taken))  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError, OSError):
        return "an unknown time"
