"""``trainstack`` command line: a thin click layer over ``trainstack.render`` and ``trainstack.submit``, one module
per command group (``scripts``: generate, submit; ``jobs``: status, why, logs, cancel, debug, fetch; ``checkpoints``;
``doctor``) around the shared ``base``. Never imports torch (``trainstack generate`` must answer in well under a
second).
"""

from __future__ import annotations

from . import checkpoints, doctor, jobs, scripts  # noqa: F401 -- each registers its commands on ``main``
from .base import main

__all__ = ["main"]

if __name__ == "__main__":  # pragma: no cover
    main()
