"""Tiny random Hugging Face checkpoints of every native family, written to tmp dirs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors import safe_open

from posttrain.models.hf_io import weight_map
from posttrain.models.verify import random_hf_model, tiny_hf_config

FAMILIES = ("qwen3", "llama", "gemma3")


@pytest.fixture
def make_hf_dir(tmp_path: Path) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """make_hf_dir(family, seed=0, name=..., save_kwargs={}, **config_overrides) ->
    (checkpoint dir, the transformers model saved there)."""

    def make(family: str, *, seed: int = 0, name: str | None = None,
             save_kwargs: dict[str, Any] | None = None,
             **overrides: Any) -> tuple[Path, torch.nn.Module]:
        model = random_hf_model(tiny_hf_config(family, **overrides), seed=seed)
        out = tmp_path / (name or f"{family}-hf")
        model.save_pretrained(out, **(save_kwargs or {}))
        return out, model

    return make


@pytest.fixture
def read_checkpoint() -> Callable[[Path], dict[str, torch.Tensor]]:
    """read_checkpoint(hf_dir) -> every tensor of the checkpoint, by HF name."""

    def read(hf_dir: Path) -> dict[str, torch.Tensor]:
        out = {}
        for name, file in weight_map(hf_dir).items():
            with safe_open(file, framework="pt") as f:
                out[name] = f.get_tensor(name)
        return out

    return read

