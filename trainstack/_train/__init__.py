"""The training room: what the Trainer's loop calls by name -- the step objects, the resume cursor, the run folder,
evaluation and prediction, the hand-off to the launching process, the qadence switches, the tracker with its
writers and progress bar. Reached through ``trainstack.trainer``.
"""
