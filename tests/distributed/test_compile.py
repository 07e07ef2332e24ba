"""torch.compile on real 2-process gloo runs, each in its own process so inductor starts cold (CPU inductor with the
system C++ compiler): compiled training matches eager, checkpoints keep the plain module's keys, a resumed run is
bitwise the uninterrupted one and starts warm from the run's cache, a slow compile on one rank trips neither the
watchdog nor the collective timeout, FSDP2 compiles block by block, a model dynamo cannot trace is a clear error."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ci_leaves_out
from torch import nn

from trainstack import TrainConfig
from trainstack.errors import ConfigError

JOB = str(Path(__file__).with_name("_compile_train.py"))
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(420)


def _run(folder: Path, mode: str, epochs: int = 3, ok: bool = True, **env: str) -> tuple[dict, str, float | None]:
    """(the result line, the whole output, the first step's compile time) of one run in a fresh process."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    out = subprocess.run([sys.executable, JOB, str(folder), mode, str(epochs)], capture_output=True, text=True,
                         timeout=400, env=full)
    text = out.stdout + out.stderr
    assert (out.returncode == 0) == ok, text[-4000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{"))) if ok else {}
    m = re.search(r"compiled the first step in ([\d.]+) s", text)
    return result, text, float(m.group(1)) if m else None


def _plain_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


@ci_leaves_out("a compiled run's plain keys: test_compiled_ddp_trains_like_eager")
def test_a_user_compiled_model_is_unwrapped_to_plain_keys(tmp_path):
    result, text, took = _run(tmp_path / "user", "user", epochs=1)
    assert result["keys"] == ["0.bias", "0.weight"] and took is not None, text[-2000:]


@ci_leaves_out("the compile window: tests/test_watchdog.py; a cold compile: test_compiled_ddp_trains_like_eager")
def test_a_slow_compile_on_one_rank_trips_neither_the_watchdog_nor_a_collective(tmp_path):
    """Rank 1 compiles for 8 s; hang_timeout is 2 s (6 s for a first step) and the collective timeout 4 s: the
    compile window covers both. With the window shorter than the compile the same run fails -- the test can fail."""
    _, text, took = _run(tmp_path / "slow", "slow-rank", epochs=1, TRAINSTACK_TIMEOUT_S="4")
    assert took is not None and took >= 8 and "hang report" not in text, text[-3000:]
    _, text, _ = _run(tmp_path / "short", "slow-rank", epochs=1, ok=False, TRAINSTACK_TIMEOUT_S="4",
                      TRAINSTACK_COMPILE_TIMEOUT="1")
    assert "Timed out" in text or "hang report" in text, text[-3000:]


def test_a_model_dynamo_cannot_trace_is_a_clear_error_naming_the_line_and_the_fix(tmp_path):
    _, text, _ = _run(tmp_path / "broken", "broken", epochs=1, ok=False)
    assert "ConfigError: torch.compile could not compile the model: Unsupported" in text, text[-3000:]
    assert "_compile_train.py\", line" in text and "compile=False trains eagerly" in text
    assert "loss_fn is called as" not in text  # not the first-step hint about loss functions


@pytest.mark.slow
def test_compiled_ddp_trains_like_eager_resumes_bitwise_warm_and_its_checkpoints_load_into_a_plain_model(tmp_path):
    """One compiled run, stopped after 2 epochs and resumed to 4 (the requeue's warm start), against an eager run
    and a straight compiled run of 4 epochs (one test: each compiled run costs a cold compile on CI's 2 cores)."""
    _, first, cold = _run(tmp_path / "a", "inductor", epochs=2)
    compiled, text, warm = _run(tmp_path / "a", "inductor", epochs=4)  # resume="auto": the same run folder, cache
    assert cold is not None and "per rank:" in first and "Compile" in first and "compiling..." in first, first[-3000:]
    assert "Continuing at" in text and warm is not None
    print(f"first step: cold {cold:.1f} s, warm (resumed, cache hit) {warm:.1f} s")
    assert warm < cold / 2, (cold, warm)
    eager, _, _ = _run(tmp_path / "eager", "eager", epochs=4)
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-4), (compiled, eager)
    assert compiled["keys"] == ["0.bias", "0.weight"]  # no _orig_mod.
    assert (tmp_path / "a" / "compile-cache" / "inductor").is_dir()
    _run(tmp_path / "b", "inductor", epochs=4, TRAINSTACK_COMPILE_CACHE=str(tmp_path / "a" / "compile-cache"))
    resumed, straight = (torch.load(tmp_path / x / "final.pt", weights_only=True) for x in ("a", "b"))
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)  # bitwise: inductor on CPU is deterministic
    [ckpt] = sorted((tmp_path / "a" / "checkpoints").glob("ckpt-*.pt"))[-1:]
    plain = _plain_model()
    plain.load_state_dict(torch.load(ckpt, weights_only=True)["model"])  # strict: every key matches


@ci_leaves_out("FSDP: tests/distributed/test_fsdp.py; compile: test_compiled_ddp_trains_like_eager")
@pytest.mark.slow
def test_fsdp_compiles_block_by_block(tmp_path):
    result, text, took = _run(tmp_path / "fsdp", "fsdp", epochs=1)
    assert took is not None and result["keys"] == ["0.bias", "0.weight"], text[-2000:]


def test_compile_values_are_checked_with_the_field_named():
    assert TrainConfig(compile={"mode": "reduce-overhead"}).compile == {"mode": "reduce-overhead"}
    with pytest.raises(ConfigError, match=r"TrainConfig.compile has unknown torch.compile option\(s\) \['mod'\]"):
        TrainConfig(compile={"mod": "x"})
    with pytest.raises(ConfigError, match="TrainConfig.compile='yes' must be True, False or a dict"):
        TrainConfig(compile="yes")
    assert TrainConfig.from_cli(["--compile", "true"]).compile is True
    assert TrainConfig.from_cli(["--compile", '{"fullgraph": true}']).compile == {"fullgraph": True}


def test_a_compile_cache_another_user_can_write_never_runs_their_code(tmp_path):
    """A shared project folder (umask 000 here, 002 with a shared group): the run folder is writable by others, so
    its compile cache would be code they can change that runs as you on the next warm start. The cache goes to a
    private folder instead; a TRAINSTACK_COMPILE_CACHE others can write is refused. Another local user (nobody)
    tries to plant code in both."""
    import shutil
    import tempfile

    if os.getuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("needs root and runuser to act as a second user")
    shared = Path(tempfile.mkdtemp(prefix="trainstack-shared-", dir="/tmp"))
    try:
        shared.chmod(0o777)
        project, canary = shared / "proj", shared / "CANARY"
        project.mkdir(mode=0o777)
        project.chmod(0o777)
        env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "NPROCS": "1"}  # where the cache goes: one process shows it
        first, text, _ = _run(project / "runB", "inductor", epochs=1, **env, UMASK="000")
        assert "the compile cache goes to" in text and "is writable by other users" in text, text[-3000:]
        plant = (f"for f in $(find {project} -name '*.py'); do echo 'open({str(canary)!r}, \"w\")' >> \"$f\"; done; "
                 f"mkdir -p {shared}/cc/inductor && chmod -R 777 {shared}/cc")
        subprocess.run(["runuser", "-u", "nobody", "--", "sh", "-c", plant], check=True, timeout=60)
        _, text, _ = _run(project / "runB", "inductor", epochs=2, **env, UMASK="000")
        assert not canary.exists(), text[-3000:]
        _, text, _ = _run(tmp_path / "other", "inductor", epochs=1, ok=False, NPROCS="1",
                          TRAINSTACK_COMPILE_CACHE=str(shared / "cc"))
        assert "TRAINSTACK_COMPILE_CACHE=" in text and "writable by other users" in text and "HINT" in text, text
        assert not canary.exists()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_compile_option_values_are_checked():
    from trainstack._runtime.compiling import compile_options

    with pytest.raises(ConfigError, match="mode must be one of"):
        compile_options({"mode": 1})
    with pytest.raises(ConfigError, match="fullgraph must be True or False"):
        compile_options({"fullgraph": "yes"})
    assert compile_options({"mode": "max-autotune", "dynamic": None}) == {"mode": "max-autotune", "dynamic": None}


def test_a_damaged_compile_cache_is_named_with_the_fix(tmp_path, monkeypatch):
    """A truncated or garbage cache entry fails while loading: the error names the cache and says to delete it (it
    used to read 'torch.compile could not compile the model ... compile=False')."""
    import importlib.util

    from trainstack._runtime.compiling import explain

    cache = tmp_path / "run" / "compile-cache" / "inductor"
    entry = cache / "ab" / "cabcdef.py"
    entry.parent.mkdir(parents=True)
    entry.write_text("def call(args):\n    return (\n")  # cut short by a full disk
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    spec = importlib.util.spec_from_file_location("cabcdef", entry)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except SyntaxError as exc:
        found = explain(exc)
    assert found is not None and "compile cache" in str(found) and "is damaged" in str(found), found
    assert f"delete {cache.parent}" in str(found)
