"""The training loop's parts: checkpoints (DCP, atomic, local or s3) and RNG state."""
