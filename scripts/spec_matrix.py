"""One valid LaunchSpec per setup x launcher x container x (GPU, CPU): what `make lint-hpc`, `make render-examples`
and the render tests render (a development fixture, not part of the package)."""

from __future__ import annotations

from typing import Any

from trainstack.render import CONTAINERS, LAUNCHERS, SETUPS, LaunchSpec

ACCELERATE = ("accelerate launch --num_processes {num_processes} --num_machines {num_machines} --machine_rank "
              "{machine_rank} --main_process_ip {main_process_ip} --main_process_port {main_process_port} train.py")


def spec_matrix(**overrides: Any) -> list[LaunchSpec]:
    specs = []
    for setup in SETUPS:
        for launcher in LAUNCHERS:
            for container in CONTAINERS:
                for cpu in (False, True):
                    kw: dict[str, Any] = {"setup": setup, "launcher": launcher, "container": container, "cpu": cpu,
                                          "nodes": 2 if setup == "multi-node" else 1, "log_dir": "/scratch/logs"}
                    if container != "none":
                        image = "/images/train.sif" if container == "apptainer" else "nvcr.io#nvidia/pytorch:25.08-py3"
                        kw.update(image=image, bind=["/data:/data:ro", "/scratch"])
                    if launcher == "custom":
                        kw["command"] = ACCELERATE
                    else:
                        kw["program"] = ["train.py", "--epochs", "3"]
                    if setup != "single-gpu":
                        kw.update(requeue=True, signal="B:USR1@90", cpus_per_task=4, mem="16G")
                    specs.append(LaunchSpec(**(kw | overrides)))
    return specs
