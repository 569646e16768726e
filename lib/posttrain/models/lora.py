"""LoRA adapters applied from outside, by module name (Hu et al. 2021, arXiv:2106.09685).

    model = load_hf(hf_dir)
    apply_lora(model, LoraConfig(rank=16, alpha=32, targets=("q", "k", "v", "o")))
    ...train: only lora_A / lora_B require grad...
    save_peft_adapter(model, out, base_model_name_or_path="Qwen/Qwen3-0.6B")   # lora_export
    save_merged_hf(model, out_merged)                             # plain HF model (lora_export)

Every `nn.Linear` whose name ends in one of `LoraConfig.targets` (the native names `q`, `k`,
`v`, `o`, `gate`, `up`, `down`, or a longer suffix such as `attn.q`) is replaced by a
`LoRALinear` computing

    y = x W^T + b + (dropout(x) A^T B^T) * alpha / r,     A [r, in], B [out, r]

A starts kaiming-uniform (PEFT's default: U(-1/sqrt(in), 1/sqrt(in))), B at zero, so the adapted
model starts equal to the base. Every other parameter (embeddings, norms, head) is frozen;
vocabulary rows that must train beside the adapters (tokens a tokenizer added) are
`posttrain.models.trainable_tokens`'s, which `disable_adapters`, `save_merged_hf` and
`save_peft_adapter` take along.

`LoRALinear` keeps the original Linear's parameters under their original names (`attn.q.weight`,
`attn.q.bias`), so name-based loading (`iter_hf_tensors`), base checkpoints and sharding
filters see the same names with or without adapters; only `attn.q.lora_A` / `lora_B` are new.
Apply LoRA after tensor parallelism is ruled out (`apply_tp` accepts only plain `nn.Linear`) and
before FSDP / activation checkpointing / compile.

`disable_adapters(model)` runs the base model through the same weights (the DPO / KL reference
without a second copy of the model).

MoE experts. The stacked expert weights of `posttrain.models.moe.Experts` (`experts.gate`,
`experts.up` [E, I, H], `experts.down` [E, H, I]) take stacked adapters, one pair per expert:
expert e computes with W_e + (alpha / r) B_e A_e, A [E, r, in], B [E, out, r], stored as
`experts.gate_lora_A` / `experts.gate_lora_B`. A target names them with their `experts.` part
(`experts.gate`, `mlp.experts.down`), so that `gate` keeps meaning the dense MLP's Linear. The
`LoRAExperts` wrapper runs the update as a low-rank path inside the experts' own dispatch
(`Experts.project`: grouped matmuls or the loop), x A_e^T B_e^T over each expert's rows:
2 r (in + out) FLOPs per routed row and an [rows, r] activation (the loop where r's rows are
not whole 16 bytes, which `torch._grouped_mm` requires). Folding B_e A_e into W at every
step instead would cost 2 E r in out FLOPs and a weight-sized temporary (and its gradient) per
projection; for Qwen3-30B-A3B's experts that is 200 M elements per projection and layer, so
only `merge` folds. PEFT expresses these adapters with `target_parameters`
(`save_peft_adapter`); it refuses dropout on them, and so does `check_peft_export`.
"""

from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.config.model import names_experts
from posttrain.errors import ConfigError
from posttrain.models.moe import Experts, local_tensor

__all__ = ["EXPERT_PROJECTIONS", "LoRAExperts", "LoRALinear", "LoraConfig", "adapter_names",
           "apply_lora", "disable_adapters", "flops_kwargs", "fold_adapters",
           "init_lora_weights", "is_adapter_name", "lora_modules", "lora_state_dict",
           "merge_lora", "merged_weight", "target_of", "unmerge_lora"]

EXPERT_PROJECTIONS = ("gate", "up", "down")


@dataclass(frozen=True)
class LoraConfig:
    """rank r, alpha (scaling = alpha / r), dropout on the adapter input, target module names
    (last path component, or a dotted suffix; `experts.gate` etc. for MoE expert weights), and
    a seed for A's init (None: global RNG)."""

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

    @classmethod
    def of(cls, settings: Any, init_seed: int | None = None) -> "LoraConfig":
        """The adapters of a run's `model.lora` (a `LoraSettings`)."""
        return cls(rank=settings.rank, alpha=settings.alpha, dropout=settings.dropout,
                   targets=tuple(settings.targets), init_seed=init_seed)


class _Adapted:
    """What `LoRALinear` and `LoRAExperts` share: the merge state, the on/off switch, init,
    merge and unmerge over their (base weight, adapter) pairs."""

    merged: bool
    adapters_enabled: bool
    dropout: nn.Module

    def adapter_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(local name, parameter) of every adapter tensor, A before B."""
        raise NotImplementedError

    def _deltas(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """(base weight, its update B A * scaling in fp32), one pair at a time."""
        raise NotImplementedError

    @torch.no_grad()
    def init_adapters(self, generator: torch.Generator | None = None) -> None:
        """A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform with a=sqrt(5)), B = 0."""
        if self.merged:
            raise RuntimeError(f"{type(self).__name__}.init_adapters on a merged layer; "
                               "unmerge first")
        for name, p in self.adapter_parameters():
            p.copy_(adapter_init_tensor(name, tuple(p.shape), generator))

    def _adapt(self, out: torch.Tensor, x: torch.Tensor,
               update: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`out` (the base weights applied to `x`) with the adapters' `update(x)` as the state
        asks: added while on and unmerged, taken out again while merged but switched off."""
        if self.adapters_enabled and not self.merged:
            return out + update(self.dropout(x)).to(out.dtype)
        if self.merged and not self.adapters_enabled:
            # the update lives in the weight; take it out again (no second weight copy)
            return out - update(x).to(out.dtype)
        return out

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the update into the base weights (computed in fp32, stored in their dtype)."""
        if self.merged:
            return
        for weight, delta in self._deltas():
            weight.copy_((weight.float() + delta).to(weight.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Exact inverse of `merge` for fp32 weights up to rounding."""
        if not self.merged:
            return
        for weight, delta in self._deltas():
            weight.copy_((weight.float() - delta).to(weight.dtype))
        self.merged = False

    @contextmanager
    def disable_adapters(self) -> Iterator[Any]:
        previous, self.adapters_enabled = self.adapters_enabled, False
        try:
            yield self
        finally:
            self.adapters_enabled = previous


class LoRALinear(_Adapted, nn.Module):
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

    def adapter_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [("lora_A", self.lora_A), ("lora_B", self.lora_B)]

    init_weights = _Adapted.init_adapters

    def _update(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(F.linear(x.to(self.lora_A.dtype), self.lora_A), self.lora_B)
        return h * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._adapt(F.linear(x, self.weight, self.bias), x, self._update)

    def delta_weight(self) -> torch.Tensor:
        """B A * scaling in fp32, [out, in]."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling

    def _deltas(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        yield self.weight, self.delta_weight()

    def effective_weight(self) -> torch.Tensor:
        """The [out, in] matrix forward applies (W + B A * scaling while on and unmerged, W - it
        while merged and off), for code that reads a projection's matrix (MLA's decode)."""
        if self.adapters_enabled and not self.merged:
            return (self.weight.float() + self.delta_weight()).to(self.weight.dtype)
        if self.merged and not self.adapters_enabled:
            return (self.weight.float() - self.delta_weight()).to(self.weight.dtype)
        return self.weight

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, rank={self.rank}, alpha={self.alpha}, "
                f"merged={self.merged}")


class LoRAExperts(_Adapted, Experts):
    """MoE experts whose `projections` (of "gate", "up", "down") carry stacked adapters
    `{p}_lora_A` [E, r, in] and `{p}_lora_B` [E, out, r]; see the module docstring.

    It holds the wrapped `Experts`' own parameters, buffers and attributes (the same objects,
    under the same names, whatever activation or biases the experts have) and overrides only
    `Experts.project`, so both dispatch paths (grouped matmuls, the loop) run the adapters.
    """

    def __init__(self, base: Experts, projections: tuple[str, ...], rank: int, alpha: float,
                 dropout: float = 0.0):
        nn.Module.__init__(self)
        own = set(self.__dict__)
        self.__dict__.update({k: v for k, v in base.__dict__.items() if k not in own})
        self.training = base.training
        self._parameters.update(base._parameters)
        self._buffers.update(base._buffers)
        self._non_persistent_buffers_set.update(base._non_persistent_buffers_set)
        self._modules.update(base._modules)
        unknown = set(projections) - set(EXPERT_PROJECTIONS)
        assert not unknown, unknown
        self.projections = tuple(p for p in EXPERT_PROJECTIONS if p in projections)
        self.rank, self.alpha = rank, float(alpha)
        self.scaling = self.alpha / rank
        for p in self.projections:
            w = getattr(self, p)
            num_experts, d_out, d_in = w.shape
            factory = dict(device=w.device, dtype=w.dtype)
            setattr(self, f"{p}_lora_A",
                    nn.Parameter(torch.empty(num_experts, rank, d_in, **factory)))
            setattr(self, f"{p}_lora_B",
                    nn.Parameter(torch.empty(num_experts, d_out, rank, **factory)))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self.adapters_enabled = True

    def adapter_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(f"{p}_lora_{ab}", getattr(self, f"{p}_lora_{ab}"))
                for p in self.projections for ab in "AB"]

    def project(self, name: str, x_sorted: torch.Tensor,
                groups: torch.Tensor | list[int]) -> torch.Tensor:
        out = super().project(name, x_sorted, groups)
        if name not in self.projections:
            return out
        return self._adapt(out, x_sorted, lambda x: self._update(name, x, groups))

    def _update(self, name: str, x_sorted: torch.Tensor,
                groups: torch.Tensor | list[int]) -> torch.Tensor:
        a = local_tensor(getattr(self, f"{name}_lora_A"))
        b = local_tensor(getattr(self, f"{name}_lora_B"))
        if isinstance(groups, torch.Tensor) and (self.rank * a.element_size()) % 16:
            # torch._grouped_mm needs row strides of whole 16 bytes ([rows, r] here): loop
            groups = torch.diff(groups, prepend=groups.new_zeros(1)).tolist()
        h = self.expert_matmul(x_sorted.to(a.dtype), a, groups)
        return self.expert_matmul(h, b, groups) * self.scaling

    def delta_weight(self, name: str) -> torch.Tensor:
        """B_e A_e * scaling of projection `name` for every expert e, fp32, [E, out, in]."""
        a, b = getattr(self, f"{name}_lora_A"), getattr(self, f"{name}_lora_B")
        return torch.bmm(b.float(), a.float()) * self.scaling

    def _deltas(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        for p in self.projections:
            yield getattr(self, p), self.delta_weight(p)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, adapted={list(self.projections)}, rank={self.rank}, "
                f"alpha={self.alpha}, merged={self.merged}")


# ------------------------------------------------------------------------------- applying


def target_of(name: str, targets: tuple[str, ...], *, stacked: bool = False) -> str | None:
    """The first of `targets` naming `name`: its last path component or a dotted suffix
    (`q`, `attn.q`). A stacked expert weight (`stacked`, e.g. `layers.1.mlp.experts.gate`) is
    named only with its `experts.` part (`experts.gate`), never by `gate` alone."""
    for target in targets:
        if (name == target or name.endswith("." + target)) and (
                not stacked or names_experts(target)):
            return target
    return None


def _unknown_targets_error(model: nn.Module, unknown: list[str], linear_names: list[str],
                           expert_names: list[str]) -> ConfigError:
    available = sorted({n.rpartition(".")[2] for n in linear_names})
    kinds = "nn.Linear or MoE expert weight" if expert_names else "nn.Linear"
    msg = (f"lora.targets {unknown} match no {kinds} of this {type(model).__name__}; "
           f"its Linear modules are named {available}")
    expert_like: list[str] = []
    if expert_names:
        msg += f", its MoE expert weights {[f'experts.{p}' for p in EXPERT_PROJECTIONS]}"
        expert_like = [t for t in unknown if t.rpartition(".")[2] in EXPERT_PROJECTIONS
                       and not names_experts(t)]
    if expert_like:
        msg += (f". {expert_like} name no dense MLP here; MoE expert weights are targeted with "
                f"their experts. part, e.g. 'experts.{expert_like[0].rpartition('.')[2]}'")
    leaf_names = ({n.rpartition(".")[2] for n, _ in model.named_modules()}
                  | {n.rpartition(".")[2] for n, _ in model.named_parameters()})
    not_linear = sorted((set(unknown) & leaf_names) - set(expert_like))
    if not_linear:
        msg += (f". {not_linear} exist but are not nn.Linear (e.g. norms), which LoRA does "
                "not adapt")
    return ConfigError(msg)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name), leaf, module)


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Wrap every matching `nn.Linear` of `model` in place in a `LoRALinear`, every `Experts`
    with a matching projection in a `LoRAExperts`, and freeze all other parameters. Returns
    `model`. On the meta device A and B stay uninitialised: call `init_lora_weights` after
    materialising."""
    if lora_modules(model):
        raise ConfigError("apply_lora: the model already has LoRA adapters")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    experts = {name: m for name, m in model.named_modules() if isinstance(m, Experts)}
    chosen = {name: t for name in linears if (t := target_of(name, cfg.targets)) is not None}
    chosen_experts = {name: tuple(p for p in EXPERT_PROJECTIONS
                                  if target_of(f"{name}.{p}", cfg.targets, stacked=True))
                      for name in experts}
    chosen_experts = {name: projs for name, projs in chosen_experts.items() if projs}
    hit = set(chosen.values()) | {target_of(f"{name}.{p}", cfg.targets, stacked=True)
                                  for name, projs in chosen_experts.items() for p in projs}
    unknown = [t for t in cfg.targets if t not in hit]
    if unknown:
        raise _unknown_targets_error(model, unknown, list(linears), list(experts))
    head_weight = getattr(getattr(model, "head", None), "weight", None)
    on_head = [name for name in chosen if linears[name].weight is head_weight]
    if on_head:
        raise ConfigError(f"lora.targets select the LM head ({on_head}); losses read "
                          "head.weight directly and would miss the adapter; remove it")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in chosen:
        _replace(model, name, LoRALinear(linears[name], cfg.rank, cfg.alpha, cfg.dropout))
    for name, projs in chosen_experts.items():
        _replace(model, name, LoRAExperts(experts[name], projs, cfg.rank, cfg.alpha,
                                          cfg.dropout))
    if not any(p.is_meta for p in model.parameters()):
        init_lora_weights(model, seed=cfg.init_seed)
    return model


def init_lora_weights(model: nn.Module, seed: int | None = None) -> None:
    """(Re)initialise every adapter: A kaiming-uniform (from `seed` if given), B zero."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    for _, module in lora_modules(model):
        module.init_adapters(generator)


def is_adapter_name(name: str) -> bool:
    """Whether parameter `name` is a LoRA adapter (`...q.lora_A`, `...experts.gate_lora_B`)."""
    return name.endswith(("lora_A", "lora_B"))


def apply_lora_settings(model: nn.Module, settings: Any, token_ids: Sequence[int] = (), *,
                        required: Sequence[int] = ()) -> nn.Module:
    """A native model's LoRA as a run's `model.lora` (a `LoraSettings`) sets it, the one way
    training, export and the memory plan build it: the adapters on its targets, then the
    vocabulary rows of `token_ids` (the resolved `trainable_tokens`) and the modules of
    `modules_to_save` trainable (`posttrain.models.trainable_tokens.apply_trainable_tokens`, with `required`). Returns `model`."""
    from posttrain.models.trainable_tokens import apply_trainable_tokens
    apply_lora(model, LoraConfig.of(settings))
    return apply_trainable_tokens(model, token_ids, settings.modules_to_save, required=required)


def adapter_init_tensor(name: str, shape: tuple[int, ...],
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """The full initial value of adapter parameter `name` (`...lora_A` or `...lora_B`; A is
    [r, in] or stacked [E, r, in]).

    For models materialized from the meta device and sharded before they have storage: each
    rank builds the same full tensor from the same generator and keeps its shard. Same
    distribution as `init_lora_weights`.
    """
    from posttrain.models.trainable_tokens import is_token_delta
    if name.endswith("lora_B") or is_token_delta(name):    # trainable token rows: delta 0
        return torch.zeros(shape)
    if name.endswith("lora_A"):
        bound = 1.0 / math.sqrt(shape[-1])
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)
    raise KeyError(f"{name} is not a LoRA adapter parameter")


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear | LoRAExperts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _Adapted)]


def merge_lora(model: nn.Module) -> None:
    for _, module in lora_modules(model):
        module.merge()


def unmerge_lora(model: nn.Module) -> None:
    for _, module in lora_modules(model):
        module.unmerge()


@contextmanager
def disable_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block `model` computes the base model's outputs (merged or not), trainable
    token rows off too (`posttrain.models.trainable_tokens`). Whole modules trained beside the
    adapters (`modules_to_save`) hold no base any more: refused."""
    from posttrain.models.trainable_tokens import token_rows
    if getattr(model, "modules_to_save", ()):
        raise ConfigError(f"the base model is not inside this LoRA model: model.lora."
                          f"modules_to_save trains {list(model.modules_to_save)} whole; use "
                          "model.lora.trainable_tokens for their rows instead, or a reference "
                          "of its own (a copy) in place of lora_base")
    with ExitStack() as stack:
        for _, module in [*lora_modules(model), *token_rows(model)]:
            stack.enter_context(module.disable_adapters())
        yield model


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Native name (`layers.0.attn.q.lora_A`) -> adapter tensor (detached, not copied)."""
    return {name: p.detach() for name, p in model.named_parameters() if is_adapter_name(name)}


def adapter_names(weight_name: str) -> tuple[str, str]:
    """The names the adapters of base weight `weight_name` would have: `X.weight` ->
    (`X.lora_A`, `X.lora_B`), a stacked expert weight `E.p` -> (`E.p_lora_A`, `E.p_lora_B`)."""
    stem = (f"{weight_name.removesuffix('.weight')}.lora_" if weight_name.endswith(".weight")
            else f"{weight_name}_lora_")
    return stem + "A", stem + "B"


def merged_weight(base: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
                  scaling: float) -> torch.Tensor:
    """base + B A * scaling (B_e A_e per expert for stacked weights), computed in fp32 and
    stored in the base's dtype (the folded weight of `fold_adapters` and the weight sync)."""
    merged = lora_B.float() @ lora_A.float()
    # in place: the values of base.float() + delta * scaling, without three weight-sized temporaries
    merged.mul_(scaling).add_(base)
    return merged.to(base.dtype)


def fold_adapters(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A full native state dict with the adapters folded into their base weights and left out:
    `X.lora_A` / `X.lora_B` into `X.weight`, stacked `E.p_lora_A` / `E.p_lora_B` into `E.p`
    (`merged_weight`)."""
    out = {}
    for name, t in state.items():
        if is_adapter_name(name):
            continue
        a_name, b_name = adapter_names(name)
        if a_name in state:
            t = merged_weight(t, state[a_name], state[b_name], scaling)
        out[name] = t
    return out


def flops_kwargs(cfg: LoraConfig | None) -> dict[str, Any]:
    """Keyword arguments for `posttrain.models.flops` describing the adapters ({} without)."""
    if cfg is None:
        return {}
    return {"lora_rank": cfg.rank, "lora_targets": tuple(cfg.targets)}
