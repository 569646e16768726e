"""Trainable vocabulary rows beside LoRA: the embedding and LM-head rows of chosen tokens
(PEFT's `trainable_token_indices`), or whole vocabulary modules (PEFT's `modules_to_save`).

LoRA freezes the embedding and the head, so the rows of tokens added to the vocabulary
(`tokenizer.added_tokens`, semantic IDs: the mean of the old rows at start) would keep their
initial values for the whole run. `apply_trainable_tokens(model, token_ids)` gives the [V, H]
weight W of the embedding, and of an untied LM head, a trainable delta D [n, H] for the n ids
t_1..t_n, zero at start:

    W'[t_i] = W[t_i] + D_i,      W'[v] = W[v] for every other row v

computed in fp32 and stored in W's dtype. The embedding looks tokens up in W' (the n rows are
swapped in after the lookup of W: an [n, H] gather, no copy of W); the head's `weight` reads
W' (`LMHead.read_rows_from`: losses read `head.weight` directly), a [V, H] temporary per
forward whose gradient reaches D through the n rows only. A tied head reads the embedding's
W', so one D serves both, as PEFT ties the two adapters. Only D trains and has optimizer state;
it belongs to the FSDP root (sharded with the embedding and head) and the checkpoints; weight
decay pulls it toward the base rows.

PEFT stores the rows themselves (`trainable_tokens_delta` = W'[t], written over W's rows with
`index_copy`), so the PEFT export writes W[t] + D and loads on any base that has the rows,
whatever it holds there (a base resized with `resize_token_embeddings`). The merged export
writes W' (`merge_token_rows`), the weight sync sends D as an adapter of W
(`posttrain.rl.weight_sync`), and `posttrain.models.lora.disable_adapters` reads W (the base).

`modules_to_save=("embed", "head")` unfreezes whole modules instead (a tied head is the
embedding); their rows then need no delta. A run whose tokenizer added tokens must make their
rows trainable one way or the other: `apply_trainable_tokens(..., required=added_ids)` refuses
otherwise, naming the option.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from posttrain.config.model import VOCAB_MODULES, check_modules_to_save
from posttrain.errors import ConfigError

__all__ = ["VOCAB_MODULES", "TokenRows", "TokenRowsEmbedding", "apply_trainable_tokens",
           "check_modules_to_save", "hide_token_deltas", "is_token_delta", "merge_token_rows",
           "peft_vocab_entries", "token_rows", "token_rows_weight", "unmerge_token_rows"]

DELTA = "token_adapter.delta"


def is_token_delta(name: str) -> bool:
    """Whether parameter `name` is a trainable-token delta (`embed.token_adapter.delta`)."""
    return name == DELTA or name.endswith("." + DELTA)


def token_rows_weight(weight: torch.Tensor, token_ids: torch.Tensor,
                      delta: torch.Tensor) -> torch.Tensor:
    """W' of the module docstring: `weight` [V, H] with rows `token_ids` [n] replaced by
    W[t] + D (fp32 sum, W's dtype); differentiable in `delta`."""
    rows = (weight[token_ids].float() + delta.float()).to(weight.dtype)
    return weight.index_copy(0, token_ids, rows)


class TokenRows(nn.Module):
    """The trainable delta `delta` [n, H] of rows `token_ids` of a frozen [V, H] weight that
    the owner passes in (module docstring). `merged`: W' is written into the weight;
    `adapters_enabled`: False inside `posttrain.models.lora.disable_adapters`."""

    def __init__(self, token_ids: Sequence[int], hidden_size: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.token_ids = tuple(int(t) for t in token_ids)
        assert self.token_ids and len(set(self.token_ids)) == len(self.token_ids)
        self.delta = nn.Parameter(torch.zeros(len(self.token_ids), hidden_size, device=device,
                                              dtype=dtype))
        self.adapters_enabled = True
        self.merged = False
        self._originals: torch.Tensor | None = None       # W[t] while merged
        self._index: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _ids(self, device: torch.device, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [n], slot of every id [vocab]: its row in `delta`, -1 if none) on `device`."""
        key = (device, vocab)
        if key not in self._index:
            ids = torch.tensor(self.token_ids, dtype=torch.long, device=device)
            slots = torch.full((vocab,), -1, dtype=torch.long, device=device)
            slots[ids] = torch.arange(len(ids), device=device)
            self._index[key] = ids, slots
        return self._index[key]

    def _swapped_rows(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The rows that differ between `weight` and what the forward must read: W[t] + D
        while on and unmerged, the originals while merged but off, else None."""
        if self.adapters_enabled and not self.merged:
            ids, _ = self._ids(weight.device, weight.shape[0])
            return (weight[ids].float() + self.delta.float()).to(weight.dtype)
        if self.merged and not self.adapters_enabled:
            assert self._originals is not None
            return self._originals.to(weight)
        return None

    def apply(self, weight: torch.Tensor) -> torch.Tensor:
        """The [V, H] weight the forward reads (W', or W when off). A sharded weight (a
        DTensor: FSDP2 outside the forward, which reads the parameter by name to re-register
        it) is returned as it is; the forward sees it gathered."""
        if isinstance(weight, DTensor):
            return weight
        rows = self._swapped_rows(weight)
        if rows is None:
            return weight
        ids, _ = self._ids(weight.device, weight.shape[0])
        return weight.index_copy(0, ids, rows)

    def lookup(self, input_ids: torch.Tensor, looked_up: torch.Tensor,
               weight: torch.Tensor) -> torch.Tensor:
        """`looked_up` = `weight`[input_ids] [..., H] with the trainable ids' rows swapped for
        theirs in W' (equal to a lookup in `apply(weight)`)."""
        rows = self._swapped_rows(weight)
        if rows is None:
            return looked_up
        _, slots = self._ids(weight.device, weight.shape[0])
        slot = slots[input_ids]
        picked = F.embedding(slot.clamp(min=0), rows).to(looked_up.dtype)
        return torch.where((slot >= 0).unsqueeze(-1), picked, looked_up)

    @torch.no_grad()
    def merge(self, weight: torch.Tensor) -> None:
        """Write W' into `weight` in place (its original rows kept for `unmerge`)."""
        if self.merged:
            return
        ids, _ = self._ids(weight.device, weight.shape[0])
        rows = (weight[ids].float() + self.delta.float()).to(weight.dtype)
        self._originals = weight[ids].clone()
        weight.index_copy_(0, ids, rows)
        self.merged = True

    @torch.no_grad()
    def unmerge(self, weight: torch.Tensor) -> None:
        """Put the original rows back (bit-exact)."""
        if not self.merged:
            return
        assert self._originals is not None
        ids, _ = self._ids(weight.device, weight.shape[0])
        weight.index_copy_(0, ids, self._originals)
        self._originals, self.merged = None, False

    @contextmanager
    def disable_adapters(self) -> Iterator["TokenRows"]:
        previous, self.adapters_enabled = self.adapters_enabled, False
        try:
            yield self
        finally:
            self.adapters_enabled = previous

    def extra_repr(self) -> str:
        ids = self.token_ids
        shown = f"{list(ids[:4])[:-1]}...{ids[-1]}" if len(ids) > 4 else str(list(ids))
        return f"tokens={shown} ({len(ids)}), merged={self.merged}"


class TokenRowsEmbedding(nn.Embedding):
    """An `nn.Embedding` (the same `weight` Parameter, under the same name) whose lookups
    read W' of its `token_adapter` (module docstring)."""

    def __init__(self, base: nn.Embedding, token_ids: Sequence[int]):
        nn.Module.__init__(self)
        for attr in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                     "scale_grad_by_freq", "sparse"):
            setattr(self, attr, getattr(base, attr))
        self.weight = base.weight
        self.token_adapter = TokenRows(token_ids, base.embedding_dim, device=base.weight.device,
                                       dtype=base.weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.token_adapter.lookup(input_ids, super().forward(input_ids), self.weight)


def _is_lm_head(model: nn.Module) -> bool:
    from posttrain.models.transformer import LMHead
    return isinstance(getattr(model, "head", None), LMHead)


def _is_tied(model: nn.Module) -> bool:
    return _is_lm_head(model) and "_tied_embedding" in model.head.__dict__


def apply_trainable_tokens(model: nn.Module, token_ids: Sequence[int] = (),
                           modules_to_save: Sequence[str] = (), *,
                           required: Sequence[int] = ()) -> nn.Module:
    """Make vocabulary rows of a LoRA `model` (a native `Transformer`, after `apply_lora`)
    trainable: rows `token_ids` of the embedding and of an untied LM head get a `TokenRows`
    delta (zero: the model is unchanged), the modules of `modules_to_save` (of "embed",
    "head"; a tied head is the embedding) train whole. `required` are the ids whose rows
    must be trainable (the tokens the tokenizer added): refused with a ConfigError naming
    `model.lora.trainable_tokens` where a vocabulary module would keep them frozen. Call it
    before sharding, like `apply_lora`. Returns `model`."""
    check_modules_to_save(modules_to_save)
    if token_rows(model) or getattr(model, "modules_to_save", ()):
        raise ConfigError("apply_trainable_tokens: the model has trainable vocabulary rows "
                          "already")
    if not hasattr(model, "args") or not isinstance(getattr(model, "embed", None), nn.Embedding):
        raise ConfigError("model.lora.trainable_tokens / modules_to_save need a model with a "
                          "native definition (an `embed` embedding and an LM head)")
    ids = tuple(int(t) for t in token_ids)
    vocab = model.args.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad or len(set(ids)) != len(ids):
        raise ConfigError(f"model.lora.trainable_tokens: ids must be distinct and in "
                          f"[0, {vocab}) (the vocabulary); got {bad[:5] or 'duplicates'}")
    tied, lm_head = _is_tied(model), _is_lm_head(model)
    modules = set(modules_to_save)
    if "head" in modules and not lm_head:
        raise ConfigError(f"model.lora.modules_to_save: this model's head is a "
                          f"{type(model.head).__name__}, not an LM head; remove 'head'")
    if tied and modules:
        modules = {"embed", "head"}                 # one weight
    vocab_modules = ["embed"] + (["head"] if lm_head else [])
    missing = sorted(set(required) - set(ids))
    frozen = [m for m in vocab_modules if m not in modules] if missing else []
    if frozen:
        raise ConfigError(
            f"model.lora: the tokenizer added {len(set(required))} tokens (ids "
            f"{min(required)}..{max(required)}: tokenizer.added_tokens / semantic_ids) whose "
            f"{' and '.join(frozen)} rows LoRA would leave at their initial values (the base "
            f"is frozen); {len(missing)} of them are not in model.lora.trainable_tokens. Set "
            "model.lora.trainable_tokens: added (the default: their rows train), list their "
            "ids, set model.lora.modules_to_save: [embed, head] (the whole modules train), or "
            "train without model.lora")
    if "embed" in modules:
        model.embed.weight.requires_grad_(True)
    if "head" in modules and not tied:
        model.head._parameters["weight"].requires_grad_(True)
    if ids and "embed" not in modules:
        model.embed = TokenRowsEmbedding(model.embed, ids)
        model.tie_weights()                         # a tied head reads the new embedding
    if ids and lm_head:
        if tied and "embed" not in modules:
            model.head.read_rows_from(model.embed.token_adapter)
        elif not tied and "head" not in modules:
            weight = model.head._parameters["weight"]
            model.head.token_adapter = TokenRows(ids, weight.shape[1], device=weight.device,
                                                 dtype=weight.dtype)
            model.head.read_rows_from(model.head.token_adapter)
    model.modules_to_save = tuple(m for m in VOCAB_MODULES if m in modules)
    return model


def token_rows(model: nn.Module) -> list[tuple[str, TokenRows]]:
    """(native name of the weight it adapts, `TokenRows`) of every delta of `model`: the
    embedding's, and an untied head's (a tied head shares the embedding's)."""
    out = []
    for module_name in VOCAB_MODULES:
        module = getattr(model, module_name, None)
        adapter = getattr(module, "_modules", {}).get("token_adapter")
        if isinstance(adapter, TokenRows):
            out.append((f"{module_name}.weight", adapter))
    return out


def _raw_weight(model: nn.Module, weight_name: str) -> torch.Tensor:
    module = getattr(model, weight_name.partition(".")[0])
    return module._parameters["weight"]


def merge_token_rows(model: nn.Module) -> list[TokenRows]:
    """Write W' into each adapted weight (`TokenRows.merge`); returns those merged now."""
    merged = []
    for name, rows in token_rows(model):
        if not rows.merged:
            rows.merge(_raw_weight(model, name))
            merged.append(rows)
    return merged


def unmerge_token_rows(model: nn.Module, only: Sequence[TokenRows] | None = None) -> None:
    """Undo `merge_token_rows` (of the `only` adapters, default all)."""
    for name, rows in token_rows(model):
        if only is None or any(rows is r for r in only):
            rows.unmerge(_raw_weight(model, name))


@contextmanager
def hide_token_deltas(model: nn.Module) -> Iterator[None]:
    """Exporters see no delta parameters inside the block (merge first: `merge_token_rows`)."""
    hidden = [(rows, rows._parameters.pop("delta")) for _, rows in token_rows(model)]
    try:
        yield
    finally:
        for rows, delta in hidden:
            rows._parameters["delta"] = delta


def peft_vocab_entries(model: nn.Module, to_hf: Callable[[str], str],
                       full_cpu: Callable[[torch.Tensor], torch.Tensor]
                       ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and `adapter_config.json` fields of PEFT 0.21 that carry the trainable
    vocabulary of `model`: `base_model.model.<module>.token_adapter.trainable_tokens_delta`
    (the rows W[t] + D) with `trainable_token_indices` (a list for a tied model, whose lm_head
    adapter PEFT ties to the embedding's; else {module: ids}), and whole modules as
    `base_model.model.<module>.weight` with `modules_to_save` (a tied model's embedding under
    both its names: PEFT saves the two modules apart)."""
    tensors: dict[str, torch.Tensor] = {}
    fields: dict[str, Any] = {}
    saved = getattr(model, "modules_to_save", ())
    if not token_rows(model) and not saved:
        return tensors, fields
    vocab, tied = model.args.vocab_size, _is_tied(model)
    indices: dict[str, list[int]] = {}
    for name, rows in token_rows(model):
        hf_module = to_hf(name).removesuffix(".weight")
        weight = full_cpu(_raw_weight(model, name))
        delta = full_cpu(rows.delta)
        ids = torch.tensor(rows.token_ids)
        values = (weight[ids].clone() if rows.merged      # W' is in the weight already
                  else (weight[ids].float() + delta.float()).to(weight.dtype))
        tensors[f"base_model.model.{hf_module}.token_adapter.trainable_tokens_delta"] = values
        indices[hf_module.rpartition(".")[2]] = list(rows.token_ids)
    if indices:
        fields["trainable_token_indices"] = (next(iter(indices.values())) if tied
                                             else indices)
    if saved:
        fields["modules_to_save"] = []
        for module_name in saved:
            source = "embed.weight" if tied else f"{module_name}.weight"
            hf_name = to_hf(f"{module_name}.weight")
            tensors[f"base_model.model.{hf_name}"] = full_cpu(
                _raw_weight(model, source))[:vocab].clone()
            fields["modules_to_save"].append(hf_name.removesuffix(".weight").rpartition(".")[2])
    return tensors, fields
