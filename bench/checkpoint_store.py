"""Checkpoints in an object store vs on local disk, in the same run: save and restore times of one state.

An S3-compatible server (moto's server mode) is started on 127.0.0.1 and stopped by pid; one process; an MLP of
``--width``/``--layers`` with AdamW (weights + two moments), a file and a sharded (DCP) checkpoint of it:

* ``save (training waits)``: the local commit (``Checkpointer.save``: write, fsync, rename) -- what a save costs
  training with or without a store, since the upload runs off the training thread;
* ``upload + commit``: ``Store.upload`` of the committed checkpoint, then its marker (the background part);
* ``restore local``: ``Checkpointer.restore`` from the run folder;
* ``restore from the store``: ``resume="auto"`` on an empty run folder: the download (sizes checked against the
  marker) plus the same restore.

Each measured ``--reps`` times (median). Run: ``make bench-store`` (or ``python bench/checkpoint_store.py``).
Writes bench/results/checkpoint_store.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@contextlib.contextmanager
def s3_server():
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    if exe is None:
        sys.exit("bench-store needs moto[server] (pip install 'moto[server]')")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(300):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.1)
        os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
        yield
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def measure(width: int, layers: int, sharded: bool, url: str, tmp: Path) -> dict[str, float]:
    import torch
    from torch import nn

    from trainstack._checkpoint.store import Store
    from trainstack.checkpoint import Checkpointer

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()  # the moments exist: the whole state
    run = tmp / f"run-{time.time_ns()}"
    saver = Checkpointer(run, sharded=sharded)
    start = time.perf_counter()
    path = saver.save({"epoch": 1, "global_step": 10}, {"model": model, "optimizer": optimizer})
    saved = time.perf_counter() - start
    assert path is not None
    store = Store(url)
    start = time.perf_counter()
    store.upload(path)
    uploaded = time.perf_counter() - start
    start = time.perf_counter()
    Checkpointer(run, sharded=sharded).restore({"model": model, "optimizer": optimizer})
    local = time.perf_counter() - start
    elsewhere = tmp / f"elsewhere-{time.time_ns()}"
    start = time.perf_counter()
    store.download(path.name, elsewhere / "checkpoints")
    Checkpointer(elsewhere, sharded=sharded).restore({"model": model, "optimizer": optimizer})
    remote = time.perf_counter() - start
    size = sum(p.stat().st_size for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    shutil.rmtree(run), shutil.rmtree(elsewhere)
    return {"bytes": size, "save": saved, "upload": uploaded, "restore_local": local, "restore_store": remote}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    import s3fs

    rows: dict[str, list[dict[str, float]]] = {}
    with s3_server(), tempfile.TemporaryDirectory(prefix="ts-bench-store-") as tmp:
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir("bench")
        for rep in range(args.reps):
            for kind in ("file", "sharded"):  # interleaved: load changes hit both alike
                row = measure(args.width, args.layers, kind == "sharded", f"s3://bench/{kind}-{rep}", Path(tmp))
                rows.setdefault(kind, []).append(row)
                print(f"rep {rep} {kind:8s} " + " ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "bytes"),
                      flush=True)
    med = {kind: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for kind, runs in rows.items()}
    print(f"\nMLP {args.layers} x {args.width}^2 + AdamW, medians of {args.reps}, moto S3 server on 127.0.0.1\n")
    print("| checkpoint | size MB | save: training waits (s) | upload + commit (s) | restore local (s) | "
          "restore from s3:// (s) | s3 / local restore |")
    print("|---|---|---|---|---|---|---|")
    for kind, m in med.items():
        print(f"| {kind} | {m['bytes'] / 1e6:.0f} | {m['save']:.2f} | {m['upload']:.2f} | {m['restore_local']:.2f} | "
              f"{m['restore_store']:.2f} | {m['restore_store'] / m['restore_local']:.1f}x |")
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint_store.json").write_text(json.dumps({"args": vars(args), "median": med, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
