"""Architectures without a native definition: a transformers model behind the native interface.

`HFCausalLM` wraps any `AutoModelForCausalLM` so that the trainer can treat it like the native
`Transformer`:

    hidden = model(input_ids, position_ids=None, document_lengths=None)   # [B, T, H], final norm
    logits = model.logits(hidden)                # lm_head (+ soft-capping), padding ids -inf
    model.head.weight / .bias / .softcap / .real_vocab_size    # for chunked cross-entropy
    model.layers                                 # the decoder ModuleList (FSDP, checkpointing)
    model.embed                                  # the input embedding
    model.head = nn.Linear(H, 1)                 # a custom head (a reward model's) replaces it

Rollouts decode through transformers' own KV cache (`HFKVCache`, `forward_with_hf_cache`),
driven by the native engine's loop and sampler (`posttrain.rl.native.NativeEngine`).

What does not carry over from the native models (`load_fallback` warns with this list):

- document-masked attention: packed rows work only where transformers itself turns restarting
  position ids into a per-document mask (its `create_causal_mask` packed-sequence detection,
  or flash-attention varlen). `load_fallback` probes this on the loaded weights; where it fails,
  a row with more than one document raises unless `allow_cross_document_attention=True`.
- native LoRA target names: `apply_lora` matches the architecture's own Linear names (e.g.
  `q_proj`); architectures built on other layer types (GPT-2's Conv1D) cannot take LoRA.
- sharding plans by name: no tensor parallelism; FSDP wraps `layers` and the root only.
- FLOPs formula: MFU uses 6 N FLOPs per token (`estimated_flops_per_token`), no attention term.
- vocabulary padding: embedding and head keep the checkpoint's rows.

Chunked cross-entropy works unchanged: it reads `head.weight` (and `head.bias`, `head.softcap`).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.errors import ConfigError, PosttrainError
from posttrain.models.hf_io import config_dtype, read_hf_config
from posttrain.models.layers import position_ids_from_documents
from posttrain.ops.vocab import mask_padded_logits

__all__ = ["FallbackWarning", "HFCausalLM", "HFKVCache", "estimated_flops_per_token",
           "forward_with_hf_cache", "load_fallback"]

_HF_PREFIX = "hf."
_PROBE_DOCS = (3, 5)


class FallbackWarning(UserWarning):
    """A model runs through transformers instead of a native definition."""


class _HeadView:
    """`model.head` of a wrapped model: the live LM-head parameters plus what a loss computed
    from `weight` needs. Not a registered module, so no parameter is listed twice."""

    def __init__(self, owner: "HFCausalLM"):
        self._owner = owner

    @property
    def _linear(self) -> nn.Module:
        return self._owner.hf.get_output_embeddings()

    @property
    def weight(self) -> torch.Tensor:
        return self._linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self._linear, "bias", None)

    @property
    def real_vocab_size(self) -> int:
        return self._owner.real_vocab_size

    @property
    def softcap(self) -> float | None:
        return self._owner.softcap

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._owner.logits(hidden)


def _find_layers(hf_model: nn.Module, num_layers: int | None) -> str:
    """Path of the decoder-block ModuleList: the shallowest one with num_hidden_layers blocks."""
    lists = [(name, m) for name, m in hf_model.named_modules() if isinstance(m, nn.ModuleList)]
    exact = [name for name, m in lists if len(m) == num_layers]
    if exact:
        return min(exact, key=lambda n: n.count("."))
    if lists:
        return max(lists, key=lambda item: len(item[1]))[0]
    raise ConfigError(f"{type(hf_model).__name__} has no nn.ModuleList of decoder blocks; "
                      "the fallback cannot expose `layers` for FSDP / checkpointing")


class HFCausalLM(nn.Module):
    """A transformers causal LM with the native `Transformer` interface (module docstring).

    `supports_packed_documents`: whether restarting position ids give per-document attention
    (set by `probe_packed_documents`, False until probed).

    Assigning a module to `head` (``model.head = nn.Linear(H, 1)``, as the reward model does)
    registers it as a submodule named ``head`` that `head` then returns; the transformers LM
    head stays in `hf`, unused.
    """

    def __init__(self, hf_model: nn.Module, *, allow_cross_document_attention: bool = False):
        super().__init__()
        self.hf = hf_model
        text_config = hf_model.config.get_text_config()
        self.model_type = getattr(hf_model.config, "model_type", type(hf_model).__name__)
        self.real_vocab_size = int(text_config.vocab_size)
        self.hidden_size = int(text_config.hidden_size)
        self.max_position_embeddings = getattr(text_config, "max_position_embeddings", None)
        self.softcap = getattr(text_config, "final_logit_softcapping", None)
        self.allow_cross_document_attention = allow_cross_document_attention
        self.supports_packed_documents = False
        self._layers_path = _find_layers(hf_model, getattr(text_config, "num_hidden_layers",
                                                           None))
        if hf_model.base_model is hf_model:
            raise ConfigError(f"{type(hf_model).__name__} does not expose its decoder as "
                              "`base_model`; the fallback needs the hidden states before the "
                              "LM head")
        if hf_model.get_output_embeddings() is None:
            raise ConfigError(f"{type(hf_model).__name__} has no output embedding (LM head)")

    # ---- the native interface -------------------------------------------------------------
    @property
    def head(self) -> nn.Module | _HeadView:
        # nn.Module.__setattr__ files an assigned module under _modules, past this property
        custom = self._modules.get("head")
        return custom if custom is not None else _HeadView(self)

    @property
    def has_custom_head(self) -> bool:
        return self._modules.get("head") is not None

    @property
    def layers(self) -> nn.ModuleList:
        return self.hf.get_submodule(self._layers_path)

    @property
    def embed(self) -> nn.Module:
        return self.hf.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_lengths: list[list[int]] | None = None) -> torch.Tensor:
        """input_ids [B, T] -> final hidden states [B, T, H] (what the LM head reads).

        With `document_lengths`, positions restart at every document (as in the native model);
        explicit `position_ids` must then restart there too, since that is how transformers
        finds the documents.
        """
        B, T = input_ids.shape
        if document_lengths is not None:
            expected = position_ids_from_documents(document_lengths, T, input_ids.device)
            packed = any(len(row) > 1 for row in document_lengths)
            if packed and not (self.supports_packed_documents
                               or self.allow_cross_document_attention):
                raise PosttrainError(
                    f"this {self.model_type} model runs through transformers, whose attention "
                    "does not separate the documents of a packed row for this architecture / "
                    "attn_implementation; pack one document per row, try "
                    "attn_implementation='flash_attention_2', or pass "
                    "allow_cross_document_attention=True to let documents attend to each other")
            if position_ids is None:
                position_ids = expected
            elif packed and not torch.equal(position_ids.to(expected.device), expected):
                raise PosttrainError("position_ids must restart at 0 at every document start "
                                     "of a packed row; transformers finds documents that way")
        out = self.hf.base_model(input_ids=input_ids, position_ids=position_ids,
                                 use_cache=False)
        return out[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> logits [B, T, V], soft-capped where the config says so."""
        logits = self.hf.get_output_embeddings()(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return mask_padded_logits(logits, self.real_vocab_size)

    def hf_parameter_name(self, name: str) -> str:
        """Parameter name in this wrapper -> key in the transformers checkpoint."""
        return name.removeprefix(_HF_PREFIX)

    def save_pretrained(self, out_dir: str | Path, **kwargs: Any) -> None:
        """Write an HF checkpoint (transformers' `save_pretrained`)."""
        self.hf.save_pretrained(out_dir, **kwargs)

    # ---- load-time checks -----------------------------------------------------------------
    @torch.no_grad()
    def probe_packed_documents(self, seed: int = 0) -> bool:
        """Whether a packed row's second document is independent of the first.

        Runs two rows whose first documents differ and whose second documents are equal,
        with positions restarting at the boundary; with a per-document mask the second
        document's hidden states are identical. Sets `supports_packed_documents`.
        """
        device = self.embed.weight.device
        gen = torch.Generator().manual_seed(seed)
        vocab = self.real_vocab_size
        first = torch.randint(0, vocab, (2, _PROBE_DOCS[0]), generator=gen)
        second = torch.randint(0, vocab, (1, _PROBE_DOCS[1]), generator=gen).expand(2, -1)
        ids = torch.cat([first, second], dim=1).to(device)
        positions = position_ids_from_documents([list(_PROBE_DOCS)] * 2, ids.shape[1], device)
        with _eval_mode(self):
            hidden = self.hf.base_model(input_ids=ids, position_ids=positions,
                                        use_cache=False)[0].float()
        tail = hidden[:, _PROBE_DOCS[0]:]
        scale = max(float(tail.abs().max()), 1.0)
        self.supports_packed_documents = bool((tail[0] - tail[1]).abs().max() <= 1e-5 * scale)
        return self.supports_packed_documents

    @torch.no_grad()
    def check_logits(self, seq_len: int = 8, seed: int = 0) -> float:
        """Max |logits(forward(ids)) - transformers' logits| on random ids; raises a
        ConfigError when the architecture post-processes logits in a way `logits` (and a loss
        over `head.weight`) would miss, e.g. a logit scale."""
        device = self.embed.weight.device
        ids = torch.randint(0, self.real_vocab_size, (1, seq_len),
                            generator=torch.Generator().manual_seed(seed)).to(device)
        with _eval_mode(self):
            ours = self.logits(self(ids)).float()
            ref = self.hf(input_ids=ids, use_cache=False).logits.float()
        diff = float((ours - ref).abs().max())
        if not diff <= 1e-3 * max(float(ref.abs().max()), 1.0):
            raise ConfigError(
                f"{type(self.hf).__name__}: base model + LM head give logits that differ from "
                f"the model's own by {diff:.3g}; it post-processes logits (a scale or cap the "
                "fallback does not know), so losses over head.weight would be wrong. Add a "
                "native bridge for this architecture.")
        return diff


@dataclass
class HFKVCache:
    """transformers' own KV cache of an `HFCausalLM`, behind the interface of the native
    `posttrain.models.kv_cache.KVCache` (which `NativeEngine` drives): rows are left-padded,
    slot s of row b holds the token at position s - pad_b, every step writes all rows at slot
    `length`. The attention mask (padding slots off) and the positions are passed to
    transformers at every forward, which masks causally (and by sliding window) itself.

    `select` reorders the transformers cache in place (`Cache.reorder_cache`, which every
    cache layer kind implements) and returns the cache of the selected rows; the cache it was
    called on must not be used afterwards.
    """

    cache: Any                   # a transformers `Cache`
    pad_B: torch.Tensor          # int64 [B]: left-padding slots of each row
    capacity: int
    length: int = 0

    @classmethod
    def allocate(cls, model: HFCausalLM, pad_B: torch.Tensor, capacity: int) -> "HFKVCache":
        from transformers import DynamicCache
        return cls(DynamicCache(config=model.hf.config), pad_B.to(model.embed.weight.device),
                   capacity)

    def select(self, rows_B: torch.Tensor) -> "HFKVCache":
        self.cache.reorder_cache(rows_B)
        return HFKVCache(self.cache, self.pad_B.index_select(0, rows_B), self.capacity,
                         self.length)


def forward_with_hf_cache(model: HFCausalLM, input_ids_BT: torch.Tensor,
                          cache: HFKVCache) -> torch.Tensor:
    """`posttrain.models.kv_cache.forward_with_cache` for an `HFCausalLM`: T new tokens per row
    at slots [length, length + T), through transformers with its cache; returns the final
    hidden states [B, T, H] and advances `cache.length`."""
    T = input_ids_BT.shape[1]
    start, end = cache.length, cache.length + T
    assert end <= cache.capacity, f"KV cache full: {end} > {cache.capacity} slots"
    slots_S = torch.arange(end, device=input_ids_BT.device)
    mask_BS = (slots_S[None] >= cache.pad_B[:, None]).long()
    positions_BT = (slots_S[None, start:] - cache.pad_B[:, None]).clamp_min(0)
    out = model.hf.base_model(input_ids=input_ids_BT, attention_mask=mask_BS,
                              position_ids=positions_BT, use_cache=True,
                              **{_cache_argument(model.hf.base_model): cache.cache})
    cache.length = end
    return out[0]


def _cache_argument(decoder: nn.Module) -> str:
    """The keyword a transformers decoder takes its cache by: `cache` from transformers 5.2x,
    `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters \
        else "past_key_values"


class _eval_mode:
    def __init__(self, module: nn.Module):
        self.module, self.was_training = module, module.training

    def __enter__(self) -> None:
        self.module.eval()

    def __exit__(self, *exc: Any) -> None:
        self.module.train(self.was_training)


def estimated_flops_per_token(model: nn.Module) -> float:
    """6 N training FLOPs per token, N = parameters used in matmuls (the input embedding is a
    lookup and counts only when tied to the head); attention's T-dependent term is left out."""
    params = {id(p): p.numel() for p in model.parameters()}
    embed, head = model.embed.weight, model.head.weight
    if embed is not head:
        params.pop(id(embed), None)
    if getattr(model, "has_custom_head", False):     # the transformers LM head is not run
        params.pop(id(model.hf.get_output_embeddings().weight), None)
    return 6.0 * sum(params.values())


def _limitations(model: HFCausalLM, vocab_multiple: int | None) -> list[str]:
    packing = ("native document-masked attention; packed rows rely on transformers' handling "
               "of restarting position ids (probed: documents are separated)"
               if model.supports_packed_documents else
               "document-masked attention: this architecture's attention does NOT separate "
               "the documents of a packed row; "
               "rows with several documents raise (allow_cross_document_attention=True "
               "overrides) and GRPO trains one sequence per micro-batch")
    linears = sorted({name.rpartition(".")[2] for name, m in model.hf.named_modules()
                      if isinstance(m, nn.Linear) and m is not model.hf.get_output_embeddings()})
    out = [packing,
           f"LoRA targets use this architecture's own Linear names ({', '.join(linears)}), "
           "not the native q/k/v/o/gate/up/down",
           "no tensor parallelism or name-based sharding plan; FSDP wraps `layers` only",
           "no FLOPs formula: MFU is estimated with 6*N FLOPs per token",
           "no vLLM rollouts: GRPO samples with the native engine's loop over transformers' "
           "KV cache (rollout.kind: native)"]
    if vocab_multiple and vocab_multiple > 1 and model.real_vocab_size % vocab_multiple:
        out.append(f"vocab_multiple={vocab_multiple} is ignored: the vocabulary stays "
                   f"{model.real_vocab_size} rows")
    return out


def load_fallback(hf_dir: str | Path, *, device: torch.device | str = "cpu",
                  dtype: torch.dtype | None = None, vocab_multiple: int | None = None,
                  attn_implementation: str | None = None,
                  allow_cross_document_attention: bool = False,
                  check: bool = True) -> HFCausalLM:
    """`AutoModelForCausalLM.from_pretrained(hf_dir)` wrapped in `HFCausalLM`, with a
    `FallbackWarning` listing what the native path would have added.

    `check=True` runs two tiny forwards on the loaded weights: the packed-document probe and
    the logits check (see `HFCausalLM`). dtype defaults to the checkpoint's.
    """
    from transformers import AutoModelForCausalLM

    config = read_hf_config(hf_dir)
    dtype = dtype or config_dtype(config) or torch.float32
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, **kwargs).to(device)
    model = HFCausalLM(hf_model, allow_cross_document_attention=allow_cross_document_attention)
    if check:
        model.check_logits()
        model.probe_packed_documents()
    lines = _limitations(model, vocab_multiple)
    message = (f"{hf_dir}: model_type '{model.model_type}' has no native definition; running "
               f"transformers' {type(hf_model).__name__} instead. Not available: "
               + "; ".join(f"({i}) {line}" for i, line in enumerate(lines, 1))
               + ". Chunked cross-entropy still works (it reads head.weight).")
    warnings.warn(message, FallbackWarning, stacklevel=2)
    return model
