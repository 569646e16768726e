"""Released model shapes with random weights, for benchmarks and real-shape tests (no download).

`write_random_checkpoint(QWEN3_0P6B, dir)` writes a Hugging Face checkpoint of Qwen3-0.6B's
exact shape (28 layers, hidden 1024, 16 query / 8 key-value heads of 128, MLP 3072, vocabulary
151,936, tied embeddings) with normal(0, 0.02) weights and unit norms, in the Hub's layout:
bf16, sharded with a `model.safetensors.index.json`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

QWEN3_0P6B: dict[str, Any] = dict(
    family="qwen3", vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_layers=28,
    num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=1e6,
    max_position_embeddings=4096, tie_word_embeddings=True)


def write_random_checkpoint(shape: dict[str, Any], out_dir: str | Path, *,
                            dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                            max_shard_bytes: int = 256 << 20,
                            tokenizer_dir: str | Path | None = None) -> Path:
    """A random checkpoint of `shape` (`ModelArgs` fields) in `out_dir`, sharded in files of at
    most `max_shard_bytes` with an index; deterministic for `seed`. Holds the model once in
    `dtype` while writing."""
    from posttrain.models.args import ModelArgs
    from posttrain.models.hf_io import save_hf
    from posttrain.models.transformer import build_model
    model = build_model(ModelArgs(**shape), device="meta", dtype=dtype)
    model.to_empty(device="cpu")
    model.tie_weights()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02)
    return save_hf(model, out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes,
                   tokenizer_dir=tokenizer_dir)
