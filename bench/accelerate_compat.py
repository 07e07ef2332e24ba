"""Accelerate's own tests against trainstack, with only the imports changed: the drop-in claim, measured.

    python bench/accelerate_compat.py                     # the 4 test scripts: real Accelerate, then trainstack
    python bench/accelerate_compat.py --examples DIR      # also by_feature examples found in DIR (an accelerate
                                                          # checkout's examples/by_feature, or your copies)

The test scripts are the ones shipped inside the installed `accelerate` package
(`accelerate/test_utils/scripts/test_{script,sync,ops,distributed_data_loop}.py`); each test function is run on
2 CPU processes and reported on its own. For trainstack the script text is rewritten -- `from accelerate[.x] import`
becomes `from trainstack[.x] import`, `accelerate.utils.<submodule>` becomes `trainstack.utils` -- and nothing else
(Accelerate's `test_utils` helpers are kept; `are_the_same_tensors`, which reads Accelerate's own process state, is
given trainstack's). trainstack runs twice: under torchrun and under `python` with `notebook_launcher`.

The examples need the hub (datasets, evaluate, transformers); `bench/accelerate_hub/` stands in with synthetic
GLUE/MRPC-shaped data and a tiny classifier, for both systems alike, and `TESTING_MOCKED_DATALOADERS=1` as in
Accelerate's own CI. Prints a markdown table: one row per test, one column per system."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ("test_script.py", "test_sync.py", "test_ops.py", "test_distributed_data_loop.py")
SYSTEMS = ("accelerate", "trainstack", "trainstack-spawn")
# helpers the tests call (their assertions fail the calling test): not rows of their own
HELPERS = {"check_model_parameters"}
# test functions that hang with real Accelerate on CPU (its join_uneven_inputs is a no-op there): not run for it
HANGS = {"accelerate": {"test_can_join_uneven_inputs"}}
# by_feature examples: (name, file, arguments, check of the main process's stdout)
EXAMPLES = [
    ("nlp_example", "nlp_example.py", [], None),
    ("gradient_accumulation", "gradient_accumulation.py", ["--gradient_accumulation_steps", "2"], None),
    ("checkpointing_by_epoch", "checkpointing.py", ["--checkpointing_steps", "epoch", "--output_dir", "{ckpt}"],
     lambda out, work: (work / "ckpt" / "epoch_0").exists()),
    ("checkpointing_by_steps", "checkpointing.py", ["--checkpointing_steps", "1", "--output_dir", "{ckpt}"],
     lambda out, work: (work / "ckpt" / "step_2").exists()),
    ("load_states_by_epoch", "checkpointing.py", ["--resume_from_checkpoint", "{ckpt}/epoch_0"],
     lambda out, work: "epoch 0:" not in out and "epoch 1:" in out),
    ("load_states_by_steps", "checkpointing.py", ["--resume_from_checkpoint", "{ckpt}/step_2"],
     lambda out, work: "epoch 0:" in out and "epoch 1:" in out),
    ("early_stopping", "early_stopping.py", [], None),
    ("tracking", "tracking.py", ["--with_tracking", "--project_dir", "{work}/logs"], None),
    ("memory", "memory.py", [], None),
    ("automatic_gradient_accumulation", "automatic_gradient_accumulation.py", [], None),
    ("multi_process_metrics", "multi_process_metrics.py", [], None),
    ("local_sgd", "local_sgd.py", [], None),
    ("ddp_comm_hook", "ddp_comm_hook.py", ["--ddp_comm_hook", "fp16"], None),
    ("profiler", "profiler.py", ["--cpu"], None),
]
SPAWN_MAIN = '\n\nif __name__ == "__main__":\n    from trainstack import notebook_launcher\n\n' \
             '    notebook_launcher(main, num_processes=2)\n'


def rewrite(text: str) -> str:
    """The import change a user makes: accelerate -> trainstack (Accelerate's test_utils helpers stay)."""
    text = re.sub(r"^(\s*)from accelerate\.test_utils", r"\1from KEEP_test_utils", text, flags=re.M)
    text = re.sub(r"^(\s*)from accelerate\.utils\.\w+ import", r"\1from accelerate.utils import", text, flags=re.M)
    text = re.sub(r"^(\s*)from accelerate(\.[\w.]+)? import",
                  lambda m: f"{m.group(1)}from trainstack{m.group(2) or ''} import", text, flags=re.M)
    text = re.sub(r"^(\s*)import accelerate\b", r"\1import trainstack", text, flags=re.M)
    return text.replace("KEEP_test_utils", "accelerate.test_utils")


# ------------------------------------------------------------------------------------------------- test scripts
def run_script_in_process(name: str, system: str) -> None:
    """One process of a test script: every test function wrapped so that a failure is recorded and the rest goes
    on; the main process prints ``RESULTS {json}``."""
    import accelerate

    source = Path(accelerate.__file__).parent / "test_utils" / "scripts" / name
    text = source.read_text() if system == "accelerate" else rewrite(source.read_text())
    path = Path(tempfile.mkdtemp(prefix="compat-")) / name
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("script_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["script_under_test"] = module
    results: dict[str, str] = {}
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001  (a failing import is a result too)
        print("RESULTS", json.dumps({"<import>": f"FAIL {type(exc).__name__}: {exc}"[:300]}), flush=True)
        return
    if system != "accelerate" and hasattr(module, "are_the_same_tensors"):
        module.are_the_same_tensors = _same_tensors  # type: ignore[attr-defined]
    for attr in dir(module):
        fn = getattr(module, attr)
        if isinstance(fn, types.FunctionType) and fn.__module__ == "script_under_test" and (
                attr.startswith("test_") or attr.endswith("_check") or attr.startswith("check_")) \
                and attr not in HELPERS:
            setattr(module, attr, _recorded(fn, attr, results, HANGS.get(system, set())))
    try:
        module.main()
    except BaseException as exc:  # noqa: BLE001
        results["<main>"] = f"FAIL {type(exc).__name__}: {exc}"[:300]
    if _rank(system) == 0:
        print("RESULTS", json.dumps(results), flush=True)


def _recorded(fn: types.FunctionType, name: str, results: dict[str, str], skipped: set[str]) -> object:
    """``fn`` with its outcome kept under its name (a parametrised call adds its first argument's type)."""
    @functools.wraps(fn)
    def call(*args: object, **kwargs: object) -> object:
        key = name  # one row per test; a test run with several arguments fails if any run fails
        if name == "test_data_loader":  # called once per kind of loader: one row each
            key = f"{name}#{sum(k.startswith(name) for k in results) + 1}"
        if name in skipped:
            results[key] = "FAIL hangs (not run)"
            return None
        try:
            out = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001
            first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
            results[key] = f"FAIL {type(exc).__name__}: {first}"
            if os.environ.get("COMPAT_TRACE"):
                traceback.print_exc()
            return None
        if results.get(key, "ok") == "ok":
            results[key] = "ok"
        return out
    return call


def _same_tensors(tensor: object) -> bool:
    import torch

    from trainstack.utils import gather

    assert isinstance(tensor, torch.Tensor)
    everyone = gather(tensor[None].clone()).cpu()
    return all(torch.equal(everyone[i], tensor.cpu()) for i in range(everyone.shape[0]))


def _rank(system: str) -> int:
    if system == "trainstack-spawn":
        from trainstack import PartialState

        return PartialState().process_index
    return int(os.environ.get("RANK", "0"))


def run_script(name: str, system: str, timeout: float) -> dict[str, str]:
    """A test script on 2 CPU processes: torchrun, or notebook_launcher under python (trainstack-spawn)."""
    here = [sys.executable, str(Path(__file__).resolve()), "--worker", name, system]
    command = here if system == "trainstack-spawn" else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *here[1:]]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"<script>": f"FAIL timed out after {timeout:.0f} s"}
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    if not found:
        if os.environ.get("COMPAT_TRACE"):
            print(proc.stdout, proc.stderr, file=sys.stderr)
        return {"<script>": f"FAIL exit {proc.returncode}: {(proc.stderr or proc.stdout)[-300:]}"}
    return dict(json.loads(found[-1][len("RESULTS "):]))


# ------------------------------------------------------------------------------------------------- examples
def run_example(folder: Path, case: tuple, system: str, work: Path, timeout: float) -> str:
    name, file, args, check = case
    text = (folder / file).read_text()
    if system != "accelerate":
        text = rewrite(text)
    if system == "trainstack-spawn":
        text = re.sub(r'\nif __name__ == "__main__":\n    main\(\)\n?$', SPAWN_MAIN, text)
    script = work / f"{system}-{file}"
    script.write_text(text)
    args = [a.replace("{ckpt}", str(work / "ckpt")).replace("{work}", str(work)) for a in args]
    command = [sys.executable, str(script), *args] if system == "trainstack-spawn" else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), *args]
    env = {**os.environ, "TESTING_MOCKED_DATALOADERS": "1", "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE / "accelerate_hub"), os.environ.get("PYTHONPATH", "")]),
           "WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": f"file://{work}/mlruns", "MLFLOW_ALLOW_FILE_STORE": "true"}
    try:
        proc = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True, timeout=timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return f"FAIL timed out after {timeout:.0f} s"
    if proc.returncode == 0 and (check is None or check(proc.stdout, work)):
        return "ok"
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if re.search(r"Error|error:", line)]
    return f"FAIL exit {proc.returncode}: {(lines[-1] if lines else proc.stdout[-200:])[:200]}"


# ------------------------------------------------------------------------------------------------- the table
def table(rows: dict[str, dict[str, str]], systems: tuple[str, ...]) -> str:
    out = ["| test | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
    for test, by_system in rows.items():
        cells = [("ok" if by_system.get(s) == "ok" else "**fail**" if by_system.get(s) else "-") for s in systems]
        out.append(f"| {test} | " + " | ".join(cells) + " |")
    base = [t for t, r in rows.items() if r.get("accelerate") == "ok"]
    for system in systems[1:]:
        passed = sum(rows[t].get(system) == "ok" for t in base)
        extra = sum(r.get(system) == "ok" and r.get("accelerate") != "ok" for r in rows.values())
        out.append(f"\n{system}: {passed} of the {len(base)} that real Accelerate passes"
                   + (f" (and {extra} that it does not)" if extra else ""))
    failures = [f"- {t} ({s}): {r[s]}" for t, r in rows.items() for s in systems if r.get(s, "ok") != "ok"]
    return "\n".join(out + (["\nFailures:", *failures] if failures else []))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        name, system = sys.argv[2], sys.argv[3]
        if system == "trainstack-spawn" and not os.environ.get("COMPAT_WORKER"):
            os.environ["COMPAT_WORKER"] = "1"
            from trainstack import notebook_launcher

            notebook_launcher(run_script_in_process, args=(name, system), num_processes=2)
        else:
            run_script_in_process(name, system)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=Path, help="a folder with Accelerate's by_feature examples")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--scripts", default=",".join(SCRIPTS))
    parser.add_argument("--timeout", type=float, default=600)
    options = parser.parse_args()
    systems = tuple(s for s in options.systems.split(",") if s)
    rows: dict[str, dict[str, str]] = {}
    for name in [s for s in options.scripts.split(",") if s]:
        for system in systems:
            start = time.monotonic()
            for test, verdict in run_script(name, system, options.timeout).items():
                rows.setdefault(f"{name.removesuffix('.py')}::{test}", {})[system] = verdict
            print(f"{name} on {system}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    if options.examples is not None:
        for system in systems:
            work = Path(tempfile.mkdtemp(prefix=f"compat-{system}-"))
            for case in EXAMPLES:
                if (options.examples / case[1]).exists():
                    rows.setdefault(f"example::{case[0]}", {})[system] = run_example(options.examples, case, system,
                                                                                      work, options.timeout)
            shutil.rmtree(work, ignore_errors=True)
            print(f"examples on {system} done", file=sys.stderr, flush=True)
    print(table(rows, systems))
    return 0


if __name__ == "__main__":
    sys.exit(main())
