"""The runtime room: spawning and joining worker processes, the process layout, the preloaded fork server,
collectives, FSDP, the hang watchdog, graceful stops, per-rank logs and the doctor.

Reached through ``trainstack.accelerator`` (and ``trainstack.environment`` below it).
"""
