"""The Slurm workflow room: launch specs, program forms, job options, job folders, the submission index, status,
code snapshots and the job-side runner of ``submit_function``.

It never imports torch (``make lint`` checks the closure, lazy imports included), so ``trainstack generate`` and
``trainstack status`` answer in a fraction of a second. Reached through the doors ``trainstack.render``,
``trainstack.submit`` and the CLI.
"""
