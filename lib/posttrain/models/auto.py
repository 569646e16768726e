"""One entry point for any causal-LM checkpoint: native definition if there is one, else the
transformers fallback.

    model = load_model(hf_dir, device="cuda", dtype=torch.bfloat16)

A `model_type` with a bridge in `models/families/` (qwen3, llama, gemma3_text, ...) loads
through `hf_io.load_hf`; any other goes through `fallback.load_fallback`, which warns with the
list of native features that do not apply to it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.errors import ConfigError
from posttrain.models.families import BRIDGES
from posttrain.models.hf_io import load_hf, read_hf_config

__all__ = ["has_native_definition", "load_model"]

_NATIVE_ONLY = ("on_meta", "param_filter", "mlp_factory")
_FALLBACK_ONLY = ("attn_implementation", "allow_cross_document_attention", "check")


def has_native_definition(config: dict[str, Any]) -> bool:
    """Whether config.json's model_type is handled by a native family bridge (a multimodal
    checkpoint's: when its text model is a native family)."""
    model_type = config.get("model_type")
    return any(model_type in b.model_types or model_type in b.multimodal_types
               for b in BRIDGES.values())


def load_model(hf_dir: str | Path, *, device: torch.device | str = "cpu",
               dtype: torch.dtype | None = None, vocab_multiple: int = 64,
               **kwargs: Any) -> nn.Module:
    """Native `Transformer` (`load_hf` keyword arguments) or `HFCausalLM` (`load_fallback`
    keyword arguments) for the checkpoint in `hf_dir`."""
    if has_native_definition(read_hf_config(hf_dir)):
        ignored = sorted(k for k in _FALLBACK_ONLY if k in kwargs)
        if ignored:
            warnings.warn(f"load_model: {ignored} apply only to the transformers fallback; "
                          f"{hf_dir} has a native definition, so they are ignored", stacklevel=2)
        kwargs = {k: v for k, v in kwargs.items() if k not in _FALLBACK_ONLY}
        return load_hf(hf_dir, device=device, dtype=dtype, vocab_multiple=vocab_multiple,
                       **kwargs)
    unsupported = sorted(k for k in _NATIVE_ONLY if k in kwargs)
    if unsupported:
        raise ConfigError(f"load_model: {unsupported} need a native model definition, and "
                          f"{hf_dir} has none (it loads through transformers)")
    from posttrain.models.fallback import load_fallback

    return load_fallback(hf_dir, device=device, dtype=dtype, vocab_multiple=vocab_multiple,
                         **kwargs)
