"""Durable checkpoints in an object store (``s3://``, ``gs://``, any fsspec URL), committed like local ones.

A checkpoint is first committed in the run folder as always (the local disk absorbs the save's stall); rank 0 then
uploads it off the training thread and commits it there::

    s3://bucket/exp/ckpt-e00002-s000000040.pt            a file checkpoint, or
    s3://bucket/exp/ckpt-e00002-s000000040/...           a sharded (DCP) folder's objects
    s3://bucket/exp/ckpt-e00002-s000000040.committed     written last: every object, its size and its sha256

A checkpoint counts only with its ``.committed`` marker: a save killed mid-upload leaves objects without one, and the
previous checkpoint stays the newest (the next upload of the same name replaces them). Removing deletes the marker
first. Training never waits for the store: every request is bounded (``TRAINSTACK_STORE_TIMEOUT``, 60 s by default:
S3's connect and read timeouts, two attempts), the check at start is bounded, a save made while an upload runs waits
in a slot of one (a newer save replaces it: said), and the end of a run waits for the last upload a bounded time.
``resume="auto"`` downloads the newest committed checkpoint when the run folder has none as new (another machine, a
lost disk); its objects are checked against the marker and a listing of its prefix (names, sizes, and each object's
sha256 once downloaded -- a pre-staged copy is adopted only when every sha256 matches). Credentials and
endpoints come from the store's own client configuration (for S3: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
``AWS_ENDPOINT_URL``, ``~/.aws``; fsspec's ``FSSPEC_S3_*`` variables), never from the URL (masked where shown).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._common import envvars as envvars
from .._common.files import deny_others_write, own_folder, temp_path, url_scheme
from .._common.lease import Lease, StaleLease, history, in_lineage
from ..errors import CheckpointError, ConfigError
from .retention import rotate

log = logging.getLogger("trainstack")

__all__ = ["Store", "Uploads", "COMMITTED", "stage", "adopt"]

COMMITTED = ".committed"
MARKER_BYTES = 16 << 20  # a marker lists names, sizes and digests: a sharded checkpoint of 100k objects fits
_NAME = re.compile(r"^ckpt-e(\d+)-s(\d+)(\.pt)?$")
#: The extra (pip) that brings a protocol's fsspec implementation.
_EXTRAS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def store_timeout() -> float:
    """Seconds one store request may take (``TRAINSTACK_STORE_TIMEOUT``, default 60): S3's read timeout, the check
    at start; the end of a run waits five times that for its last upload."""
    try:
        return envvars.positive_number(envvars.STORE_TIMEOUT, 60.0)
    except ValueError as exc:
        raise ConfigError(f"{exc}. HINT: seconds, e.g. {envvars.STORE_TIMEOUT}=120") from None


def _options(scheme: str, timeout: float) -> dict[str, Any]:
    """The client options that bound every request of a protocol (S3: connect and read timeouts, two attempts)."""
    if scheme in ("s3", "s3a"):
        return {"config_kwargs": {"connect_timeout": min(10.0, timeout), "read_timeout": timeout,
                                  "retries": {"max_attempts": 2, "mode": "standard"}}}
    return {}


class Store:
    """One run's checkpoint location behind a URL: list what is committed, upload, download, remove. ``url`` is the
    URL as shown (credentials written into it masked); the client gets the URL as given."""

    def __init__(self, url: str) -> None:
        import fsspec

        given = str(url).rstrip("/")
        self.secret = _userinfo(given)
        self.url = self.masked(given)
        scheme = url_scheme(given) or "file"
        self.timeout = store_timeout()
        self._said_dropped: list[str] = []
        try:
            self.fs, self.root = fsspec.core.url_to_fs(given, **_options(scheme, self.timeout))
        except ImportError as exc:
            package = _EXTRAS.get(scheme, f"the fsspec implementation of {scheme}://")
            raise ConfigError(f"checkpoint store {self.url}: {scheme}:// needs {package}, which is not installed "
                              f"({exc}). HINT: pip install {package} (for S3: pip install 'trainstack[s3]').") \
                from None
        except ValueError as exc:
            raise ConfigError(f"checkpoint store {self.url}: {self.masked(str(exc))}. HINT: a URL such as "
                              f"s3://bucket/prefix.") from None

    def masked(self, text: str) -> str:
        """``text`` with the credentials written into the store's URL (``s3://KEY:SECRET@bucket``) masked."""
        return text.replace(self.secret, "***") if self.secret else text

    def check(self) -> None:
        """Reachable and writable, before training starts, within the store timeout: a clear error naming the URL,
        not one at step 1000, and never a silent wait on an endpoint that does not answer."""
        probe = posixpath.join(self.root, f".trainstack-probe-{time.time_ns()}")
        failed: list[BaseException] = []

        def attempt() -> None:
            try:
                if _local(self.fs):  # object stores have no folders, and a bucket is never made here
                    self.fs.makedirs(self.root, exist_ok=True)
                self.fs.pipe_file(probe, b"ok")
                self.fs.rm_file(probe)
            except Exception as exc:  # noqa: BLE001 -- botocore, gcsfs, ... each raise their own
                failed.append(exc)

        thread = threading.Thread(target=attempt, name="trainstack-store-check", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise ConfigError(f"checkpoint store {self.url} did not answer within {self.timeout:g} s (a write of a "
                              f"small probe object). HINT: check the endpoint (AWS_ENDPOINT_URL) is up and reachable "
                              f"from the nodes; {envvars.STORE_TIMEOUT} sets the time allowed.")
        if not failed:
            self.abort_unfinished()
        if failed:
            exc = failed[0]
            raise ConfigError(f"checkpoint store {self.url} is not reachable or not writable: "
                              f"{type(exc).__name__}: {self.masked(str(exc))}. HINT: check the bucket exists, the "
                              f"credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or ~/.aws; never in the URL) "
                              f"and the endpoint (AWS_ENDPOINT_URL for an S3-compatible server).") from None

    def abort_unfinished(self) -> list[str]:
        """S3: abort the multipart uploads a killed upload of this prefix left unfinished (invisible to listings,
        billed until a lifecycle rule aborts them); the keys aborted. Best effort: a store that cannot list them
        keeps them."""
        if "s3" not in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)):
            return []
        bucket, _, prefix = self.root.partition("/")
        try:
            listed = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
            uploads = listed.get("Uploads") or []
            for upload in uploads:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                                UploadId=upload["UploadId"])
        except Exception:  # noqa: BLE001 -- not every S3-compatible server lists them
            return []
        return [u["Key"] for u in uploads]

    def _path(self, name: str) -> str:
        return posixpath.join(self.root, name)

    # ------------------------------------------------------------------ listing
    def committed(self) -> list[tuple[tuple[int, int], str]]:
        """Committed periodic checkpoints of the run's one lineage as ``((step, epoch), name)``, oldest first: a
        marker a writer wrote after another attempt took the run over (its lease epoch older than a later epoch that
        starts before its step) is passed over."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            base = posixpath.basename(entry.rstrip("/"))
            if base.endswith(COMMITTED):
                name = base[: -len(COMMITTED)]
                m = _NAME.match(name)
                if m:
                    found.append(((int(m.group(2)), int(m.group(1))), name))
        epochs = history(self.fs, self.root)
        later = [e for e in epochs if e["epoch"] > 1]
        if later:  # only markers past the earliest takeover can be outside the lineage: read just those
            cut = min(e.get("base_step") or 0 for e in later)
            kept = [(key, name) for key, name in found
                    if key[0] <= cut or in_lineage(key[0], self._epoch_of(name), epochs)]
            dropped = sorted(name for _, name in set(found) - set(kept))
            if dropped and dropped != self._said_dropped:
                self._said_dropped = dropped
                log.warning("trainstack: passing over %d committed checkpoint(s) in %s outside the run's lineage "
                            "(written by a writer another attempt took the run over from; the lease's epochs: %s): "
                            "%s", len(dropped), self.url, ", ".join(f"{e['epoch']} from step {e.get('base_step')}"
                                                                    for e in epochs[-4:]), ", ".join(dropped[:5]))
            found = kept
        return sorted(found)

    def _epoch_of(self, name: str) -> int | None:
        try:
            epoch = self.manifest(name).get("epoch")
        except CheckpointError:
            return None
        return epoch if type(epoch) is int else None

    def lease(self, holder: dict[str, Any]) -> Lease:
        """This run's single-writer lease in the store (``ConfigError`` where the store has no conditional writes
        trainstack knows)."""
        return Lease(self.fs, self.root, self.url, holder)

    def newest(self) -> tuple[int, str] | None:
        """(step, name) of the newest committed checkpoint, or None."""
        found = self.committed()
        return (found[-1][0][0], found[-1][1]) if found else None

    def manifest(self, name: str) -> dict[str, Any]:
        """The commit marker of ``name``, read as data (bounded, a JSON object) or a ``CheckpointError`` naming it."""
        try:
            raw = self.fs.cat_file(self._path(name + COMMITTED), start=0, end=MARKER_BYTES + 1)
        except FileNotFoundError:
            raise CheckpointError(f"{self.url}/{name} is not a committed checkpoint (no {name}{COMMITTED}).") \
                from None
        if len(raw) > MARKER_BYTES:
            raise CheckpointError(f"{self.url}/{name}{COMMITTED} is larger than a marker may be ({MARKER_BYTES} "
                                  f"bytes): not a marker trainstack wrote.")
        try:
            found = json.loads(raw)
        except ValueError:
            found = None
        if not isinstance(found, dict):
            raise CheckpointError(f"{self.url}/{name}{COMMITTED} is not a JSON object: a damaged or forged marker.")
        return found

    # ------------------------------------------------------------------ writing
    def upload(self, local: Path, lease: Lease | None = None) -> None:
        """Upload the committed local checkpoint ``local`` (a file or a sharded folder), then its marker -- only while
        ``lease`` still holds the run (``StaleLease`` otherwise, nothing committed); the marker carries its epoch."""
        name = local.name
        files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
        objects = {("" if p == local else p.relative_to(local).as_posix()): p.stat().st_size for p in files}
        target = self._path(name)
        marker = self._path(name + COMMITTED)
        if self.fs.exists(marker):  # a re-upload of this name counts only once its new marker is written
            self.fs.rm_file(marker)
        if _local(self.fs):
            self.fs.makedirs(self.root, exist_ok=True)
        if local.is_dir():
            self.fs.put([str(p) for p in files], [posixpath.join(target, rel) for rel in objects])
        else:
            self.fs.put_file(str(local), target)
        manifest = {"name": name, "objects": objects, "sharded": local.is_dir(), "committed_at": time.time(),
                    "epoch": lease.epoch if lease is not None else None,
                    "sha256": {rel: sha256_of(p) for rel, p in zip(objects, files, strict=True)}}
        if lease is not None:
            try:
                lease.check()
            except StaleLease:  # refused: its objects go too (the lineage never names them)
                with contextlib.suppress(Exception):
                    self.fs.rm(target, recursive=True)
                raise
        self.fs.pipe_file(marker, json.dumps(manifest).encode())

    def remove(self, name: str) -> None:
        """The marker first: a removal cut short never leaves a checkpoint that looks whole."""
        marker = self._path(name + COMMITTED)
        if self.fs.exists(marker):
            self.fs.rm_file(marker)
        if self.fs.exists(self._path(name)):
            self.fs.rm(self._path(name), recursive=True)

    def periodic_names(self) -> list[str]:
        """The committed periodic checkpoints' names, oldest first (``retention.CheckpointStorage``)."""
        return [name for _, name in self.committed()]

    def rotate(self, keep_last: int | None) -> None:
        rotate(self, keep_last)

    # ------------------------------------------------------------------ reading
    def checksums(self, name: str) -> dict[str, str] | None:
        """The sha256 of every object of ``name`` as its marker lists them (None for a marker from before
        checksums); a marker whose checksums are not one hex digest per object raises ``CheckpointError``."""
        found = self.manifest(name).get("sha256")
        if found is None:
            return None
        objects = self.objects(name)
        if not isinstance(found, dict) or set(found) != set(objects) or not all(
                isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)
                for v in found.values()):
            raise CheckpointError(f"{self.url}/{name}: its marker's sha256 does not give one digest per object; "
                                  f"refused (a damaged or forged marker).")
        return dict(found)

    def objects(self, name: str) -> dict[str, int]:
        """The objects of the committed checkpoint ``name`` as its marker lists them (relative name -> bytes),
        trusted only as far as checked: every name stays inside the checkpoint (no absolute path, no ``..``, no
        empty or ``.`` part, no backslash or NUL) and is an object the store really holds under the checkpoint's own
        prefix. A marker is data from the bucket, never a path to write to."""
        where = f"{self.url}/{name}"
        if not _NAME.match(name):
            raise CheckpointError(f"{where}: {name!r} is not a checkpoint name (ckpt-e<epoch>-s<step>[.pt]).")
        manifest = self.manifest(name)
        objects = manifest.get("objects") if isinstance(manifest, dict) else None
        if not isinstance(objects, dict) or not objects or not all(
                isinstance(rel, str) and isinstance(size, int) and not isinstance(size, bool) and size >= 0
                for rel, size in objects.items()):
            raise CheckpointError(f"{where}: its marker {name}{COMMITTED} does not list the objects as names and "
                                  f"sizes; refused (nothing was downloaded).")
        sharded = manifest.get("sharded") is True
        if not sharded and list(objects) != [""]:
            raise CheckpointError(f"{where}: its marker says a single-file checkpoint but lists "
                                  f"{sorted(objects)!r}; refused (nothing was downloaded).")
        if sharded:
            bad = sorted(rel for rel in objects if not _inside(rel))
            if bad:
                raise CheckpointError(f"{where}: its marker names object(s) outside the checkpoint ({bad!r}); "
                                      f"refused, nothing was written. Someone who can write to {self.url} wrote "
                                      f"this marker: a store is trusted input (docs/concepts/security.md).")
            prefix = self._path(name)
            held = {posixpath.relpath(key, prefix) for key in self.fs.find(prefix)}
        else:
            held = {""} if self.fs.isfile(self._path(name)) else set()
        missing = sorted(set(objects) - held)
        if missing:
            raise CheckpointError(f"{where}: its marker lists object(s) the store does not hold under the "
                                  f"checkpoint's prefix: {missing[:5]!r}; a damaged or forged checkpoint.")
        return objects

    def download(self, name: str, folder: Path) -> Path:
        """The committed checkpoint ``name`` as ``folder/name``: downloaded to a temp name, sizes checked against the
        marker, then renamed into place (a copy that is already there is kept). A download that fails leaves
        nothing behind."""
        final = folder / name
        objects = self.objects(name)
        if final.exists():
            return final
        folder.mkdir(parents=True, exist_ok=True)
        temp = temp_path(final, owner=0)
        _remove(temp)
        try:
            if len(objects) > 1 or "" not in objects:
                temp.mkdir()
                root = temp.resolve()
                targets = [temp / rel for rel in objects]
                for target in targets:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    if not target.parent.resolve().is_relative_to(root):  # a link inside: never written through
                        raise CheckpointError(f"{self.url}/{name}: {target} would leave {temp}; refused.")
                self.fs.get([posixpath.join(self._path(name), rel) for rel in objects], [str(t) for t in targets])
                sizes = {rel: (temp / rel).lstat().st_size for rel in objects}
            else:
                self.fs.get_file(self._path(name), str(temp))
                sizes = {"": temp.stat().st_size}
            wrong = {rel: (sizes.get(rel), size) for rel, size in objects.items() if sizes.get(rel) != size}
            if wrong:
                raise CheckpointError(f"{self.url}/{name}: downloaded objects differ from its marker (got, expected "
                                      f"bytes): {wrong}: the store holds a damaged copy.")
            digests = self.checksums(name)
            if digests is not None:
                got = temp if "" in objects else None
                bad = sorted(rel for rel, digest in digests.items()
                             if sha256_of(got if got is not None else temp / rel) != digest)
                if bad:
                    raise CheckpointError(f"{self.url}/{name}: downloaded object(s) {bad[:5]!r} do not match the "
                                          f"sha256 its marker records: the store holds a damaged or replaced copy.")
            try:
                temp.rename(final)
            except OSError:  # another node's copy won the rename (a shared run folder): keep it
                pass
        finally:
            _remove(temp)
        return final


def stage(url: str, folder: Path) -> str | None:
    """Pre-stage: the store's newest committed checkpoint downloaded into ``folder`` (a cluster's scratch) while the
    run's job waits there, so it starts without the download; its name (None when there is none)."""
    store = Store(url)
    newest = store.newest()
    if newest is None:
        return None
    folder.parent.mkdir(parents=True, exist_ok=True)
    own_folder(folder)  # a run adopts only what nobody else could have written (``adopt``)
    deny_others_write(store.download(newest[1], folder))
    return newest[1]


def adopt(store: Store, name: str, staged: Path, folder: Path, say: Callable[[str], None] = log.warning
          ) -> bool:
    """The pre-staged copy of ``name`` (``staged/name``), checked against its marker (every object, its size and
    its sha256; a staged folder or object not this user's, or writable by others, is refused), copied into
    ``folder`` under a temp name and renamed; False when there is none or it does not match -- said -- (then the
    store's own download runs)."""
    source = staged / name
    if not os.path.lexists(source):
        return False
    why = _not_own(staged, source)
    objects = store.objects(name)
    digests = store.checksums(name)
    if not why and digests is None:
        why = "its marker records no sha256 (committed before checksums): sizes alone cannot tell another run's copy"
    if not why:
        paths = {rel: source / rel if rel else source for rel in objects}
        why = next((f"{paths[rel]} is not this user's regular file, or is writable by others" for rel in objects
                    if _not_own(paths[rel].parent, paths[rel], file=True)), "")
        assert digests is not None
        if not why and any(paths[rel].lstat().st_size != size for rel, size in objects.items()):
            why = "its sizes differ from the checkpoint the store committed (a damaged or partial copy)"
        if not why and any(sha256_of(paths[rel]) != digests[rel] for rel in objects):
            why = "its content differs from the checkpoint the store committed (sha256): another run's copy?"
    if why:
        say(f"trainstack: WARNING: not taking the pre-staged {source}: {why}; downloading it from {store.url}.")
        return False
    final = folder / name
    if final.exists():
        return True
    folder.mkdir(parents=True, exist_ok=True)
    temp = temp_path(final, owner=0)
    _remove(temp)
    try:
        if source.is_dir():
            shutil.copytree(source, temp)
        else:
            shutil.copy2(source, temp)
        temp.rename(final)
    finally:
        _remove(temp)
    return True


def _not_own(folder: Path, item: Path, file: bool = False) -> str:
    """Why ``item`` (in ``folder``) is not this user's to adopt: '' when it and its folder are this user's, are no
    links and nobody else can write them (cluster scratch is often shared)."""
    for path in (folder, item):
        try:
            st = path.lstat()
        except OSError as exc:
            return f"{path} cannot be read ({exc.strerror})"
        if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return f"{path} is a link, belongs to uid {st.st_uid} (not to you) or is writable by others"
    if file and not stat.S_ISREG(item.lstat().st_mode):
        return f"{item} is not a regular file"
    return ""


def sha256_of(path: Path) -> str:
    """The sha256 of a file's bytes (read in 8 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def _inside(rel: str) -> bool:
    """A relative object name that stays inside its checkpoint's folder."""
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and "\\" not in rel and "\0" not in rel and \
        all(part not in ("", ".", "..") for part in parts)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _userinfo(url: str) -> str:
    """The ``user:secret`` part of ``scheme://user:secret@host/...`` ('' when there is none)."""
    rest = url.split("://", 1)[1] if "://" in url else ""
    authority = rest.split("/", 1)[0]
    return authority.rsplit("@", 1)[0] if "@" in authority else ""


def _local(fs: Any) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return "file" in protocols or "local" in protocols


class Uploads:
    """Rank 0's uploads, one at a time, off the training thread: the newest committed local checkpoint goes to the
    store, then the store keeps ``keep_last``. Training never waits for the store: a save made while an upload runs
    waits for it in a slot of one (a newer save takes the slot; the one it replaces is skipped, said), a failed
    upload is said (the local copy stays committed) and the next save uploads again; the end of a run waits a
    bounded time for the last one."""

    def __init__(self, store: Store, keep_last: int | None, say: Callable[[str], None],
                 lease: Lease | None = None) -> None:
        self.store, self.keep_last, self._say, self.lease = store, keep_last, say, lease
        self.stale: str | None = None  # another attempt took the run over: why this writer stopped committing
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.in_flight: str | None = None  # the checkpoint being uploaded
        self.pending: Path | None = None  # the newest save waiting for it
        self._started = 0.0
        self.uploaded: str | None = None  # the newest checkpoint committed in the store by this run
        self.failed: str | None = None  # why the last upload failed, or None
        self.skipped = 0  # saves whose upload a newer save replaced while an upload was running
        self.seconds = 0.0  # the last upload's duration

    def protected(self) -> set[str]:
        """The checkpoints the local rotation keeps: the one being uploaded and the one waiting."""
        with self._lock:
            return {n for n in (self.in_flight, self.pending.name if self.pending else None) if n}

    def submit(self, local: Path) -> None:
        """Upload ``local`` in the background; while an upload runs, it waits in the slot (a newer save replaces
        it there, said). Raises ``StaleLease`` once another attempt has taken the run over: this one stops."""
        if self.stale is not None:
            raise StaleLease(self.stale)
        with self._lock:
            if self.in_flight is not None:
                if self.pending is not None:
                    self.skipped += 1
                    self._say(f"trainstack: WARNING: the upload of {self.in_flight} to {self.store.url} is still "
                              f"running after {time.monotonic() - self._started:.0f} s: {self.pending.name} is not "
                              f"uploaded ({local.name} is newer and waits instead; local copies are committed). "
                              f"Training does not wait for the store.")
                self.pending = local
                return
            self.in_flight, self._started = local.name, time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(local,), name="trainstack-upload", daemon=True)
        self._thread.start()

    def _run(self, local: Path | None) -> None:
        while local is not None:
            self._upload(local)
            with self._lock:
                local, self.pending = self.pending, None
                self.in_flight = local.name if local is not None else None
                self._started = time.monotonic()

    def _upload(self, local: Path) -> None:
        start = time.perf_counter()
        try:
            self.store.upload(local, self.lease)
            self.store.rotate(self.keep_last)
        except StaleLease as exc:
            self.stale = str(exc)
            self._say(f"trainstack: ERROR: {local.name} is NOT committed to {self.store.url}: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 -- any client's error: said, training goes on
            self.failed = f"{type(exc).__name__}: {self.store.masked(str(exc))}"
            self._say(f"trainstack: WARNING: could not upload checkpoint {local.name} to {self.store.url}: "
                      f"{self.failed}. The local copy in {local.parent} is committed; the next save uploads again.")
            return
        self.seconds, self.uploaded, self.failed = time.perf_counter() - start, local.name, None

    def wait(self, timeout: float | None = None) -> bool:
        """The uploads in flight and waiting are done (committed in the store, or their failure said) -- within
        ``timeout`` seconds when given: False when one is still running then."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        return True


def local_copy(url: str, which: str | None = None) -> Path:
    """For ``checkpoint inspect/consolidate/export URL``: the checkpoint a URL names -- one checkpoint's URL, or a
    store's newest committed one (``which``: a checkpoint's name) -- downloaded to a temp folder removed at exit."""
    import atexit
    import tempfile

    base = posixpath.basename(url.rstrip("/"))
    store, name = (Store(url.rstrip("/").rsplit("/", 1)[0]), base) if _NAME.match(base) else (Store(url), which)
    if name in ("best", "last"):
        raise CheckpointError(f"{url}: a checkpoint store holds the periodic checkpoints only, not '{name}'. HINT: "
                              f"name one (trainstack checkpoint inspect {url}/ckpt-...) or leave --best/--last out.")
    if name is None:
        newest = store.newest()
        if newest is None:
            raise CheckpointError(f"no committed checkpoint in {url}. HINT: give the URL a run's checkpoint_store "
                                  f"committed to (its ckpt-*.committed markers are what count).")
        name = newest[1]
    folder = Path(tempfile.mkdtemp(prefix="trainstack-store-"))
    atexit.register(shutil.rmtree, folder, True)
    return store.download(name, folder)
