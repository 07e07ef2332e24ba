"""``TrainConfig.from_cli``, ``from_file`` and ``to_file``'s formats: a script's own options (``--name value``, typed
as their defaults; a close miss named), a YAML/TOML/JSON settings file read (a top-level table or one under
``[train]``) and written. The fields themselves are ``TrainConfig``'s; this is only their reading and writing."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["parse_options", "typed_option", "closest", "read_settings", "write_settings"]


def parse_options(own: dict[str, Any], rest: list[str], suggestion: Callable[[str], str]) -> dict[str, Any]:
    """The script's own options out of the arguments that are not fields (``--name value``, ``--name=value``,
    ``--flag``/``--no-flag`` for a boolean), typed as their defaults; anything else is an error."""
    values, i = dict(own), 0
    while i < len(rest):
        word = rest[i]
        name, eq, text = word[2:].partition("=") if word.startswith("--") else ("", "", "")
        key = name.replace("-", "_")
        negated = key.startswith("no_") and isinstance(own.get(key[3:]), bool)
        if negated or (key in own and isinstance(own[key], bool) and not eq):
            values[key[3:] if negated else key] = not negated
            i += 1
            continue
        if key not in own:
            where = f"{suggestion(key)}" if key else ""
            mine = closest(key, list(own)) if key else ""
            what = "neither a TrainConfig field nor one of the script's options" if own else "not a field"
            raise ConfigError(f"TrainConfig.from_cli: {word!r} is {what}{mine or where} (for the script's own "
                              f"arguments: config, opts = TrainConfig.from_cli(options={{'lr': 3e-3, ...}}), or "
                              f"config, rest = TrainConfig.parse_cli() and your own parser).")
        if not eq:
            if i + 1 >= len(rest):
                raise ConfigError(f"TrainConfig.from_cli: --{name} needs a value.")
            text, i = rest[i + 1], i + 1
        values[key] = typed_option(key, text, own[key])
        i += 1
    return values


def typed_option(name: str, text: str, default: Any) -> Any:
    kind = type(default)
    if default is None or kind is str:
        return text
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ConfigError(f"TrainConfig.from_cli: --{name} {text!r} is not a boolean (true/false).")
        return text.lower() in ("true", "1", "yes")
    try:
        return kind(text)
    except (TypeError, ValueError):
        raise ConfigError(f"TrainConfig.from_cli: --{name} {text!r} is not a {kind.__name__} (its default is "
                          f"{default!r}).") from None


def closest(name: str, names: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f". HINT: did you mean --{close[0]}?" if close else ""


def read_settings(path: Path, convert: Callable[[str, Any], Any]) -> dict[str, Any]:
    """Field values from a YAML, TOML or JSON file (a top-level table, or one under ``[train]``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror or exc}.") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ConfigError(f"reading {path} needs pyyaml: pip install 'trainstack[yaml]'.") from None
            data = yaml.safe_load(text) or {}
        elif path.suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - Python 3.10
                import tomli as tomllib
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ConfigError:
        raise
    except Exception as exc:  # each parser has its own error class
        raise ConfigError(f"{path} is not a valid {path.suffix.lstrip('.') or 'json'} file: {exc}") from None
    data = data.get("train", data) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a table of TrainConfig fields, got {type(data).__name__}.")
    return {str(k).replace("-", "_"): convert(str(k).replace("-", "_"), v) for k, v in data.items()}


def write_settings(path: Path, data: dict[str, Any]) -> Path:
    """``data`` as YAML (``.yaml``/``.yml``, needs pyyaml) or JSON (any other name), written atomically."""
    from .._common.files import atomic_write

    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"writing {path} needs pyyaml: pip install 'trainstack[yaml]', or use a .json "
                              f"file.") from None
        text = yaml.safe_dump(data, sort_keys=False)
    else:
        text = json.dumps(data, indent=2) + "\n"
    return atomic_write(path, text)
