"""Random-number generator states in checkpoints: captured as ``weights_only``-loadable values, gathered from every
rank (a collective over gloo: no device sync), restored on whatever device the checkpoint was loaded to."""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["capture_rng", "restore_rng", "gather_rng"]


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as weights_only-loadable values."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = [kind, torch.from_numpy(np.asarray(keys).astype("int64")), int(pos), int(has_gauss),
                          float(cached)]
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore states captured by ``capture_rng``, wherever the checkpoint was loaded to.

    RNG states are byte tensors that torch only accepts on the CPU, so they are moved back first; CUDA states
    are restored for the devices both the saving and this process have.
    """
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(_byte_state(state["torch"]))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.cpu().numpy().astype("uint32"), pos, has_gauss, cached))
    if state.get("cuda") and torch.cuda.is_available():
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_byte_state(cuda_state), index)


def _byte_state(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.uint8)


def gather_rng() -> list[dict[str, Any]]:
    """Every rank's RNG state, in rank order (a collective when distributed; over gloo, no device sync)."""
    mine = capture_rng()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out
