"""HF Accelerate's API over trainstack's runtime: the process state objects (``PartialState``, ``AcceleratorState``,
``GradientState``, ``DistributedType``), the collective operations on nested data, the configuration dataclasses,
and Accelerate's data-loader semantics (each process takes its share of the batches of the user's own loader, in the
loader's own order). Reached through the doors ``trainstack.accelerator``, ``trainstack.utils``,
``trainstack.state`` and ``trainstack.data_loader``; the Trainer never uses it."""
