"""nntool's ``slurm_fn`` / ``SlurmConfig``, on trainstack's submitter: code written for nntool runs with the import
changed to ``from trainstack.slurm import slurm_fn, SlurmConfig``.

    @slurm_fn
    def main(config): ...

    job = main[SlurmConfig(mode="slurm", partition="gpu", num_of_node=2, gpus_per_node=4)](config)
    job.result()                         # rank 0's return value

Modes: ``slurm`` submits (through ``trainstack.submit.submit_function`` or, with ``use_distributed_env``, the
``custom`` launcher: one code path with ``trainstack submit``); ``local`` runs the same job runner in a local
subprocess; ``debug`` (and nntool's ``run``) call the function in this process. Torch-free, like the rest of the
Slurm side.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from ._common import envvars as envvars
from .errors import ConfigError

__all__ = ["SlurmConfig", "SlurmFunction", "slurm_fn", "LocalJob"]

R = TypeVar("R")
MODES = ("slurm", "local", "debug", "run")


@dataclass
class SlurmConfig:
    """nntool's field names and defaults (``mode``, ``num_of_node``, ``tasks_per_node``, ``gpus_per_node`` ...);
    each is checked here with a message naming it."""

    mode: str = "run"
    job_name: str = "Job"
    partition: str = ""
    output_parent_path: str = "./"
    output_folder: str = "slurm"
    node_list: str = ""
    node_list_exclude: str = ""
    num_of_node: int = 1
    tasks_per_node: int = 1
    gpus_per_task: int = 0
    cpus_per_task: int = 1
    gpus_per_node: int | None = None
    mem: str = ""
    timeout_min: int = 60
    stderr_to_stdout: bool = False
    setup: list[str] = field(default_factory=list)
    use_distributed_env: bool = False
    distributed_env_task: str = "torch"
    processes_per_task: int = 1
    distributed_launch_command: str = ""
    extra_params_kwargs: dict[str, str] = field(default_factory=dict)
    # nntool's fields trainstack does not take: accepted at their defaults, refused (with why) otherwise
    pack_code: bool = False
    use_packed_code: bool = False
    code_root: str = "."
    extra_submit_kwargs: dict[str, str] = field(default_factory=dict)
    extra_task_kwargs: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"SlurmConfig.mode={self.mode!r}: must be one of {MODES}.")
        for name in ("num_of_node", "tasks_per_node", "cpus_per_task", "processes_per_task", "timeout_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"SlurmConfig.{name}={value!r}: must be an integer >= 1.")
        if self.use_distributed_env and not self.distributed_launch_command:
            raise ConfigError("SlurmConfig.use_distributed_env=True needs distributed_launch_command (e.g. 'torchrun "
                              "--nnodes {num_machines} --node_rank {machine_rank} ... main.py').")
        if self.tasks_per_node != 1 and self.use_distributed_env:
            raise ConfigError(f"SlurmConfig.tasks_per_node={self.tasks_per_node}: the distributed launch command runs "
                              f"once per node (tasks_per_node=1) and starts processes_per_task processes itself.")
        unsupported = {"node_list_exclude": self.node_list_exclude, "extra_params_kwargs": self.extra_params_kwargs,
                       "extra_submit_kwargs": self.extra_submit_kwargs, "extra_task_kwargs": self.extra_task_kwargs,
                       "distributed_env_task": self.distributed_env_task != "torch",
                       "pack_code": self.pack_code or self.use_packed_code or self.code_root != "."}
        for name, value in unsupported.items():
            if value:
                why = ("trainstack snapshots the code of every submission by itself (the job folder's code/)"
                       if name == "pack_code" else "use LaunchSpec / trainstack submit options for other sbatch "
                       "settings")
                raise ConfigError(f"SlurmConfig.{name} is not supported by trainstack: {why}.")

    @property
    def output_path(self) -> Path:
        """Where job folders go: ``output_parent_path/output_folder`` (nntool's layout)."""
        return Path(self.output_parent_path) / self.output_folder

    def launch_spec(self) -> dict[str, Any]:
        """The LaunchSpec fields of this config (one generator for nntool's jobs and ``trainstack submit``)."""
        gpus = self.gpus_per_node if self.gpus_per_node is not None else self.gpus_per_task * self.tasks_per_node
        minutes = self.timeout_min
        spec: dict[str, Any] = {
            "job_name": self.job_name, "partition": self.partition or None, "nodes": self.num_of_node,
            "cpus_per_task": self.cpus_per_task, "mem": self.mem or None, "log_dir": str(self.output_path),
            "time": f"{minutes // 60:02d}:{minutes % 60:02d}:00", "setup_cmd": list(self.setup),
            "nodelist": self.node_list or None, "cpu": not gpus, "gpus_per_node": gpus or None,
            "setup": "multi-node" if self.num_of_node > 1 else ("multi-gpu" if gpus > 1 else "single-gpu"),
        }
        procs = self.processes_per_task if self.use_distributed_env else self.tasks_per_node
        if not gpus:  # CPU nodes: the processes per node; on GPU nodes one process per GPU
            spec["procs_per_node"] = procs
        if self.use_distributed_env:
            spec.update(launcher="custom", command=self.distributed_launch_command, env={envvars.SLURM_FN: "1"})
        else:  # the job imports the script again to find the function: there, fn[config](...) calls it
            spec.update(launcher="srun", env={envvars.SLURM_FN: "1"})
        return spec


class LocalJob:
    """What ``local``/``debug`` modes return: the finished call, with a job's ``result()``/``state``."""

    def __init__(self, value: Any, job_id: str) -> None:
        self._value, self.job_id, self.state = value, job_id, "COMPLETED"

    def result(self, timeout: float | None = None) -> Any:
        return self._value

    def done(self) -> bool:
        return True


class SlurmFunction(Generic[R]):
    """``fn`` with a SlurmConfig: ``fn[config](*args)`` runs it as the config's mode says; ``fn(*args)`` inside a
    job launched by ``distributed_launch_command`` (or with no config) just calls it."""

    def __init__(self, fn: Callable[..., R], config: SlurmConfig | None = None) -> None:
        self.fn, self.config = fn, config
        self.__doc__, self.__name__ = fn.__doc__, getattr(fn, "__name__", "function")

    def __getitem__(self, config: SlurmConfig | dict[str, Any]) -> SlurmFunction[R]:
        if isinstance(config, dict):
            config = SlurmConfig(**config)
        if not isinstance(config, SlurmConfig):
            raise ConfigError(f"slurm_fn[...] takes a SlurmConfig (or a dict of its fields), got "
                              f"{type(config).__name__}.")
        return SlurmFunction(self.fn, config)

    def configure(self, config: SlurmConfig, **_: Any) -> SlurmFunction[R]:
        """nntool's spelling of ``fn[config]``."""
        return self[config]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        config = self.config
        if config is None or os.environ.get(envvars.SLURM_FN) == "1":  # the relaunched script inside the job
            return self.fn(*args, **kwargs)
        if config.mode in ("debug", "run"):
            return LocalJob(self.fn(*args, **kwargs), "debug")
        if config.use_distributed_env:
            return _submit_distributed(config)
        if config.mode == "local":
            return _run_locally(self.fn, args, kwargs, config)
        from .submit import submit_function

        spec = config.launch_spec()
        module, folder = _importable(self.fn)
        if folder is not None:  # a function of the script being run: the job imports the script as a module
            spec["env"] = {**spec.get("env", {}), "PYTHONPATH": os.pathsep.join(
                p for p in (folder, os.environ.get("PYTHONPATH", "")) if p)}
        return submit_function(_Named(module, self.fn.__qualname__), args, kwargs, python=sys.executable, **spec)


class _Named:
    """``fn`` by module and name (the module attribute is the SlurmFunction, so plain pickling of the decorated
    function fails); in the job it resolves to the module's SlurmFunction, whose call runs the function."""

    def __init__(self, module: str, qualname: str) -> None:
        self.module, self.qualname = module, qualname

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import importlib

        target: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            target = getattr(target, part)
        return target(*args, **kwargs)


def _importable(fn: Callable[..., Any]) -> tuple[str, str | None]:
    """The module the job imports ``fn`` from, and the folder to add to its path when ``fn`` lives in the script
    being run (``__main__``)."""
    module = getattr(fn, "__module__", "__main__")
    if module != "__main__":
        return module, None
    script = getattr(sys.modules["__main__"], "__file__", None)
    if not script:
        raise ConfigError(f"{getattr(fn, '__name__', fn)!r} is defined in an interactive session: a job cannot import "
                          f"it. HINT: put it in a .py file (or use mode='debug').")
    return Path(script).stem, str(Path(script).resolve().parent)


def slurm_fn(fn: Callable[..., R]) -> SlurmFunction[R]:
    """nntool's decorator: ``fn[SlurmConfig(...)](*args)`` submits ``fn(*args)``; ``fn(*args)`` calls it."""
    return SlurmFunction(fn)


def _submit_distributed(config: SlurmConfig) -> Any:
    """The job runs ``distributed_launch_command`` once per node (placeholders filled from the allocation); the
    command starts this script again, where ``fn[config](...)`` then calls ``fn`` (TRAINSTACK_SLURM_FN=1)."""
    from .render import LaunchSpec
    from .submit import submit_spec

    if config.mode == "local":
        raise ConfigError("SlurmConfig(mode='local') with use_distributed_env: run the launch command yourself, or "
                          "use mode='slurm'.")
    spec = LaunchSpec(python=sys.executable, **config.launch_spec())
    return submit_spec(spec)


def _run_locally(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], config: SlurmConfig) -> LocalJob:
    """mode='local': the job's own runner (``python -m trainstack._remote``) in a subprocess, waited for."""
    import pickle

    from ._common.files import atomic_write, load_private_pickle, private_dir

    folder = private_dir(config.output_path.expanduser().absolute(), prefix=f"{config.job_name}-local-")
    module, where = _importable(fn)
    env = {**os.environ, envvars.SLURM_FN: "1"}
    if where is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (where, os.environ.get("PYTHONPATH", "")) if p)
    call = atomic_write(folder / "call.pkl", pickle.dumps((_Named(module, fn.__qualname__), tuple(args),
                                                           dict(kwargs))), mode=0o600)
    with open(folder / "log.out", "wb") as log:
        code = subprocess.run([sys.executable, "-m", "trainstack._remote", str(call)], stdout=log, env=env,
                              stderr=subprocess.STDOUT, timeout=config.timeout_min * 60).returncode
    if code != 0:
        tail = (folder / "log.out").read_text(errors="replace")[-3000:]
        raise ConfigError(f"the local run of {config.job_name} failed (exit code {code}); log {folder / 'log.out'}:\n"
                          f"{tail}")
    return LocalJob(load_private_pickle(folder / "result.pkl"), f"local-{folder.name}")

