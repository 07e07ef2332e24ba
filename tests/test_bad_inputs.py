"""The bad-input census: every input of the reliability probe (and more) gets a short, clear error that names the bad
value -- no traceback, no silently wrong script or run, no hang.

Four tables: command-line options, site profiles, TrainConfig fields, and runtime inputs (Trainer, Accelerator,
checkpoints, data). Each row asserts the exit code (or exception type), that no traceback escaped, and that the
message contains the bad value (or the option that carries it).
"""

from __future__ import annotations

import os
import pickle
import signal

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Accelerator, Callback, TrainConfig, Trainer
from trainstack.checkpoint import CheckpointError
from trainstack.cli import main
from trainstack.errors import ConfigError, LaunchError, TrainstackError

# ------------------------------------------------------------------------------------------------------ CLI
G, CPU = ["generate"], ["generate", "--cpu"]
CLI_CASES = [
    # (argv, exit code, text the message must contain)
    (G + ["--nodes", "-1", "--", "t.py"], 2, "-1"), (G + ["--nodes", "0", "--", "t.py"], 2, "0 is less than 1"),
    (G + ["--nodes", "2.5", "--", "t.py"], 2, "2.5"), (G + ["--gpus-per-node", "-2", "--", "t.py"], 2, "-2"),
    (G + ["--setup", "multi-gpu", "--gpus-per-node", "99999", "--", "t.py"], 2, "99999"),
    (G + ["--gpus-per-node", "0", "--", "t.py"], 2, "0 is less than 1"),
    (CPU + ["--procs-per-node", "0", "--", "t.py"], 2, "0 is less than 1"),
    (CPU + ["--procs-per-node", "-1", "--", "t.py"], 2, "-1"),
    (G + ["--cpus-per-task", "0", "--", "t.py"], 2, "--cpus-per-task"),
    (G + ["--cpus-per-task", "x", "--", "t.py"], 2, "'x'"),
    (G + ["--time", "abc", "--", "t.py"], 2, "'abc'"), (G + ["--time", "", "--", "t.py"], 2, "''"),
    (G + ["--time", "-5", "--", "t.py"], 2, "'-5'"), (G + ["--time", "1-", "--", "t.py"], 2, "'1-'"),
    (G + ["--time", "01:00:00\n", "--", "t.py"], 2, "--time"), (G + ["--time", "1 hour", "--", "t.py"], 2, "1 hour"),
    (G + ["--time", "2h", "--", "t.py"], 2, "did you mean --time 02:00:00?"),
    (G + ["--time", "1d12h30m", "--", "t.py"], 2, "did you mean --time 1-12:30:00?"),
    (G + ["--mem", "abc", "--", "t.py"], 2, "'abc'"), (G + ["--mem", "-5G", "--", "t.py"], 2, "'-5G'"),
    (G + ["--setup", "foo", "--", "t.py"], 2, "foo"), (G + ["--launcher", "bar", "--", "t.py"], 2, "bar"),
    (G + ["--container", "docker", "--", "t.py"], 2, "docker"),
    (G + ["--setup", "multi-node", "--nodes", "1", "--", "t.py"], 2, "at least 2 nodes, got 1"),
    (G + ["--setup", "multi-gpu", "--nodes", "2", "--", "t.py"], 2, "got 2"),
    (G + ["--gpus-per-node", "2", "--", "t.py"], 2, "got 2"),
    (CPU + ["--procs-per-node", "2", "--", "t.py"], 2, "got 2"),
    (CPU + ["--gpus-per-node", "2", "--", "t.py"], 2, "--gpus-per-node"),
    (G + ["--procs-per-node", "2", "--", "t.py"], 2, "--procs-per-node"),
    (G, 2, "PROGRAM"), (G + ["--", ""], 2, "no program given"), (G + ["--python", "", "--", "t.py"], 2, "--python"),
    (G + ["--", "python"], 2, "'python' names an interpreter"),
    (G + ["--", "python", "-c", "print(1)"], 2, "python -c"), (G + ["--", "-m"], 2, "-m needs a module"),
    (G + ["--", "--epochs", "3"], 2, "'--epochs' looks like an option"),
    (G + ["--", "nosuchcommand_xyz"], 2, "'nosuchcommand_xyz'"),
    (G + ["--job-name", "a\nb", "--", "t.py"], 2, "--job-name"), (G + ["--job-name", "", "--", "t.py"], 2,
                                                                  "--job-name"),
    (G + ["--job-name", "   ", "--", "t.py"], 2, "--job-name"),
    (G + ["--partition", "p\r", "--", "t.py"], 2, "--partition"), (G + ["--account", "a\nb", "--", "t.py"], 2,
                                                                   "--account"),
    (G + ["--qos", "q\n#SBATCH --x", "--", "t.py"], 2, "--qos"), (G + ["--constraint", "c\n", "--", "t.py"], 2,
                                                                  "--constraint"),
    (G + ["--log-dir", "a\nb", "--", "t.py"], 2, "--log-dir"), (G + ["--chdir", "x\ny", "--", "t.py"], 2, "--chdir"),
    (G + ["--venv", "-x", "--", "t.py"], 2, "'-x'"), (G + ["--python", "-i", "--", "t.py"], 2, "'-i'"),
    (G + ["--nccl-debug", "INFO\nx", "--", "t.py"], 2, "--nccl-debug"),
    (G + ["--nccl-ifname", "ib0\n", "--", "t.py"], 2, "--nccl-ifname"),
    (G + ["--env", "NOEQUALS", "--", "t.py"], 2, "'NOEQUALS'"), (G + ["--env", "1BAD=x", "--", "t.py"], 2, "1BAD"),
    (G + ["--env", "=x", "--", "t.py"], 2, "''"), (G + ["--env", "A\n=x", "--", "t.py"], 2, "--env"),
    (G + ["--env", "A B=x", "--", "t.py"], 2, "'A B'"),
    (G + ["--signal", "kill -9", "--", "t.py"], 2, "'kill -9'"), (G + ["--signal", "B:USR2@60\n", "--", "t.py"], 2,
                                                                  "--signal"),
    (G + ["--signal", "USR1 @90", "--", "t.py"], 2, "'USR1 @90'"),
    (G + ["--max-restarts", "-1", "--launcher", "torchrun", "--", "t.py"], 2, "-1 is less than 0"),
    (G + ["--max-restarts", "2", "--", "t.py"], 2, "only applies to --launcher torchrun"),
    (G + ["--max-requeues", "-1", "--", "t.py"], 2, "--max-requeues"),
    (G + ["--max-retries", "-2", "--", "t.py"], 2, "--max-retries"),
    (G + ["--job-name", "exp/1", "--", "t.py"], 2, "contains '/'"),
    (G + ["--retry-on", "hang,segfault", "--", "t.py"], 2, "'segfault' is not a failure verdict"),
    (G + ["--container", "apptainer", "--", "t.py"], 2, "--image"),
    (G + ["--container", "pyxis", "--", "t.py"], 2, "--image"),
    (G + ["--image", "x.sif", "--", "t.py"], 2, "--container"), (G + ["--bind", "/a", "--", "t.py"], 2, "--container"),
    (G + ["--container", "pyxis", "--image", "i", "--bind", "/a,b:/c", "--", "t.py"], 2, "/a,b:/c"),
    (G + ["--container", "apptainer", "--image", "-x.sif", "--", "t.py"], 2, "'-x.sif'"),
    (G + ["--launcher", "custom", "--", ], 2, "--command"),
    (G + ["--launcher", "custom", "--command", "run {nprocs}", "--", ], 2, "nprocs"),
    (G + ["--launcher", "custom", "--command", "x", "--", "train.py"], 2, "train.py"),
    (G + ["--command", "x", "--", "t.py"], 2, "only applies to --launcher custom"),
    (G + ["--templates-dir", "/no/such/dir", "--", "t.py"], 2, "/no/such/dir"),
    (G + ["--profile", "/no/such/profile.toml", "--", "t.py"], 2, "/no/such/profile.toml"),
    (G + ["--bogus-option", "--", "t.py"], 2, "--bogus-option"), (["bogus-subcommand"], 2, "bogus-subcommand"),
    (["doctor", "--compute-setup", "tpu"], 2, "tpu"), (["doctor", "--bogus"], 2, "--bogus"),
    # sweeps and job ids (issue 11)
    (G + ["--sweep", "lr", "--", "t.py"], 2, "not KEY=V1,V2"), (G + ["--sweep", "=1,2", "--", "t.py"], 2, "not KEY"),
    (G + ["--sweep", "lr=", "--", "t.py"], 2, "empty value"), (G + ["--sweep", "lr=1,,2", "--", "t.py"], 2, "empty"),
    (G + ["--sweep", "lr=1,1", "--", "t.py"], 2, "repeats a value"),
    (G + ["--sweep", "lr=1", "--sweep", "lr=2", "--", "t.py"], 2, "given twice"),
    (G + ["--sweep", "l r=1", "--", "t.py"], 2, "not an option name"),
    (G + ["--max-parallel", "2", "--", "t.py"], 2, "only applies with --sweep"),
    (G + ["--sweep", "lr=1,2", "--max-parallel", "0", "--", "t.py"], 2, "less than 1"),
    (["submit", "--sweep", "lr", "--dry-run", "--", "t.py"], 2, "not KEY=V1,V2"),
    (["status", "x1"], 1, "is not a Slurm job id"), (["logs", "12.5"], 1, "is not a Slurm job id"),
    (["cancel", "1_x"], 1, "is not a Slurm job id"), (["logs", "12", "--rank", "x"], 2, "'x' is not a valid integer"),
    # the second probe and the new user's walk-through (issues 21, 22)
    (["status", "0"], 1, "0 is not a job"), (["cancel", "0"], 1, "0 is not a job"), (["debug", "0_1"], 1, "not a"),
    (G + ["--sweep", "a=" + ",".join(map(str, range(100))), "--sweep", "b=" + ",".join(map(str, range(100))),
          "--sweep", "c=" + ",".join(map(str, range(100))), "--", "t.py"], 2, "1000000 tasks"),
    (G + ["--launcher", "torchrun", "--", "t.py", "--v", "1"], 2, "abbreviation torchrun cannot tell apart"),
    (G + ["--launcher", "torchrun", "--sweep", "max=1,2", "--", "t.py"], 2, "'--max' is an abbreviation"),
    (G + ["--setup", "multi-gpu", "--launcher", "torchrun", "--cpus-per-task", "1", "--", "t.py"], 2,
     "1 CPU(s) for the 2 processes"),
    (G + ["--signal", "B:USR2@300", "--time", "5", "--", "t.py"], 2, "300 s before a time limit of 300 s"),
    (G + ["--setup", "multi-gpu", "t.py", "--gpus-per-node", "4"], 2, "--gpus-per-node come(s) after the program"),
    (G + ["--container", "pyxis", "--image", "i", "--log-dir", "/a,b", "--", "t.py"], 2, "pyxis mounts it"),
]


@pytest.mark.parametrize("argv, code, needle", CLI_CASES, ids=[" ".join(c[0])[:60] for c in CLI_CASES])
def test_cli_bad_input(argv, code, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert needle in result.output, result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) <= 6, result.output


def test_cli_output_file_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    cases = [(["-o", str(tmp_path / "file" / "below.sbatch")], "cannot write"), (["-o", str(tmp_path)], "a folder"),
             (["-o", str(tmp_path / "file")], "--force")]
    for extra, needle in cases:
        result = CliRunner().invoke(main, ["generate", *extra, "--", "t.py"])
        assert result.exit_code == 2 and needle in result.output and result.exception is None or isinstance(
            result.exception, SystemExit), result.output


def test_site_template_errors_are_short(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, text, needle in (("syntax", "{% if %}", "line 1"), ("undef", "{{ no_such_value }}", "no_such_value")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "slurm.sbatch.j2").write_text(text)
        result = CliRunner().invoke(main, ["generate", "--templates-dir", str(folder), "--", "t.py"])
        assert result.exit_code == 1 and needle in result.output and "Traceback" not in result.output


# ------------------------------------------------------------------------------------------------------ profiles
PROFILE_CASES = [
    # (file name, content, text the message must contain)
    ("bad.toml", "nodes = [", "not valid TOML"), ("bad.yaml", "a: [1,\n  b", "not valid YAML"),
    ("list.yaml", "- a\n- b\n", "table of option values"), ("unknown.toml", "nodez = 3\n", "'nodez'"),
    ("two.toml", 'nodes = "two"\n', "'two'"), ("gpus.toml", 'gpus_per_node = "4"\n', "'4'"),
    ("cpu.toml", 'cpu = "no"\n', "'no'"), ("env.toml", 'env = "X=1"\n', "X=1"),
    ("envkey.toml", '[env]\n"A B" = "1"\n', "'A B'"), ("reqs.toml", "max_requeues = -4\n", "--max-requeues"),
    ("retry.toml", 'retry_on = ["hang", "oops"]\n', "'oops' is not a failure verdict"),
    ("nodes.toml", "nodes = 3\n", "got 3"), ("bind.toml", 'container = "pyxis"\nimage = "i"\nbind = "/a,b:/c"\n',
                                            "/a,b:/c"),
    ("bool.toml", "exclusive = 1\n", "--exclusive"), ("time.toml", "time = true\n", "--time"),
    ("tmpl.toml", 'templates_dir = "nowhere"\n', "nowhere"),
]


@pytest.mark.parametrize("name, content, needle", PROFILE_CASES, ids=[c[0] for c in PROFILE_CASES])
def test_profile_bad_input(name, content, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / name
    path.write_text(content)
    result = CliRunner().invoke(main, ["generate", "--profile", str(path), "--", "t.py"])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert needle in result.output and "Traceback" not in result.output, result.output


@pytest.mark.parametrize("content, needle", [
    ('setup_cmd = "module load cuda"\n', "\nmodule load cuda\n"),
    ('container = "apptainer"\nimage = "i.sif"\nbind = "/data:/data"\n', "--bind /data:/data i.sif"),
    ('program = "ignored.py"\n', None), ("time = 60\n", "#SBATCH --time=60"),
])
def test_profile_strings_for_lists_are_one_item_not_characters(content, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.toml").write_text(content)
    result = CliRunner().invoke(main, ["generate", "--profile", str(tmp_path / "p.toml"), "--", "t.py"])
    assert result.exit_code == 0, result.output
    if needle:
        assert needle in result.output
    assert "\nm\no\nd" not in result.output and "t r a i n" not in result.output


# ------------------------------------------------------------------------------------------------------ TrainConfig
CONFIG_CASES = [
    ({"max_iter": "10"}, "max_iter='10'"), ({"max_iter": -1}, "max_iter=-1"), ({"max_iter": 1.5}, "max_iter=1.5"),
    ({"max_iter": True}, "max_iter=True"), ({"nprocs": 0}, "nprocs=0"), ({"nprocs": 2.0}, "nprocs=2.0"),
    ({"print_every": -1}, "print_every=-1"), ({"write_every": "1"}, "write_every='1'"),
    ({"checkpoint_every": "5"}, "checkpoint_every='5'"), ({"plot_every": -2}, "plot_every=-2"),
    ({"val_every": 0.5}, "val_every=0.5"), ({"seed": -1}, "seed=-1"), ({"seed": "0"}, "seed='0'"),
    ({"keep_last_checkpoints": 0}, "keep_last_checkpoints=0"), ({"gradient_accumulation_steps": 0},
                                                                "gradient_accumulation_steps=0"),
    ({"max_batches": 0}, "max_batches=0"), ({"stop_check_every": 0}, "stop_check_every=0"),
    ({"compute_setup": "tpu"}, "compute_setup='tpu'"), ({"backend": "ucc"}, "backend='ucc'"),
    ({"log_setup": "gpu"}, "log_setup='gpu'"), ({"tracking_tool": "comet"}, "tracking_tool='comet'"),
    ({"mixed_precision": "fp4"}, "mixed_precision='fp4'"), ({"dtype": "float32"}, "dtype='float32'"),
    ({"dtype": torch.int64}, "torch.int64"), ({"root_folder": 123}, "root_folder=123"),
    ({"log_folder": None}, "log_folder=None"), ({"stop_file": 3}, "stop_file=3"),
    ({"callbacks": [lambda t: t]}, "callbacks"), ({"callbacks": "print"}, "callbacks"),
    ({"hyperparams": "lr=1"}, "hyperparams"), ({"val_epsilon": -1}, "val_epsilon=-1"),
    ({"grad_clip_norm": 0}, "grad_clip_norm=0"), ({"grad_clip_norm": "1.0"}, "grad_clip_norm='1.0'"),
    ({"resume": 123}, "resume=123"), ({"resume": True}, "resume=True"),
    ({"stop_signals": ("SIGFOO",)}, "'SIGFOO'"), ({"stop_signals": "SIGUSR2"}, "'SIGUSR2'"),
    ({"stop_signals": ("SIGKILL",)}, "'SIGKILL' cannot be caught"), ({"stop_signals": ("STOP",)}, "'STOP'"),
    ({"checkpoint_best_only": True}, "val_every"), ({"plot_every": 2}, "plotting_functions"),
    ({"plotting_functions": ("x",)}, "plotting_functions"), ({"validation_criterion": 3}, "validation_criterion=3"),
    ({"trainstop_criterion": "stop"}, "trainstop_criterion='stop'"),
    ({"resume": "auto", "create_subfolder_per_run": True}, "create_subfolder_per_run"),
    ({"log_folder": "x", "create_subfolder_per_run": True}, "log_folder='x'"),
    ({"mixed_precision": "fp4"}, "mixed_precision='fp4'"), ({"max_epochs": 3}, "max_epochs"),
]


@pytest.mark.parametrize("kwargs, needle", CONFIG_CASES, ids=[str(c[0])[:50] for c in CONFIG_CASES])
def test_config_bad_input(kwargs, needle):
    with pytest.raises((ConfigError, TypeError)) as exc:
        TrainConfig(**kwargs)
    message = str(exc.value)
    assert needle in message and len(message.splitlines()) <= 3, message


def test_positional_config_argument_is_named():
    with pytest.raises(TypeError, match="positional"):
        TrainConfig(10)  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------------ runtime
def _model(width=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 4), nn.Tanh(), nn.Linear(4, 1))


def _loader(width=3, n=16, classes=None):
    y = torch.randint(0, classes, (n,)) if classes else torch.randn(n, 1)
    return DataLoader(TensorDataset(torch.randn(n, width), y), batch_size=4)


def _fit(tmp_path, model=None, loader=None, optimizer=None, **kw):
    model = model or _model()
    cfg_kw = {k: kw.pop(k) for k in list(kw) if k in TrainConfig.__dataclass_fields__}
    cfg = TrainConfig(**({"max_iter": 1, "log_folder": tmp_path / "run", "verbose": False, "compute_setup": "cpu"}
                         | cfg_kw))
    optimizer = optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), lr=0.1)
    return Trainer(model, optimizer, cfg, **kw).fit(loader if loader is not None else _loader())


class _Evil:
    def __init__(self, canary):
        self.canary = str(canary)

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def _write(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


RUNTIME_CASES = {
    "accelerator nprocs 0": (lambda t: Accelerator(nprocs=0), ConfigError, "nprocs=0"),
    "accelerator nprocs str": (lambda t: Accelerator(nprocs="2"), ConfigError, "nprocs='2'"),
    "accelerator dtype str": (lambda t: Accelerator(dtype="float32"), ConfigError, "dtype='float32'"),
    "accelerator backend": (lambda t: Accelerator(backend="ucc"), ConfigError, "backend='ucc'"),
    "accelerator nccl on cpu": (lambda t: Accelerator(compute_setup="cpu", backend="nccl"), ConfigError, "nccl"),
    "model is a string": (lambda t: Trainer("model", None, TrainConfig()), ConfigError, "str"),
    "optimizer None": (lambda t: Trainer(_model(), None, TrainConfig()), ConfigError, "NoneType"),
    "optimizer string": (lambda t: Trainer(_model(), "adam", TrainConfig()), ConfigError, "str"),
    "config dict": (lambda t: Trainer(_model(), None, {"max_iter": 1}), ConfigError, "dict"),
    "loss_fn l1": (lambda t: Trainer(_model(), torch.optim.SGD(_model().parameters(), lr=1), TrainConfig(),
                                     loss_fn="l1"), ConfigError, "'l1'"),
    "loss_fn number": (lambda t: Trainer(_model(), torch.optim.SGD(_model().parameters(), lr=1), TrainConfig(),
                                         loss_fn=3), ConfigError, "loss_fn=3"),
    "loader int": (lambda t: _fit(t, loader=5), ConfigError, "int"),
    "loader dataset": (lambda t: _fit(t, loader=TensorDataset(torch.randn(4, 3), torch.randn(4, 1))), ConfigError,
                       "TensorDataset"),
    "loader generator": (lambda t: _fit(t, loader=(b for b in _loader())), ConfigError, "generator"),
    "loader empty": (lambda t: _fit(t, loader=DataLoader(TensorDataset(torch.randn(0, 3)), batch_size=2)),
                     ConfigError, "no batches"),
    "loss vector": (lambda t: _fit(t, loss_fn=lambda m, b: (m(b[0]) - b[1]) ** 2), ConfigError, "shape (4, 1)"),
    "loss float": (lambda t: _fit(t, loss_fn=lambda m, b: 0.5), ConfigError, "float"),
    "loss int tensor": (lambda t: _fit(t, loss_fn=lambda m, b: torch.tensor(1)), ConfigError, "torch.int64"),
    "cross_entropy regression": (lambda t: _fit(t, loss_fn="cross_entropy", loader=_loader(classes=3)), ConfigError,
                                 "1 output"),
    "width mismatch": (lambda t: _fit(t, loader=_loader(width=5)), RuntimeError, "first training step failed"),
    "val_every without loader": (lambda t: _fit(t, val_every=1), ConfigError, "val_every=1"),
    "custom step with clipping": (lambda t: _fit(t, grad_clip_norm=1.0, optimize_step=lambda *a: None), ConfigError,
                                  "custom optimize_step"),
    "lbfgs with accumulation": (lambda t: _fit(t, gradient_accumulation_steps=2, optimizer=torch.optim.LBFGS(
        _model().parameters())), ConfigError, "LBFGS"),
    "resume missing path": (lambda t: _fit(t, resume=t / "nope.pt"), CheckpointError, "nope.pt"),
    "resume a folder": (lambda t: _fit(t, resume=t), CheckpointError, "is a folder"),
    "resume random bytes": (lambda t: _fit(t, resume=_write(t, "r.pt", os.urandom(64))), CheckpointError, "r.pt"),
    "resume plain state_dict": (lambda t: (torch.save(_model().state_dict(), t / "sd.pt"),
                                           _fit(t, resume=t / "sd.pt")), CheckpointError, "not a trainstack"),
    "resume malicious pickle": (lambda t: _fit(t, resume=_write(t, "evil.pt", pickle.dumps(_Evil(t / "CANARY"))))
                                , CheckpointError, "evil.pt"),
    "second run same folder": (lambda t: (_fit(t), _fit(t)), ConfigError, "resume='auto'"),
    "resume other shape": (lambda t: (_fit(t, checkpoint_every=1), _fit(t, model=_model(5), loader=_loader(5),
                                                                         resume="auto")),
                           CheckpointError, "size mismatch"),
    "resume adam into sgd": (lambda t: (_fit(t, optimizer=torch.optim.Adam(_model().parameters())),
                                        _fit(t, resume="auto")), ConfigError, "optimizer: Adam -> SGD"),
    "gpu without cuda": (lambda t: Accelerator(compute_setup="gpu"), ConfigError, "compute_setup='gpu'"),
    "set_use_grad str": (lambda t: Trainer.set_use_grad("no"), ConfigError, "'no'"),
    "callback on idle": (lambda t: Callback(on="idle"), ConfigError, "'idle'"),
    "callback called_every": (lambda t: Callback(called_every=-1), ConfigError, "called_every=-1"),
    "all_reduce op": (lambda t: Accelerator(compute_setup="cpu").all_reduce_dict({"a": 1.0}, op="median"),
                      ConfigError, "'median'"),
}


@pytest.mark.parametrize("name", sorted(RUNTIME_CASES))
def test_runtime_bad_input(name, tmp_path):
    make, kind, needle = RUNTIME_CASES[name]
    if name == "gpu without cuda" and torch.cuda.is_available():
        pytest.skip("checks the CPU-only message")
    with pytest.raises(kind) as exc:
        make(tmp_path)
    text = str(exc.value) + "".join(getattr(exc.value, "__notes__", []))
    assert needle in text, text
    if issubclass(kind, TrainstackError):
        assert len(str(exc.value).splitlines()) <= 4, str(exc.value)
    assert not (tmp_path / "CANARY").exists()


def test_environment_variables_with_bad_values_are_named(monkeypatch):
    monkeypatch.setenv("TRAINSTACK_TIMEOUT_S", "soon")
    from trainstack._runtime.pgsession import _timeout

    with pytest.raises(LaunchError, match="TRAINSTACK_TIMEOUT_S='soon'"):
        _timeout()
    monkeypatch.setenv("TRAINSTACK_STOP_SIGNALS", "FOO")
    from trainstack._runtime.preemption import resolve_signals

    with pytest.raises(ConfigError, match="'FOO'"):
        resolve_signals(None)
    assert signal.SIGUSR2 in resolve_signals(["USR2"])


def test_the_census_covers_at_least_180_inputs():
    total = len(CLI_CASES) + len(PROFILE_CASES) + len(CONFIG_CASES) + len(RUNTIME_CASES) + 3 + 2 + 4 + 3 + 1
    assert total >= 180, total
