"""Entry point of jobs sent with ``trainstack.submit.submit_function``: unpickle, call, store the result.

    python -m trainstack._remote /path/to/private/folder/call.pkl     (a shim that runs ``main``)

The call is loaded only from a folder and file this user owns and nobody else can write (see ``_files``), and the
result is written next to it with mode 0600.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from .._common.files import UntrustedFileError, atomic_write, load_private_pickle
from ..environment import detect_environment


def main(path: str) -> None:
    try:
        fn, args, kwargs = load_private_pickle(path)
    except UntrustedFileError as exc:
        sys.exit(f"trainstack._remote: {exc}")
    result = fn(*args, **kwargs)
    if detect_environment().rank == 0:
        atomic_write(Path(path).with_name("result.pkl"), pickle.dumps(result), mode=0o600)


def run(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: python -m trainstack._remote CALL.pkl")
    main(argv[1])
