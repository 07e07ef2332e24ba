"""The scheduler-neutral room: what the command line asks of a scheduler (``backend.Backend``), and which backend
answers (``backend.backend``). It runs no scheduler command itself; each backend is one folder beside it
(``trainstack/_slurm`` today), as torchx keeps one file per scheduler behind one interface."""
