"""TrainConfig validation: every bad or contradictory setting fails at construction, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainstack import Callback, TrainConfig
from trainstack.errors import ConfigError


@pytest.mark.parametrize("kwargs, needle", [
    ({"max_iter": -1}, "max_iter=-1"),
    ({"max_iter": 2.5}, "max_iter=2.5"),
    ({"print_every": True}, "print_every=True"),
    ({"nprocs": 0}, "nprocs=0"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0"),
    ({"keep_last_checkpoints": 0}, "keep_last_checkpoints=0"),
    ({"max_batches": 0}, "max_batches=0"),
    ({"seed": -3}, "seed=-3"),
    ({"seed_every_step": True}, "seed_every_step=True needs a seed"),
    ({"compute_setup": "tpu"}, "compute_setup='tpu'"),
    ({"backend": "ucc"}, "backend='ucc'"),
    ({"tracking_tool": "comet"}, "tracking_tool='comet'"),
    ({"mixed_precision": "fp4"}, "mixed_precision='fp4'"),
    ({"dtype": "float64"}, "dtype='float64'"),
    ({"val_epsilon": -1}, "val_epsilon=-1"),
    ({"grad_clip_norm": 0}, "grad_clip_norm=0"),
    ({"resume": 3}, "resume=3"),
    ({"root_folder": 5}, "root_folder=5"),
    ({"callbacks": [print]}, "callbacks must be a list of trainstack Callback"),
    ({"validation_criterion": "lower"}, "validation_criterion='lower'"),
    ({"hyperparams": [1]}, "hyperparams must be a dict"),
    ({"checkpoint_best_only": True}, "needs validation: set val_every"),
    ({"plot_every": 2}, "plotting_functions is empty"),
    ({"log_folder": "x", "create_subfolder_per_run": True}, "contradict each other"),
    ({"resume": "auto", "create_subfolder_per_run": True}, "cannot find earlier checkpoints"),
    ({"mixed_precision": "fp4"}, "mixed_precision='fp4'"),
])
def test_bad_settings_name_the_field(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        TrainConfig(**kwargs)


def test_unknown_field_fails_at_construction_and_suggests_the_nearest():
    with pytest.raises(TypeError, match="batch_sizee.*did you mean batch_size"):
        TrainConfig(batch_sizee=3)
    with pytest.raises(ConfigError, match=r"no field 'max_epochs'. HINT: use max_iter \(epochs\) or max_steps"):
        TrainConfig(max_epochs=3)
    with pytest.raises(ConfigError, match="accumulate_grad_batches'. HINT: use gradient_accumulation_steps"):
        TrainConfig(accumulate_grad_batches=2)


def test_positional_arguments_are_rejected():
    with pytest.raises(TypeError):
        TrainConfig(10)  # keyword-only: TrainConfig(max_iter=10)


def test_defaults_and_normalisation():
    cfg = TrainConfig(root_folder="logs", resume=False, callbacks=(Callback(callback=print),))
    assert cfg.root_folder == Path("logs") and cfg.resume is None and isinstance(cfg.callbacks, list)
    assert cfg.max_iter == 10000 and cfg.tracking_tool == "jsonl" and cfg.compute_setup == "auto"


def test_to_dict_is_plain_and_weights_only_loadable(tmp_path):
    cfg = TrainConfig(dtype=torch.float64, validation_criterion=lambda a, b, c: a < b, hyperparams={"lr": 0.1,
                      "obj": object()})
    d = cfg.to_dict()
    torch.save(d, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=True) == d
    assert d["dtype"] == "torch.float64" and d["validation_criterion"] == "<lambda>"
    assert cfg.changed().keys() == {"dtype", "validation_criterion", "hyperparams"}


# ---------------------------------------------------------------------------------------------- files and the CLI
def test_from_cli_reads_every_kind_of_field_and_the_command_line_wins():
    cfg = TrainConfig.from_cli(["--max-iter", "5", "--max_steps=40", "--grad-clip-norm", "0.5", "--no-verbose",
                                "--all-reduce-metrics", "--dtype", "float64", "--stop-signals", "USR2,TERM",
                                "--resume", "none", "--root-folder", "runs", "--hyperparams", '{"lr": 0.1}'],
                               max_iter=99, seed=3)
    assert (cfg.max_iter, cfg.max_steps, cfg.grad_clip_norm, cfg.verbose, cfg.all_reduce_metrics) == (5, 40, 0.5,
                                                                                                      False, True)
    assert cfg.dtype is torch.float64 and cfg.stop_signals == ("USR2", "TERM") and cfg.resume is None
    assert cfg.root_folder == Path("runs") and cfg.hyperparams == {"lr": 0.1} and cfg.seed == 3


def test_from_cli_round_trips_through_a_file_and_what_a_sweep_appends(tmp_path):
    cfg = TrainConfig(max_iter=7, gradient_accumulation_steps=4, dtype=torch.float32, stop_signals=("SIGUSR2",),
                      log_every_seconds=2.5, resume="auto")
    for name in ("cfg.yaml", "cfg.json"):
        path = cfg.to_file(tmp_path / name)
        again = TrainConfig.from_cli(["--config", str(path), "--max-iter", "8"], max_iter=1,
                                     gradient_accumulation_steps=1)
        # the command line wins over the file, the file over the script's defaults
        assert again.max_iter == 8 and again.gradient_accumulation_steps == 4
        assert {k: v for k, v in again.to_dict().items() if k != "max_iter"} == \
            {k: v for k, v in cfg.to_dict().items() if k != "max_iter"}
    (tmp_path / "cfg.toml").write_text("[train]\nmax_iter = 3\nmixed_precision = 'bf16'\n")
    assert TrainConfig.from_file(tmp_path / "cfg.toml").mixed_precision == "bf16"
    # trainstack submit --sweep gradient_accumulation_steps=1,2 appends exactly this to each task's program
    assert TrainConfig.from_cli(["--gradient_accumulation_steps", "2"]).gradient_accumulation_steps == 2


@pytest.mark.parametrize("argv, needle", [
    (["--max-iter", "ten"], "max_iter='ten' is not a valid int"), (["--max-iter"], "--max_iter needs a value"),
    (["--max-epochs", "3"], "'--max-epochs' is not a field. HINT: use max_iter"),
    (["--verbose", "maybe"], "verbose='maybe'"), (["--max-iter", "-1"], "max_iter=-1"),
    (["--dtype", "float99"], "dtype='float99'"), (["train.py"], "'train.py' is not a field"),
    (["--config", "/nonexistent.yaml"], "cannot read the config file /nonexistent.yaml")])
def test_from_cli_errors_are_config_errors_naming_the_argument(argv, needle):
    with pytest.raises(ConfigError) as exc:
        TrainConfig.from_cli(argv)
    assert needle in str(exc.value), str(exc.value)


def test_parse_cli_gives_back_the_scripts_own_arguments():
    cfg, rest = TrainConfig.parse_cli(["--data", "/d", "--max-iter", "2", "-v", "--lr=0.1", "pos"])
    assert cfg.max_iter == 2 and rest == ["--data", "/d", "-v", "--lr=0.1", "pos"]


def test_bad_files_are_clear(tmp_path):
    (tmp_path / "bad.yaml").write_text("max_iter: [1\n")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "typo.json").write_text('{"max_iterr": 2}')
    with pytest.raises(ConfigError, match="bad.yaml is not a valid yaml file"):
        TrainConfig.from_file(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="must hold a table of TrainConfig fields"):
        TrainConfig.from_file(tmp_path / "list.json")
    with pytest.raises(ConfigError, match="did you mean max_iter"):
        TrainConfig.from_file(tmp_path / "typo.json")


def test_help_shows_every_field_with_its_default_and_doc():
    from dataclasses import fields

    docs = TrainConfig.field_docs()
    assert list(docs) == [f.name for f in fields(TrainConfig)]
    assert all(doc for _, doc in docs.values()), [k for k, (_, d) in docs.items() if not d]
    assert docs["max_iter"][0] == "10000" and docs["print_every"][0] == "0" and "qml_logs" in docs["root_folder"][0]
    text = TrainConfig.__doc__ or ""
    assert all(f"    {name} = " in text for name in docs)


def test_the_docs_field_table_is_generated_from_the_dataclass():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "scripts/reference_pages.py", "--check"], cwd=root, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    page = (root / "docs" / "reference" / "trainconfig.md").read_text()
    for name in TrainConfig.field_docs():
        assert f"| `{name}`" in page, name


def test_from_cli_help_lists_every_option_and_exits(capsys):
    with pytest.raises(SystemExit) as exc:
        TrainConfig.from_cli(["--max_iter", "3", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--max_iter 3 " in out and "--gradient_accumulation_steps 1 " in out and "--callbacks" not in out


@pytest.mark.parametrize(("field", "value"), [("root_folder", "s3://bucket/runs"), ("log_folder", "gs://b/run"),
                                              ("resume", "s3://bucket/runs/ckpt-e00001-s000000010.pt"),
                                              ("log_folder", Path("hf://datasets/x"))])
def test_a_url_is_refused_never_made_a_local_folder(field, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scheme = str(value).split(":")[0]
    with pytest.raises(ConfigError, match=rf"TrainConfig\.{field}=.* is a {scheme}:// URL.* would become a local "
                                          rf"folder named '{scheme}:'\. HINT: give a path on a local or shared file"):
        TrainConfig(**{field: value})
    assert not list(tmp_path.iterdir()), "nothing was created"
    assert TrainConfig(log_folder="runs/s3:x").log_folder == Path("runs/s3:x")  # a colon inside a path is a path
