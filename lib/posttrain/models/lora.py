"""LoRA adapters applied from outside, by module name (Hu et al. 2021, arXiv:2106.09685).

    model = load_hf(hf_dir)
    apply_lora(model, LoraConfig(rank=16, alpha=32, targets=("q", "k", "v", "o")))
    ...train: only lora_A / lora_B require grad...
    save_peft_adapter(model, out, base_model_name_or_path="Qwen/Qwen3-0.6B")   # PEFT format
    save_merged_hf(model, out_merged)                                         # plain HF model

Every `nn.Linear` whose name ends in one of `LoraConfig.targets` (the native names `q`, `k`,
`v`, `o`, `gate`, `up`, `down`, or a longer suffix such as `attn.q`) is replaced by a
`LoRALinear` computing

    y = x W^T + b + (dropout(x) A^T B^T) * alpha / r,     A [r, in], B [out, r]

A starts kaiming-uniform (PEFT's default: U(-1/sqrt(in), 1/sqrt(in))), B at zero, so the adapted
model starts equal to the base. Every other parameter (embeddings, norms, head) is frozen.

`LoRALinear` keeps the original Linear's parameters under their original names (`attn.q.weight`,
`attn.q.bias`), so name-based loading (`iter_hf_tensors`), base checkpoints and sharding
filters see the same names with or without adapters; only `attn.q.lora_A` / `lora_B` are new.
Apply LoRA after tensor parallelism is ruled out (`apply_tp` accepts only plain `nn.Linear`) and
before FSDP / activation checkpointing / compile.

`disable_adapters(model)` runs the base model through the same weights (the DPO / KL reference
without a second copy of the model).
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from posttrain.errors import ConfigError

__all__ = ["LoRALinear", "LoraConfig", "apply_lora", "disable_adapters", "flops_kwargs",
           "init_lora_weights", "lora_modules", "lora_state_dict", "merge_lora",
           "save_merged_hf", "save_peft_adapter", "unmerge_lora"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraConfig:
    """rank r, alpha (scaling = alpha / r), dropout on the adapter input, target module names
    (last path component, or a dotted suffix), and a seed for A's init (None: global RNG)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    init_seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):
            raise ConfigError(f"lora.targets must be a list of module names, got the string "
                              f"'{self.targets}'; write [{self.targets!r}]")
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 1:
            raise ConfigError(f"lora.rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ConfigError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ConfigError("lora.targets is empty; name at least one module, e.g. ['q', 'v']")


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update; see the module docstring.

    `weight` / `bias` are the wrapped Linear's own Parameter objects (not copies). `merged`
    says whether B A * scaling is currently folded into `weight`; `adapters_enabled` whether
    the update takes part in forward (False inside `disable_adapters`).
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.alpha = rank, float(alpha)
        self.scaling = self.alpha / rank
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, **factory))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self.adapters_enabled = True

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform with a=sqrt(5)), B = 0."""
        if self.merged:
            raise RuntimeError("LoRALinear.init_weights on a merged layer; unmerge first")
        bound = 1.0 / math.sqrt(self.in_features)
        a = torch.empty(self.lora_A.shape, dtype=torch.float32).uniform_(-bound, bound,
                                                                         generator=generator)
        self.lora_A.copy_(a)
        self.lora_B.zero_()

    def _update(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(F.linear(x.to(self.lora_A.dtype), self.lora_A), self.lora_B)
        return h * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.adapters_enabled and not self.merged:
            return out + self._update(self.dropout(x)).to(out.dtype)
        if self.merged and not self.adapters_enabled:
            # the update lives in `weight`; take it out again (no second weight copy)
            return out - self._update(x).to(out.dtype)
        return out

    def delta_weight(self) -> torch.Tensor:
        """B A * scaling in fp32, [out, in]."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the update into `weight` (computed in fp32, stored in the weight's dtype)."""
        if self.merged:
            return
        self.weight.copy_((self.weight.float() + self.delta_weight()).to(self.weight.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Exact inverse of `merge` for fp32 weights up to rounding."""
        if not self.merged:
            return
        self.weight.copy_((self.weight.float() - self.delta_weight()).to(self.weight.dtype))
        self.merged = False

    @contextmanager
    def disable_adapters(self) -> Iterator["LoRALinear"]:
        previous, self.adapters_enabled = self.adapters_enabled, False
        try:
            yield self
        finally:
            self.adapters_enabled = previous

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, rank={self.rank}, alpha={self.alpha}, "
                f"merged={self.merged}")


# ------------------------------------------------------------------------------- applying

def _matches(name: str, targets: tuple[str, ...]) -> str | None:
    for target in targets:
        if name == target or name.endswith("." + target):
            return target
    return None


def _unknown_targets_error(model: nn.Module, unknown: list[str], linear_names: list[str]
                           ) -> ConfigError:
    available = sorted({n.rpartition(".")[2] for n in linear_names})
    leaf_names = ({n.rpartition(".")[2] for n, _ in model.named_modules()}
                  | {n.rpartition(".")[2] for n, _ in model.named_parameters()})
    not_linear = sorted(set(unknown) & leaf_names)
    msg = (f"lora.targets {unknown} match no nn.Linear of this {type(model).__name__}; "
           f"its Linear modules are named {available}")
    if not_linear:
        msg += (f". {not_linear} exist but are not nn.Linear (e.g. norms or MoE expert "
                "weights), which LoRA does not adapt")
    return ConfigError(msg)


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Wrap every matching `nn.Linear` of `model` in place in a `LoRALinear` and freeze all
    other parameters. Returns `model`. On the meta device A and B stay uninitialised: call
    `init_lora_weights` after materialising."""
    if lora_modules(model):
        raise ConfigError("apply_lora: the model already has LoRA adapters")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen = {name: t for name in linears if (t := _matches(name, cfg.targets)) is not None}
    unknown = [t for t in cfg.targets if t not in chosen.values()]
    if unknown:
        raise _unknown_targets_error(model, unknown, list(linears))
    head_weight = getattr(getattr(model, "head", None), "weight", None)
    on_head = [name for name in chosen if linears[name].weight is head_weight]
    if on_head:
        raise ConfigError(f"lora.targets select the LM head ({on_head}); losses read "
                          "head.weight directly and would miss the adapter; remove it")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in chosen:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, leaf, LoRALinear(linears[name], cfg.rank, cfg.alpha, cfg.dropout))
    if not any(p.is_meta for p in model.parameters()):
        init_lora_weights(model, seed=cfg.init_seed)
    return model


def init_lora_weights(model: nn.Module, seed: int | None = None) -> None:
    """(Re)initialise every adapter: A kaiming-uniform (from `seed` if given), B zero."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    for _, module in lora_modules(model):
        module.init_weights(generator)


def adapter_init_tensor(name: str, shape: tuple[int, ...],
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """The full initial value of adapter parameter `name` (`...lora_A` or `...lora_B`).

    For models materialized from the meta device and sharded before they have storage: each
    rank builds the same full tensor from the same generator and keeps its shard. Same
    distribution as `LoRALinear.init_weights`.
    """
    if name.endswith("lora_B"):
        return torch.zeros(shape)
    if name.endswith("lora_A"):
        bound = 1.0 / math.sqrt(shape[1])
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)
    raise KeyError(f"{name} is not a LoRA adapter parameter")


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def merge_lora(model: nn.Module) -> None:
    for _, module in lora_modules(model):
        module.merge()


def unmerge_lora(model: nn.Module) -> None:
    for _, module in lora_modules(model):
        module.unmerge()


@contextmanager
def disable_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block `model` computes the base model's outputs (merged or not)."""
    with ExitStack() as stack:
        for _, module in lora_modules(model):
            stack.enter_context(module.disable_adapters())
        yield model


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Native name (`layers.0.attn.q.lora_A`) -> adapter tensor (detached, not copied)."""
    return {name: p.detach() for name, p in model.named_parameters()
            if name.endswith((".lora_A", ".lora_B"))}


def flops_kwargs(cfg: LoraConfig | None) -> dict[str, Any]:
    """Keyword arguments for `posttrain.models.flops` describing the adapters ({} without)."""
    if cfg is None:
        return {}
    return {"lora_rank": cfg.rank, "lora_targets": tuple(cfg.targets)}


# --------------------------------------------------------------------------------- export

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
    from posttrain.models.families import bridge_for_family

    return bridge_for_family(args.family).to_hf


def save_peft_adapter(model: nn.Module, out_dir: str | Path, *, base_model_name_or_path: str,
                      hf_names: Callable[[str], str] | None = None) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` that
    `peft.PeftModel.from_pretrained(base, out_dir)` loads.

    `hf_names` maps a native parameter name (`layers.0.attn.q.weight`) to its HF checkpoint
    key (`model.layers.0.self_attn.q_proj.weight`); by default the model family's bridge.
    Unmerged adapters are written; a merged model is written the same way (A and B are kept).
    """
    modules = lora_modules(model)
    if not modules:
        raise ConfigError("save_peft_adapter: the model has no LoRA adapters (apply_lora first)")
    hyper = {(m.rank, m.alpha, m.dropout.p if isinstance(m.dropout, nn.Dropout) else 0.0)
             for _, m in modules}
    assert len(hyper) == 1, f"adapters with different rank/alpha/dropout: {hyper}"
    (rank, alpha, dropout), = hyper
    to_hf = hf_names or _default_hf_names(model)
    tensors: dict[str, torch.Tensor] = {}
    target_modules: set[str] = set()
    for name, module in modules:
        hf_module = to_hf(f"{name}.weight").removesuffix(".weight")
        target_modules.add(hf_module.rpartition(".")[2])
        tensors[f"base_model.model.{hf_module}.lora_A.weight"] = _full_cpu(module.lora_A)
        tensors[f"base_model.model.{hf_module}.lora_B.weight"] = _full_cpu(module.lora_B)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
        "target_modules": sorted(target_modules), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "modules_to_save": None, "inference_mode": True, "rank_pattern": {},
        "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None,
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    return out_dir


@contextmanager
def _plain_linears(model: nn.Module) -> Iterator[None]:
    """Temporarily put plain nn.Linear modules (same Parameter objects) in place of the
    LoRALinear ones, so that exporters see only base parameter names."""
    swapped = []
    for name, module in lora_modules(model):
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
        yield
    finally:
        for parent, leaf, module in swapped:
            setattr(parent, leaf, module)


def save_merged_hf(model: nn.Module, out_dir: str | Path, **save_hf_kwargs: Any) -> Path:
    """Export base + adapters as one plain HF checkpoint (`posttrain.models.save_hf`
    arguments); the model is left as it was (unmerged layers are unmerged again)."""
    from posttrain.models.hf_io import save_hf

    was_unmerged = [m for _, m in lora_modules(model) if not m.merged]
    for m in was_unmerged:
        m.merge()
    try:
        with _plain_linears(model):
            return save_hf(model, out_dir, **save_hf_kwargs)
    finally:
        for m in was_unmerged:
            m.unmerge()
