"""The click CLI through CliRunner: every option reaches the script, every bad input exits 2 naming the option."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from trainstack.cli import main


@pytest.fixture
def runner():
    return CliRunner()


def _gen(runner, *args):
    return runner.invoke(main, ["generate", *args], catch_exceptions=False)


def test_help_lists_commands_with_examples(runner):
    out = runner.invoke(main, ["--help"]).output
    assert "generate" in out and "submit" in out and "Examples:" in out


@pytest.mark.parametrize("args, needle", [
    (["--nodes", "2", "--setup", "multi-node", "--gpus-per-node", "8"], "#SBATCH --gpus-per-node=8"),
    (["--cpus-per-task", "6"], "#SBATCH --cpus-per-task=6"),
    (["--cpus-per-task", "6"], 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"'),
    (["--mem", "32G"], "#SBATCH --mem=32G"),
    (["--time", "2-00:00:00"], "#SBATCH --time=2-00:00:00"),
    (["--partition", "p1"], "#SBATCH --partition=p1"),
    (["--account", "acct"], "#SBATCH --account=acct"),
    (["--qos", "q"], "#SBATCH --qos=q"),
    (["--constraint", "a100&ib"], '#SBATCH --constraint="a100&ib"'),
    (["--job-name", "exp 1"], '#SBATCH --job-name="exp 1"'),
    (["--log-dir", "/tmp/my logs"], '#SBATCH --output="/tmp/my logs/%x-%j.out"'),
    (["--exclusive"], "#SBATCH --exclusive"),
    (["--requeue", "--signal", "B:USR1@60"], "#SBATCH --signal=B:USR1@60"),
    (["--requeue"], "#SBATCH --open-mode=append"),
    (["--env", "A=1", "--env", "B=x y"], "export B='x y'"),
    (["--nccl-ifname", "ib0"], "export NCCL_SOCKET_IFNAME=ib0"),
    (["--nccl-debug", "INFO"], "NCCL_DEBUG_FILE="),
    (["--container", "apptainer", "--image", "t.sif", "--bind", "/d:/d"], "apptainer exec --nv --bind /d:/d t.sif"),
    (["--container", "pyxis", "--image", "img:1"], "--container-image=img:1"),
    (["--venv", "/opt/venv"], "source /opt/venv/bin/activate"),
    (["--setup-cmd", "module load cuda"], "module load cuda"),
    (["--python", "/usr/bin/python3.11"], "/usr/bin/python3.11 -u train.py"),
    (["--chdir", "/work/x"], "#SBATCH --chdir=/work/x"),
    (["--cpu", "--setup", "multi-gpu", "--procs-per-node", "3"], "#SBATCH --ntasks-per-node=3"),
    (["--setup", "multi-gpu", "--launcher", "torchrun", "--max-restarts", "2"], "--max-restarts=2"),
    (["--explain"], "# WHY:"),
])
def test_options_reach_the_script(runner, args, needle):
    result = _gen(runner, *args, "--", "train.py")
    assert result.exit_code == 0, result.output
    assert needle in result.output


@pytest.mark.parametrize("args, option", [
    (["--nodes", "0"], "--nodes"), (["--setup", "multi-node"], "--nodes"), (["--time", "soon"], "--time"),
    (["--mem", "big"], "--mem"), (["--env", "NOEQUALS"], "--env"), (["--env", "9X=1"], "--env"),
    (["--container", "apptainer"], "--image"), (["--setup", "bogus"], "--setup"), (["--nodes", "x"], "--nodes"),
    (["--gpus-per-node", "99", "--setup", "multi-gpu"], "--gpus-per-node"), (["--cpu", "--gpus-per-node", "2"],
                                                                            "--gpus-per-node"),
    (["--launcher", "custom", "--command", "x"], "--command"), (["--signal", "USR1 now"], "--signal"),
])
def test_bad_input_exits_2_naming_the_option(runner, args, option):
    result = runner.invoke(main, ["generate", *args, "--", "train.py"])
    assert result.exit_code == 2, result.output
    assert option in result.output


def test_missing_program_is_a_usage_error(runner):
    result = runner.invoke(main, ["generate"])
    assert result.exit_code == 2 and "PROGRAM" in result.output


def test_output_file_refuses_to_overwrite_without_force(runner, tmp_path):
    out = tmp_path / "job.sbatch"
    assert _gen(runner, "-o", str(out), "--", "t.py").exit_code == 0
    assert out.read_text().startswith("#!/bin/bash") and out.stat().st_mode & 0o111
    again = runner.invoke(main, ["generate", "-o", str(out), "--", "t.py"])
    assert again.exit_code == 2 and "--force" in again.output
    assert _gen(runner, "-o", str(out), "--force", "--time", "5", "--", "t.py").exit_code == 0
    assert "#SBATCH --time=5" in out.read_text()


def test_profile_supplies_defaults_and_flags_override(runner, tmp_path):
    toml = tmp_path / "site.toml"
    toml.write_text('partition = "gpu"\naccount = "proj"\ngpus-per-node = 4\nsetup = "multi-gpu"\nenv = {X = "1"}\n')
    out = _gen(runner, "--profile", str(toml), "--account", "mine", "--", "t.py").output
    assert "#SBATCH --partition=gpu" in out and "#SBATCH --account=mine" in out and "--gpus-per-node=4" in out
    assert "export X=1" in out
    yml = tmp_path / "site.yaml"
    yml.write_text("qos: long\nbind: [/a, /b]\ncontainer: apptainer\nimage: x.sif\n")
    assert "--bind /a --bind /b x.sif" in _gen(runner, "--profile", str(yml), "--qos", "short", "--", "t.py").output
    bad = tmp_path / "bad.toml"
    bad.write_text('nodez = 3\n')
    result = runner.invoke(main, ["generate", "--profile", str(bad), "--", "t.py"])
    assert result.exit_code == 2 and "nodez" in result.output


def test_submit_without_sbatch_is_a_clear_error(runner, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    result = runner.invoke(main, ["submit", "--log-dir", str(tmp_path / "logs"), "--", "t.py"])
    assert result.exit_code == 1 and "sbatch not found" in result.output
    assert not (tmp_path / "logs").exists()  # checked first, nothing written: a failed submit leaves no file


def test_generate_does_not_import_torch():
    code = ("import sys; from trainstack.cli import main; "
            "sys.argv=['trainstack','generate','--','t.py']; "
            "import contextlib, io\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try: main()\n"
            "    except SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_readme_import_gives_the_functions_even_after_the_modules_were_imported():
    code = ("import trainstack.render, trainstack.submit\n"
            "from trainstack import LaunchSpec, render, submit\n"
            "assert callable(render) and callable(submit), (render, submit)\n"
            "print(render(LaunchSpec(program=['t.py']))[:11])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("#!/bin/bash"), proc.stderr


def test_trainstack_options_after_the_program_are_refused_unless_separated(runner):
    result = runner.invoke(main, ["generate", "--setup", "multi-gpu", "train.py", "--gpus-per-node", "4", "--time",
                                  "02:00:00"])
    assert result.exit_code == 2 and "--gpus-per-node, --time come(s) after the program 'train.py'" in result.output
    ok = runner.invoke(main, ["generate", "--setup", "multi-gpu", "--", "train.py", "--time", "5"])
    assert ok.exit_code == 0 and "train.py --time 5" in ok.output  # with --, the program takes them itself
    plain = runner.invoke(main, ["generate", "train.py", "--epochs", "3"])  # its own options: fine
    assert plain.exit_code == 0


def test_cpus_per_task_has_a_default_per_task_and_threads_follow_the_launcher(runner):
    def threads(*args):
        out = _gen(runner, *args, "--", "t.py").output
        cpus = next(line for line in out.splitlines() if line.startswith("#SBATCH --cpus-per-task="))
        omp = next(line for line in out.splitlines() if line.startswith("export OMP_NUM_THREADS="))
        return int(cpus.split("=")[1]), int(omp.split("=")[1])

    base = ["--setup", "multi-node", "--nodes", "2", "--gpus-per-node", "4"]
    assert threads(*base, "--cpus-per-task", "8") == (8, 8)  # srun: a task is one process
    assert threads(*base, "--launcher", "torchrun", "--cpus-per-task", "32") == (32, 8)  # torchrun: 4 per task
    assert threads(*base) == (4, 4) and threads(*base, "--launcher", "torchrun") == (16, 4)  # 4 per GPU process
    assert threads("--cpu", "--setup", "multi-gpu", "--procs-per-node", "3", "--launcher", "spawn") == (3, 1)
    bad = runner.invoke(main, ["generate", *base, "--launcher", "torchrun", "--cpus-per-task", "2", "--", "t.py"])
    assert bad.exit_code == 2 and "2 CPU(s) for the 4 processes each task runs" in bad.output
    assert "CPUs of one Slurm task" in runner.invoke(main, ["generate", "--help"]).output


def test_status_without_slurm_says_so_and_fails(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    result = runner.invoke(main, ["status"])
    assert result.exit_code == 1 and "Slurm is not available here" in result.output
    one = runner.invoke(main, ["status", "123"])
    assert one.exit_code == 1 and "Slurm is not available here" in one.output and "Traceback" not in one.output


def test_spare_nodes_imply_requeue_and_come_from_the_site_profile(runner, tmp_path, monkeypatch):
    out = _gen(runner, "--setup", "multi-node", "--nodes", "2", "--spare-nodes", "1", "--", "train.py")
    assert out.exit_code == 0 and "imply --requeue" in out.output and "#SBATCH --nodes=3" in out.output, out.output
    profile = tmp_path / "site.toml"
    profile.write_text("spare_nodes = 2\nrequeue = true\n")
    out = _gen(runner, "--profile", str(profile), "--setup", "multi-node", "--nodes", "2", "--", "train.py")
    assert out.exit_code == 0 and "#SBATCH --nodes=4" in out.output, out.output
    profile.write_text("spare_nodes = 1\n")  # as the docs say: a site profile's spare for every job
    out = _gen(runner, "--profile", str(profile), "--setup", "multi-node", "--nodes", "2", "--", "train.py")
    assert out.exit_code == 0 and "#SBATCH --nodes=3" in out.output and "#SBATCH --requeue" in out.output, out.output
    assert f"spare_nodes in {profile} imply --requeue" in out.output


def test_retries_with_no_requeue_are_a_contradiction_not_silently_requeue(runner, tmp_path):
    """UX review 4: `--min-nodes 1 --no-requeue` silently turned requeue on."""
    out = _gen(runner, "--setup", "multi-node", "--nodes", "2", "--min-nodes", "1", "--no-requeue", "--", "train.py")
    assert out.exit_code == 2 and "--min-nodes" in out.output and "--no-requeue forbids" in out.output, out.output
    profile = tmp_path / "site.toml"
    profile.write_text("spare_nodes = 1\nrequeue = false\n")
    out = _gen(runner, "--profile", str(profile), "--setup", "multi-node", "--nodes", "2", "--", "train.py")
    assert out.exit_code == 2 and "--no-requeue forbids" in out.output, out.output


def test_a_profile_mixing_top_level_keys_and_a_trainstack_table_keeps_both(runner, tmp_path):
    """UX review 4: the documented snippets combined (top-level keys, then [trainstack.node_check_thresholds])
    dropped the top-level keys silently -- the job went to the wrong partition."""
    profile = tmp_path / "site.toml"
    profile.write_text('partition = "spares"\n[trainstack.node_check_thresholds]\nmin_ratio = 0.5\n')
    out = _gen(runner, "--profile", str(profile), "--setup", "multi-node", "--nodes", "2", "--", "train.py")
    assert out.exit_code == 0 and "#SBATCH --partition=spares" in out.output, out.output
    profile.write_text('partition = "a"\n[trainstack]\npartition = "b"\n')
    out = _gen(runner, "--profile", str(profile), "--", "train.py")
    assert out.exit_code == 2 and "sets partition both at the top level and under [trainstack]" in out.output
