"""The training room: one ``fit()`` on one rank (``run.Run``) and what the Trainer's loop calls through it by name
-- the step objects, the schedule, the resume cursor, the run folder, evaluation and prediction, the tracker with its
progress bar and loss curve -- plus the hand-off to the launching process and the qadence switches. Reached through
``trainstack.trainer``.
"""
