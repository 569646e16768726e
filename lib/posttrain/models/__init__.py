"""Native model definitions (Qwen3, Llama 3.x, Gemma 3 text), HF checkpoint I/O, verifier.

    from posttrain.models import load_hf, save_hf
    model = load_hf("Qwen/Qwen3-0.6B-local-dir", dtype=torch.bfloat16)
    hidden = model(input_ids, document_lengths=docs)      # [B, T, H]
    logits = model.logits(hidden)                          # [B, T, padded_V], padding -inf

Parallelism, LoRA, activation checkpointing and compile are applied from outside by module
name (see `transformer.py` for the tree).
"""

from posttrain.models.args import ModelArgs, pad_to_multiple
from posttrain.models.families import args_from_hf_config
from posttrain.models.hf_io import iter_hf_tensors, load_hf, resize_vocab, save_hf
from posttrain.models.transformer import (LMHead, Transformer, TransformerBlock, build_model,
                                          default_mlp_factory)

__all__ = ["LMHead", "ModelArgs", "Transformer", "TransformerBlock", "args_from_hf_config",
           "build_model",
           "default_mlp_factory", "iter_hf_tensors", "load_hf", "pad_to_multiple",
           "resize_vocab", "save_hf"]
