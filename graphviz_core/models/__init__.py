"""The model families: what each architecture is, its presets, and how to build it, with its example batch and loss."""
