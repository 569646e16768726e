"""LoRA models written out: a PEFT adapter (`save_peft_adapter`, which
`peft.PeftModel.from_pretrained(base, out_dir)` loads: adapters, stacked expert adapters as
`target_parameters`, trainable token rows and whole vocabulary modules) or a merged Hugging
Face checkpoint (`save_merged_hf`); the adapters themselves are `posttrain.models.lora`'s."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors.torch import save_file
from torch import nn

from posttrain.config.model import check_peft_export
from posttrain.errors import ConfigError
from posttrain.models.lora import LoRAExperts, LoRALinear, lora_modules

__all__ = ["check_peft_export", "save_merged_hf", "save_peft_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# families whose gate_proj / up_proj / down_proj PEFT targets at its fused experts
_PEFT_RETARGETS_MLP = ("qwen3_moe", "deepseek_v3")

def _full_cpu(t: torch.Tensor) -> torch.Tensor:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().to("cpu").contiguous().clone()


def _default_hf_names(model: nn.Module) -> Callable[[str], str]:
    if hasattr(model, "hf_parameter_name"):          # the transformers fallback (HFCausalLM)
        return model.hf_parameter_name
    args = getattr(model, "args", None)
    if args is None or not hasattr(args, "family"):
        raise ConfigError(f"save_peft_adapter: cannot name the parameters of a "
                          f"{type(model).__name__} in HF terms; pass hf_names=")
    from posttrain.models.families import bridge_for_args

    return bridge_for_args(args).to_hf


def save_peft_adapter(model: nn.Module, out_dir: str | Path, *, base_model_name_or_path: str,
                      hf_names: Callable[[str], str] | None = None) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` that
    `peft.PeftModel.from_pretrained(base, out_dir)` loads.

    `hf_names` maps a native parameter name (`layers.0.attn.q.weight`) to its HF checkpoint
    key (`model.layers.0.self_attn.q_proj.weight`); by default the model family's bridge.
    Unmerged adapters are written; a merged model is written the same way (A and B are kept).
    Stacked expert adapters become PEFT `target_parameters` (`_peft_experts`); PEFT cannot
    give them dropout, which `check_peft_export` refuses. Trainable token rows and whole
    vocabulary modules go in as PEFT's `trainable_token_indices` and `modules_to_save`
    (`posttrain.models.trainable_tokens.peft_vocab_entries`).
    """
    modules = lora_modules(model)
    if not modules:
        raise ConfigError("save_peft_adapter: the model has no LoRA adapters (apply_lora first)")
    hyper = {(m.rank, m.alpha, m.dropout.p if isinstance(m.dropout, nn.Dropout) else 0.0)
             for _, m in modules}
    assert len(hyper) == 1, f"adapters with different rank/alpha/dropout: {hyper}"
    (rank, alpha, dropout), = hyper
    experts = [(n, m) for n, m in modules if isinstance(m, LoRAExperts)]
    check_peft_export([f"{n}.{p}" for n, m in experts for p in m.projections], dropout)
    to_hf = hf_names or _default_hf_names(model)
    parts_of = hf_names is None and _fused_parts(model)
    tensors: dict[str, torch.Tensor] = {}
    target_modules: set[str] = set()
    fused: dict[str, int] = {}          # HF module -> how many rank-r blocks its adapter has
    by_hf: dict[str, list[tuple[str, LoRALinear]]] = {}
    for name, module in modules:
        if isinstance(module, LoRALinear):
            by_hf.setdefault(to_hf(f"{name}.weight").removesuffix(".weight"), []).append(
                (name, module))
    for hf_module, adapted in by_hf.items():
        target_modules.add(hf_module.rpartition(".")[2])
        parts = parts_of(hf_module) if parts_of else [adapted[0][0]]
        a, b = _peft_pair(model, parts, dict(adapted))
        tensors[f"base_model.model.{hf_module}.lora_A.weight"] = a
        tensors[f"base_model.model.{hf_module}.lora_B.weight"] = b
        if len(adapted) > 1:
            fused[hf_module] = len(adapted)
    # PEFT (0.21 on transformers 5.24) rewrites these leaf names of some MoE model types into
    # their fused experts' parameters, dense MLPs and shared experts included: the adapter would
    # land there (measured: a tiny Qwen3-MoE's logits 0.54 off, a DeepSeek-V3's 1.85; Qwen3.5-
    # MoE's shared expert and Gemma 4's dense MLP export correctly)
    dense_mlp = sorted(target_modules & {"gate_proj", "up_proj", "down_proj"})
    family = getattr(getattr(model, "args", None), "family", None)
    if dense_mlp and family in _PEFT_RETARGETS_MLP:
        raise ConfigError(f"save_peft_adapter: adapters on the dense MLPs {dense_mlp} of a "
                          "mixture-of-experts model cannot be a PEFT adapter: PEFT re-targets "
                          "these names to the fused experts; export merged weights (export."
                          "format: merged) or leave the dense and shared MLPs out of "
                          "lora.targets")
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
        "target_modules": sorted(target_modules), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "modules_to_save": None, "inference_mode": True, "rank_pattern": {},
        "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None,
    }
    from posttrain.models.trainable_tokens import peft_vocab_entries
    vocab_tensors, vocab_fields = peft_vocab_entries(model, to_hf, _full_cpu)
    tensors.update(vocab_tensors)
    config.update(vocab_fields)
    for hf_module, blocks in fused.items():    # one adapter of rank n r, scaling unchanged
        config["rank_pattern"][hf_module] = blocks * rank
        config["alpha_pattern"][hf_module] = blocks * alpha
    if experts:
        config["target_parameters"] = []
        for name, module in experts:
            _peft_experts(model, name, module, tensors, config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    return out_dir


def _fused_parts(model: nn.Module) -> Callable[[str], list[str]] | None:
    """HF module -> the native modules its weight holds, in order (one, or several for a fused
    projection such as Qwen3.5's `linear_attn.in_proj_qkv` = q, k, v); None without a bridge."""
    args = getattr(model, "args", None)
    if args is None or not hasattr(args, "family"):
        return None
    from posttrain.models.families import bridge_for_args
    bridge = bridge_for_args(args)
    return lambda hf_module: [n.removesuffix(".weight")
                              for n in bridge.native_names(f"{hf_module}.weight")]


def _peft_pair(model: nn.Module, parts: list[str], adapted: dict[str, "LoRALinear"],
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's A [n r, in] and B [out, n r] for an HF module made of the native `parts` (output
    rows in that order), `adapted` of them with adapters: the adapters' A stacked, their B
    placed block-diagonally in their parts' rows (rows of un-adapted parts zero)."""
    if len(parts) == 1:
        (module,) = adapted.values()
        return _full_cpu(module.lora_A), _full_cpu(module.lora_B)
    rank = next(iter(adapted.values())).rank
    outs = [model.get_submodule(p).out_features for p in parts]
    a_blocks, b = [], None
    for i, part in enumerate(p for p in parts if p in adapted):
        module = adapted[part]
        a_blocks.append(_full_cpu(module.lora_A))
        if b is None:
            b = torch.zeros(sum(outs), rank * len(adapted), dtype=a_blocks[0].dtype)
        row = sum(outs[:parts.index(part)])
        b[row:row + outs[parts.index(part)], i * rank:(i + 1) * rank] = _full_cpu(module.lora_B)
    assert b is not None
    return torch.cat(a_blocks), b


def _peft_experts(model: nn.Module, name: str, module: LoRAExperts,
                  tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Add the stacked adapters of `module` (native `name`) to a PEFT adapter's `tensors` and
    `config`, as PEFT's `target_parameters` on transformers 5's fused experts (Qwen3-MoE's and
    DeepSeek-V3's `mlp.experts`, stored one tensor per expert; Gemma 4's `experts`, stored
    fused).

    There `gate_up_proj` is [E, 2I, H] (gate rows, then up rows) and `down_proj`
    [E, H, I]. PEFT's adapter on a 3-D parameter is one Linear pair per parameter: A [E*R, in]
    with expert e's rows at e*R..e*R+R-1, B [out, R*E] with expert e's column j at j*E + e.
    Separate gate and up adapters share that fused parameter as one block-diagonal adapter of
    rank 2r (rank_pattern) with alpha 2 alpha (alpha_pattern), so the scaling stays alpha / r.
    PEFT wraps the targeted parameters of a module in their registration order, the later
    outermost: with both, gate_up_proj's tensors sit under `base_layer.`.
    """
    family = getattr(getattr(model, "args", None), "family", None)
    if family not in ("qwen3_moe", "deepseek_v3", "gemma4"):
        raise ConfigError(f"save_peft_adapter: LoRA on the MoE experts of a {family} model has "
                          "no known PEFT layout; export merged weights instead (export.format: "
                          "merged, `save_merged_hf`)")
    from posttrain.models.families import bridge_for_args

    hf_gate = bridge_for_args(model.args).hf_names(f"{name}.gate", model.args)
    if len(hf_gate) > 1:            # one tensor per expert in the checkpoint
        hf_experts, found, _ = hf_gate[0].rpartition(".0.gate_proj.weight")
        assert found, name
    else:                           # fused in the checkpoint as in memory
        hf_experts = hf_gate[0].removesuffix(".gate_up_proj")
    rank, (num_experts, inter, _) = module.rank, module.gate.shape
    wrapped = []          # (HF parameter, A [E, R, in], B [E, out, R], R / r), inner first
    fused = [p for p in ("gate", "up") if p in module.projections]
    if fused:
        b = module.gate.new_zeros(num_experts, 2 * inter, rank * len(fused))
        for j, p in enumerate(fused):
            rows = slice(0, inter) if p == "gate" else slice(inter, 2 * inter)
            b[:, rows, j * rank:(j + 1) * rank] = getattr(module, f"{p}_lora_B")
        a = torch.cat([getattr(module, f"{p}_lora_A") for p in fused], dim=1)
        wrapped.append(("gate_up_proj", a, b, len(fused)))
    if "down" in module.projections:
        wrapped.append(("down_proj", module.down_lora_A, module.down_lora_B, 1))
    for depth, (param, a, b, mult) in enumerate(reversed(wrapped)):
        a, b = _full_cpu(a), _full_cpu(b)
        prefix = f"base_model.model.{hf_experts}.{'base_layer.' * depth}"
        tensors[f"{prefix}lora_A.weight"] = a.reshape(-1, a.shape[-1])
        tensors[f"{prefix}lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1)
        key = f"{hf_experts}.{param}"
        config["target_parameters"].append(key)
        if mult > 1:
            config["rank_pattern"][key] = mult * module.rank
            config["alpha_pattern"][key] = mult * module.alpha


@contextmanager
def _base_only(model: nn.Module) -> Iterator[None]:
    """Temporarily show exporters only the base parameters: plain nn.Linear modules (same
    Parameter objects) in place of the LoRALinear ones, the stacked expert adapters and the
    trainable token deltas hidden."""
    from posttrain.models.trainable_tokens import hide_token_deltas
    swapped, hidden = [], []
    for name, module in lora_modules(model):
        if isinstance(module, LoRAExperts):
            adapters = {n: module._parameters.pop(n) for n, _ in module.adapter_parameters()}
            hidden.append((module, adapters))
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        plain = nn.Linear(module.in_features, module.out_features,
                          bias=module.bias is not None, device="meta")
        plain.weight = module.weight
        if module.bias is not None:
            plain.bias = module.bias
        setattr(parent, leaf, plain)
        swapped.append((parent, leaf, module))
    try:
        with hide_token_deltas(model):
            yield
    finally:
        for parent, leaf, module in swapped:
            setattr(parent, leaf, module)
        for module, adapters in hidden:
            module._parameters.update(adapters)


def save_merged_hf(model: nn.Module, out_dir: str | Path, **save_hf_kwargs: Any) -> Path:
    """Export base + adapters as one plain HF checkpoint (`posttrain.models.save_hf`
    arguments), trainable token rows written into the embedding and head; the model is left
    as it was (unmerged layers are unmerged again)."""
    from posttrain.models.hf_io import save_hf
    from posttrain.models.trainable_tokens import merge_token_rows, unmerge_token_rows

    was_unmerged = [m for _, m in lora_modules(model) if not m.merged]
    for m in was_unmerged:
        m.merge()
    rows = merge_token_rows(model)
    try:
        with _base_only(model):
            return save_hf(model, out_dir, **save_hf_kwargs)
    finally:
        unmerge_token_rows(model, rows)
        for m in was_unmerged:
            m.unmerge()
