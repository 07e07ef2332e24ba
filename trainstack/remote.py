"""Entry point of jobs sent with :func:`trainstack.submit.submit_function`: unpickle, call, store the result.

    python -m trainstack.remote /path/to/call.pkl
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path


def _is_rank_zero() -> bool:
    for name in ("RANK", "SLURM_PROCID"):
        if name in os.environ:
            return os.environ[name] == "0"
    return True


def main(path: str) -> None:
    with open(path, "rb") as fh:
        fn, args, kwargs = pickle.load(fh)
    result = fn(*args, **kwargs)
    if _is_rank_zero():
        out = Path(path).with_suffix(".result.pkl")
        tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
        with open(tmp, "wb") as fh:
            pickle.dump(result, fh)
        os.replace(tmp, out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m trainstack.remote CALL.pkl")
    main(sys.argv[1])
