"""Pure functions of captures: memory, the training step, fit, checkpointing, FLOPs, textbook and compare."""
