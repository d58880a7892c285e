"""Training and distillation components (torch.distributed, precision, optimizers, checkpointing)."""
