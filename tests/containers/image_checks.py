"""What can be checked inside a trainstack image without a GPU (scripts/image-lib.sh runs this in the image, as
the image's own user, with no network). Prints one line per check and exits 1 on the first failure.

    docker run --rm --network none -v $PWD/tests/containers/image_checks.py:/tmp/c.py:ro IMAGE python /tmp/c.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from importlib import metadata
from pathlib import Path

# CUDA libraries a second copy of which would come from a CUDA base image under the pip wheels (pain: 20 GB images)
CUDA_FAMILIES = ("libcudart", "libcublas", "libcublasLt", "libcudnn", "libnccl", "libcufft", "libcurand",
                 "libcusolver", "libcusparse", "libnvrtc", "libnvJitLink")
SONAME = re.compile(r"^(lib[A-Za-z]+)\.so\.\d+(\.\d+)*$")


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        sys.exit(1)


def cuda_libraries() -> dict[str, list[str]]:
    """Real files (not links) of each CUDA library family anywhere in the image's /usr and /opt."""
    found: dict[str, list[str]] = {}
    for root in ("/usr", "/opt"):
        for folder, _dirs, files in os.walk(root):
            for name in files:
                m = SONAME.match(name)
                path = os.path.join(folder, name)
                if m and m.group(1) in CUDA_FAMILIES and not os.path.islink(path):
                    found.setdefault(m.group(1), []).append(path)
    return found


def main() -> None:
    import torch

    from trainstack._common.transport import missing_libraries

    versions = json.loads(Path("/opt/trainstack/versions.json").read_text())
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None
    check("versions.json", versions["torch"] == torch.__version__ and versions["cuda"] == torch.version.cuda
          and versions["nccl"] == nccl, f"torch {torch.__version__}, cuda {torch.version.cuda}, nccl {nccl}")
    gpu = torch.version.cuda is not None
    libs = cuda_libraries()
    twice = {family: paths for family, paths in libs.items() if len(paths) > 1}
    check("each CUDA library once", not twice,
          f"{len(libs)} families, one copy each" if not twice else f"more than one copy: {twice}")
    if gpu:
        check("CUDA libraries present", {"libcudart", "libcublas", "libcudnn", "libnccl"} <= set(libs),
              ", ".join(sorted(libs)))
    check("no CUDA driver baked in", not any(Path(p).name.startswith("libcuda.so") for p in _so_files()),
          "libcuda comes from the host at run time (toolkit, --nv, enroot hooks)")
    for transport in ("ib", "socket"):
        gone = missing_libraries(transport)
        check(f"libraries NCCL's {transport} transport loads", not gone, "all load" if not gone else str(gone))
    constraints = Path(os.environ.get("PIP_CONSTRAINT", "/nonexistent"))
    pins = dict(line.split("==", 1) for line in constraints.read_text().split() if "==" in line) \
        if constraints.is_file() else {}
    check("pip constraints pin the tested stack", pins.get("torch") == metadata.version("torch")
          and (not gpu or any(k.startswith("nvidia-nccl") for k in pins)),
          f"{constraints}: {len(pins)} pins, torch=={pins.get('torch')}")
    include = Path(sysconfig.get_paths()["include"]) / "Python.h"
    check("a C compiler and Python headers for torch.compile", bool(shutil.which("gcc")) and include.is_file(),
          f"gcc {shutil.which('gcc')}, {include}")
    if gpu:
        import triton  # noqa: F401  (Triton builds its launcher with gcc at run time)

        check("triton", True, metadata.version("triton"))
        check("container-toolkit variables", os.environ.get("NVIDIA_VISIBLE_DEVICES") == "all"
              and "compute" in os.environ.get("NVIDIA_DRIVER_CAPABILITIES", ""),
              f"NVIDIA_VISIBLE_DEVICES={os.environ.get('NVIDIA_VISIBLE_DEVICES')} "
              f"NVIDIA_DRIVER_CAPABILITIES={os.environ.get('NVIDIA_DRIVER_CAPABILITIES')}")
    check("non-root", os.getuid() == 1000, f"uid {os.getuid()}")
    with tempfile.NamedTemporaryFile(dir="/workspace") as f:
        check("/workspace writable", True, f.name)
    doctor = subprocess.run(["trainstack", "doctor"], capture_output=True, text=True, timeout=120)
    check("trainstack doctor", doctor.returncode == 0, (doctor.stdout + doctor.stderr).strip().splitlines()[-1])


def _so_files():
    for root in ("/usr/lib", "/opt"):
        for _folder, _dirs, files in os.walk(root):
            yield from (name for name in files if ".so" in name)


if __name__ == "__main__":
    main()
