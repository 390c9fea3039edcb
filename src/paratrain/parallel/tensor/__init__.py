"""Layers split over a tensor group (Megatron-LM's tensor parallelism), composed by the
engines: dp (and ``tp``), zero1/2 and the pipeline split their models with ``split_model``
and keep the returned ``TensorSplit``; checkpoints and clipping compose with it."""
