"""The runtime room: spawning and joining worker processes, the process layout, the preloaded fork server,
collectives, FSDP, torch.compile, the hang watchdog, graceful stops, per-rank logs, the metric writers, the loop
state of hand-written loops, and the doctor.

Entered by the doors ``trainstack.accelerator`` and ``trainstack.data``, by the training side (``trainer``,
``config``, ``callbacks``, ``trainstack._train``) and the Accelerate room; ``trainstack doctor`` loads
``doctor`` lazily (an import contract in ``.importlinter`` says so).
"""
