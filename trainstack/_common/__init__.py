"""The bottom room: torch-free leaves every other room may use and that import nothing above them (the layer
contract in ``.importlinter``) -- the one bounded reader and the safe writers (``files``), the ``TRAINSTACK_*``
variables (``envvars``), a job folder's contents (``jobfiles``) and timeline (``jobevents``), the goodput ledger
(``goodput``), the run's lease in its store (``lease``), the NCCL transport checks (``transport``), small text and
choice helpers, the version. Kept apart from the doors so the top level of ``trainstack`` holds doors only."""
