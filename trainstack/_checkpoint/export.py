"""A consolidated state dict written as safetensors, the way inference stacks read it: ``model.safetensors``, or
above a size, shards ``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json`` (Hugging Face's
layout and names). Written into a temp folder renamed into place: a killed export leaves no half folder."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from .._common.files import temp_path
from ..errors import CheckpointError

__all__ = ["write_safetensors", "save_pretrained", "export_model", "check_exportable", "require", "parse_size", "INDEX",
           "check_output", "write_export",
           "SINGLE"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``1000`` -> bytes (powers of 1024: safetensors shards are compared in bytes)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 5GB, 500MB)")
    return int(float(m.group(1)) * 1024 ** "_KMGT".index(m.group(2).upper() or "_"))


def _standalone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied weights, views): each gets its own contiguous copy."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) if t.numel() else (id(t), 0)
        shared = key in seen or not t.is_contiguous() or t.storage_offset() or \
            t.untyped_storage().nbytes() != t.numel() * t.element_size()
        seen.add(key)
        out[name] = t.detach().contiguous().clone() if shared else t.detach()
    return out


def write_safetensors(state: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int) -> list[Path]:
    """Write ``state`` into ``folder`` (which must not exist): one file, or shards of at most ``max_shard_bytes``
    (a tensor larger than that gets a shard of its own) with their index. Returns the files written."""
    from safetensors.torch import save_file

    state = _standalone({k: v.to("cpu") for k, v in state.items()})
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    tmp = temp_path(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        names = [SINGLE] if len(shards) == 1 else \
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, shard in zip(names, shards, strict=True):
            save_file(shard, tmp / name, metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                     "weight_map": {k: name for name, shard in zip(names, shards, strict=True) for k in shard}}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
            names.append(INDEX)
        readable(tmp)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [folder / name for name in names]


def readable(folder: Path) -> None:
    """The files of an export as a plain write makes them (``0666 & ~umask``): safetensors writes through a private
    temp file (0600), which would leave a group-shared model folder's weights unreadable beside its config."""
    mask = os.umask(0)
    os.umask(mask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~mask)


def require(module: str, extra: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise CheckpointError(f"exporting needs the {module} package. HINT: pip install 'trainstack[{extra}]'.")


def save_pretrained(config: dict[str, Any], state: dict[str, torch.Tensor], out: Path, max_shard_size: str
                     ) -> list[Path]:
    """The model rebuilt from its config (no download), the weights loaded, ``save_pretrained`` into a temp folder
    renamed into place."""
    import transformers

    architecture = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, architecture, None) if architecture else None
    if cls is None:
        raise CheckpointError(f"the checkpoint's model class {architecture!r} is not in transformers "
                              f"{transformers.__version__}. HINT: use --format safetensors.")
    hf_config = transformers.AutoConfig.for_model(**config)
    model = cls(hf_config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or [k for k in missing if k not in tied]:
        raise CheckpointError(f"the weights do not fit {architecture}: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}")
    tmp = temp_path(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
        readable(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(out.iterdir())


def export_model(model: Any, folder: Path, fmt: str, is_main: bool, max_shard_size: str = "5GB") -> list[Path]:
    """Collective: the live model's whole state dict (gathered from its shards under FSDP, no wrapper prefixes)
    written by rank 0 into ``folder`` (replaced) as safetensors or a Hugging Face folder."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from .parts import model_config

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state = {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
    if not is_main:
        return []
    old = temp_path(folder, owner=1)
    if folder.exists():
        os.replace(folder, old)  # the new export appears whole, the old one goes after
    try:
        config = model_config(model) if fmt == "hf" else None
        files = save_pretrained(config, state, folder, max_shard_size) if config else \
            write_safetensors(state, folder, parse_size(max_shard_size))
    finally:
        shutil.rmtree(old, ignore_errors=True)
    return files


def check_exportable(how: str | None, model: Any) -> None:
    """``TrainConfig.export_final_model`` can be written for ``model``: decided before training, not after it."""
    from ..errors import ConfigError
    from .parts import model_config

    if how is None:
        return
    require("safetensors", "export")
    if how == "hf" and model_config(model) is None:
        raise ConfigError(f"TrainConfig.export_final_model='hf' needs a transformers model (PreTrainedModel); this "
                          f"one is a {type(model).__name__}. HINT: export_final_model='safetensors'.")


def check_output(out: Path, max_shard_size: str, force: bool) -> int:
    """``checkpoint export``'s output and shard size, before any work: the limit in bytes; a clear error for a size
    that is not one (or would give every tensor a shard of its own) and for an output that exists (``force``: it is
    replaced)."""
    try:
        limit = parse_size(max_shard_size)
    except ValueError as exc:
        raise CheckpointError(f"--max-shard-size: {exc}") from None
    if limit < 1024:
        raise CheckpointError(f"--max-shard-size: {max_shard_size!r} is {limit} byte(s): every tensor would get a "
                              f"shard of its own. HINT: a size such as 5GB (the default) or 500MB.")
    if out.exists():
        if not force:
            raise CheckpointError(f"{out} exists. HINT: choose a new folder, or pass --force to replace it.")
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    require("safetensors", "export")
    return limit


def write_export(state: dict[str, torch.Tensor], out: Path, fmt: str, limit: int, max_shard_size: str,
                 config: dict[str, Any] | None, where: Path) -> list[Path]:
    """The consolidated ``state`` as safetensors (``fmt="safetensors"``) or a Hugging Face folder (``"hf"``, from
    the checkpoint's ``config``) in ``out``; a clear error naming ``out`` when it cannot be written."""
    try:
        if fmt == "safetensors":
            return write_safetensors(state, out, limit)
        if not config:
            raise CheckpointError(f"{where} holds no Hugging Face model config: --format hf needs a checkpoint of a "
                                  f"transformers model (PreTrainedModel) trained with this trainstack. HINT: use "
                                  f"--format safetensors, or the model's own save_pretrained.")
        require("transformers", "hf")
        return save_pretrained(config, state, out, max_shard_size)
    except CheckpointError:
        raise
    except OSError as exc:  # an unwritable or missing parent, a full disk: nothing is left half-written
        raise CheckpointError(f"cannot write {out}: {exc.strerror or exc} ({exc.filename or out}). HINT: -o a "
                              f"folder you can write, on a file system with room.") from None
