"""Export trained weights as a Hugging Face checkpoint: full, merged LoRA, or a PEFT adapter.

Input is the gathered full state dict (native names, on rank 0). The native model is rebuilt
on the meta device and the tensors are assigned without copies, then written with the family
bridge's original HF names, shapes and dtypes (`posttrain.models.hf_io.save_hf`), the tokenizer
files alongside, so `transformers.AutoModelForCausalLM.from_pretrained` and vLLM load it as is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from posttrain.models.args import DTYPES, ModelArgs
from posttrain.models.hf_io import save_hf
from posttrain.models.transformer import build_model



def model_from_state(state: dict[str, torch.Tensor], args: ModelArgs, lora=None):
    """A CPU native model holding `state` (LoRA modules applied first when `lora` is given,
    with the trainable vocabulary rows of its resolved `trainable_tokens` ids: the engine's
    `model_cfg.lora`)."""
    model = build_model(args, device="meta")
    if lora is not None:
        from posttrain.models.lora import apply_lora_settings
        from posttrain.models.trainable_tokens import is_token_delta
        ids = lora.token_ids(())
        if not ids and any(is_token_delta(n) for n in state):
            raise RuntimeError("export: the state has trainable token rows but lora."
                               "trainable_tokens names no ids; pass the engine's resolved "
                               "settings (engine.model_cfg.lora)")
        apply_lora_settings(model, lora, ids)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {"head.weight"} if args.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"export: state dict does not match the model: missing "
                           f"{sorted(set(missing) - tied)[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    return model


def export_hf(state: dict[str, torch.Tensor], args: ModelArgs, out_dir: str, *,
              fmt: Literal["full", "merged", "peft"] = "full", lora=None,
              tokenizer_dir: str | None = None, dtype: str | None = None,
              base_dir: str | None = None) -> str:
    model = model_from_state(state, args, lora)
    torch_dtype = DTYPES[dtype] if dtype else None
    out = Path(out_dir)
    if fmt == "full":
        save_hf(model, out, tokenizer_dir=tokenizer_dir, dtype=torch_dtype)
    elif fmt == "merged":
        from posttrain.models import lora_export
        lora_export.save_merged_hf(model, out, tokenizer_dir=tokenizer_dir, dtype=torch_dtype)
    elif fmt == "peft":
        from posttrain.models import lora_export
        lora_export.save_peft_adapter(model, out, base_model_name_or_path=str(base_dir))
        if tokenizer_dir:       # its added tokens: the rows the adapter carries
            from posttrain.models.hf_io import _copy_tokenizer_files
            _copy_tokenizer_files(Path(tokenizer_dir), out)
    else:
        raise ValueError(f"unknown export format {fmt!r}")
    return str(out)


def export_worker(engine, cfg, prepared_dir: str, out_dir: str) -> str | None:
    """A recipe worker's export: gather the full weights of `engine` (a collective, every rank
    calls it) and write them on rank 0 in the recipe's `cfg.export` format, the prepared
    tokenizer alongside; None on the other ranks."""
    state = engine.full_state_dict()
    if engine.rank != 0:
        return None
    if engine.args is None:                     # a transformers model (no native definition)
        return export_fallback(state, engine.hf_dir, out_dir, fmt=cfg.export.format,
                               lora=cfg.model.lora, tokenizer_dir=f"{prepared_dir}/tokenizer",
                               dtype=cfg.export.dtype)
    # the engine's LoRA settings: their trainable_tokens resolved to ids
    return export_hf(state, engine.args, out_dir, fmt=cfg.export.format,
                     lora=engine.model_cfg.lora,
                     tokenizer_dir=f"{prepared_dir}/tokenizer", dtype=cfg.export.dtype,
                     base_dir=engine.hf_dir)


def write_weight_index(out: Path, *, exclude: set[str]) -> None:
    """Name the LM's tensors in a safetensors index (unless the export wrote one), so that
    readers which glob ``*.safetensors`` (vLLM) do not take the files in `exclude` (a custom
    head saved beside the checkpoint) for part of the LM."""
    import json

    from safetensors import safe_open

    from posttrain.models.hf_io import INDEX_FILE
    if (out / INDEX_FILE).is_file():
        return
    weight_map = {}
    for file in sorted(out.glob("*.safetensors")):
        if file.name in exclude:
            continue
        with safe_open(file, framework="pt") as f:
            weight_map.update({name: file.name for name in f.keys()})
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                             indent=2))


def export_fallback(state: dict[str, torch.Tensor], base_dir: str, out_dir: str, *,
                    fmt: Literal["full", "merged", "peft"] = "full", lora=None,
                    tokenizer_dir: str | None = None, dtype: str | None = None) -> str:
    """Write a transformers-trained model (`posttrain.models.fallback`, names ``hf.<its own>``)
    with the architecture and config of `base_dir`: ``full`` and ``merged`` (LoRA adapters
    folded into their weights) with `save_pretrained`, the tokenizer alongside; ``peft`` as a
    PEFT adapter over `base_dir` (`posttrain.models.lora_export.save_peft_adapter`)."""
    from posttrain.models import lora as lora_lib
    from posttrain.models import lora_export
    from posttrain.models.hf_io import _copy_tokenizer_files
    out = Path(out_dir)
    if fmt == "peft":
        model = _fallback_from_state(state, base_dir, lora)
        lora_export.save_peft_adapter(model, out, base_model_name_or_path=str(base_dir))
        return str(out)
    if fmt == "merged":
        state = lora_lib.fold_adapters(state, lora.alpha / lora.rank)
    model = _fallback_from_state(state, base_dir).hf
    if dtype:
        model.to(DTYPES[dtype])
    model.save_pretrained(out)
    if tokenizer_dir:
        _copy_tokenizer_files(Path(tokenizer_dir), out)
    return str(out)


def _fallback_from_state(state: dict[str, torch.Tensor], base_dir: str, lora=None):
    """An `HFCausalLM` of `base_dir`'s architecture built on the meta device and holding the
    tensors of `state` (wrapper names, ``hf.`` prefixed), LoRA applied first when given."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.models.fallback import HFCausalLM
    config = AutoConfig.from_pretrained(base_dir)
    with torch.device("meta"):
        model = HFCausalLM(AutoModelForCausalLM.from_config(config))
    if lora is not None:
        from posttrain.models import lora as lora_lib
        lora_lib.apply_lora(model, lora_lib.LoraConfig.of(lora))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {"hf.lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"export: the trained weights do not match "
                           f"{type(model.hf).__name__}: missing {sorted(set(missing) - tied)[:5]},"
                           f" unexpected {unexpected[:5]}")
    model.hf.tie_weights()
    return model
