"""Losses as pure functions of tensors and masks (SFT, DPO, GRPO, distillation)."""
