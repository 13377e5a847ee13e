"""Parallel training simulated over torch.distributed's fake process group: FSDP, tensor parallel and more."""
