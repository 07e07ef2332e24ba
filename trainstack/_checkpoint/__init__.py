"""The checkpoint room: sharded (DCP) checkpoints read without trusting their pickles, and RNG state capture and
restore. Reached through ``trainstack.checkpoint``.
"""
