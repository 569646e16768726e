"""What every family bridge shares: the HF <-> native name map and config helpers.

A bridge translates one Hugging Face `model_type` to and from the native model: `config.json`
to `ModelArgs` (and back for models built from args alone), and parameter names both ways. The
HF config is first parsed by transformers' own config class, so that old (`rope_theta`,
`rope_scaling`) and new (`rope_parameters`) spellings of a `config.json` read the same.

Tensors usually map one to one by name. Two other layouts are supported: a native parameter
stacked from one HF tensor per slice (`hf_names` / `stack_index`, Qwen3-MoE's experts), and one
HF tensor that holds several native parameters or a transposed one (`native_names` /
`to_native_tensors` / `to_hf_tensor`, GPT-OSS's fused `gate_up_proj`).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.errors import ConfigError, PosttrainError
from posttrain.models.args import ModelArgs

# native module path inside `layers[i]` -> HF module path inside `model.layers[i]`
COMMON_LAYER_NAMES: dict[str, str] = {
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.o": "self_attn.o_proj",
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
}
TOP_NAMES: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}
VOCAB_PARAMS = ("embed.weight", "head.weight")   # rows padded to `padded_vocab_size`

_NATIVE_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


class FamilyBridge:
    """Base bridge; a family sets the class attributes and implements `args_from_hf`."""

    family: str = ""
    model_types: tuple[str, ...] = ()
    architecture: str = ""                     # HF `architectures[0]` written on save
    # multimodal checkpoints whose text model is this family: model_type -> their layout
    multimodal_types: dict[str, "MultimodalLayout"] = {}
    layer_names: dict[str, str] = COMMON_LAYER_NAMES
    ignored_hf_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def __init__(self) -> None:
        self._to_native = {hf: native for native, hf in self.layer_names.items()}
        self._top_to_native = {hf: native for native, hf in TOP_NAMES.items()}

    def bind(self, config: dict[str, Any]) -> "FamilyBridge":
        """This bridge for one config.json, for families whose names depend on it (which
        layers are linear attention); most are the same for every config."""
        return self

    def is_passthrough(self, hf: str) -> bool:
        """Whether checkpoint key `hf` lies outside the model this bridge builds (a multimodal
        checkpoint's vision tower): not loaded, copied unchanged on export."""
        return False

    # ---- names ---------------------------------------------------------------------------
    def to_hf(self, native: str) -> str:
        """Native parameter name -> HF checkpoint key."""
        if native in TOP_NAMES:
            return TOP_NAMES[native]
        m = _NATIVE_LAYER.match(native)
        if m and m.group(2) in self.layer_names:
            return f"model.layers.{m.group(1)}.{self.layer_names[m.group(2)]}.{m.group(3)}"
        raise PosttrainError(f"native parameter '{native}' has no {self.family} HF name; "
                             "merge adapters and use an LMHead before exporting")

    def to_native(self, hf: str) -> str | None:
        """HF checkpoint key -> native name; None for keys that carry no weights we use."""
        if hf in self._top_to_native:
            return self._top_to_native[hf]
        if hf.endswith(self.ignored_hf_suffixes):
            return None
        m = _HF_LAYER.match(hf)
        if m and m.group(2) in self._to_native:
            return f"layers.{m.group(1)}.{self._to_native[m.group(2)]}.{m.group(3)}"
        raise PosttrainError(f"checkpoint key '{hf}' is not part of a {self.family} model "
                             f"({', '.join(self.model_types)}); is config.json's model_type right?")

    def _only_native(self, hf: str) -> str | None:
        """`to_native` for a bridge that maps every key through `native_names`: its one name
        (None for passthrough keys); a fused key has no single native name."""
        natives = self.native_names(hf)
        if len(natives) > 1:
            raise PosttrainError(f"'{hf}' holds several native parameters: {natives}")
        return natives[0] if natives else None

    def hf_names(self, native: str, args: ModelArgs) -> list[str]:
        """HF keys that hold native parameter `native`: one, or for a parameter stacked along
        dim 0 (MoE experts) one key per slice, in slice order."""
        return [self.to_hf(native)]

    def stack_index(self, hf: str) -> int | None:
        """For an HF key that is one slice of a stacked native parameter (`to_native(hf)`),
        its index along dim 0; None for keys that map one to one."""
        return None

    # ---- HF tensors in another layout --------------------------------------------------------
    def native_names(self, hf: str) -> list[str]:
        """The native parameters HF key `hf` holds, in `to_native_tensors` order: `to_native(hf)`
        by default, none for keys that carry no weights we use, several for a fused tensor."""
        native = self.to_native(hf)
        return [] if native is None else [native]

    def to_native_tensors(self, hf: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """HF tensor `hf` as the native (name, tensor) pairs it holds; unchanged by default."""
        (native,) = self.native_names(hf)
        return [(native, tensor)]

    def to_hf_tensor(self, hf: str, natives: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reverse of `to_native_tensors`: HF tensor `hf` from all of `native_names(hf)`."""
        (tensor,) = natives.values()
        return tensor

    # ---- configs -------------------------------------------------------------------------
    def args_from_hf(self, config: dict[str, Any], *, vocab_multiple: int = 64) -> ModelArgs:
        raise NotImplementedError

    def config_from_args(self, args: ModelArgs) -> dict[str, Any]:
        """A config.json for args that did not come from one (models built from scratch)."""
        return {
            "model_type": self.model_types[0],
            "architectures": [self.architecture],
            "vocab_size": args.vocab_size,
            "hidden_size": args.hidden_size,
            "intermediate_size": args.intermediate_size,
            "num_hidden_layers": args.num_layers,
            "num_attention_heads": args.num_heads,
            "num_key_value_heads": args.num_kv_heads,
            "head_dim": args.head_dim,
            "rms_norm_eps": args.rms_norm_eps,
            "max_position_embeddings": args.max_position_embeddings,
            "tie_word_embeddings": args.tie_word_embeddings,
            "attention_bias": args.attention_bias,
            "rope_parameters": {**(args.rope_scaling or {"rope_type": "default"}),
                                "rope_theta": args.rope_theta},
        }

    def hf_config(self, args: ModelArgs) -> dict[str, Any]:
        """config.json for `args`: the original one (or one made from the args) with the
        (possibly resized) real vocab."""
        cfg = dict(args.hf_config) if args.hf_config else self.config_from_args(args)
        cfg.pop("quantization_config", None)      # weights are written dequantized
        cfg["vocab_size"] = args.vocab_size
        cfg["tie_word_embeddings"] = args.tie_word_embeddings
        if not cfg.get("architectures"):
            cfg["architectures"] = [self.architecture]
        return cfg


def parse_hf_config(config: dict[str, Any]) -> Any:
    """The transformers config object for a config.json dict (normalises rope spellings)."""
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"config.json has model_type '{model_type}', unknown to transformers")
    return CONFIG_MAPPING[model_type].from_dict(dict(config))


def common_fields(cfg: Any, *, vocab_multiple: int) -> dict[str, Any]:
    """ModelArgs fields every family reads the same way from a transformers config; refuses
    quantized checkpoints other than MXFP4 (which `hf_io` dequantizes on load)."""
    quant = getattr(cfg, "quantization_config", None) or {}
    method = (quant.get("quant_method") if isinstance(quant, dict)
              else getattr(quant, "quant_method", None))
    if quant and method != "mxfp4":
        raise ConfigError(f"config.json: quantization_config.quant_method {method!r} is not "
                          "supported by the native models (only 'mxfp4' is dequantized on "
                          "load); dequantize the checkpoint to bf16 first, or use the "
                          "transformers fallback")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        # MoE-only configs (Qwen3.5-MoE) have no dense MLP width
        intermediate_size=int(cfg.to_dict().get("intermediate_size") or 0),
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        vocab_multiple=vocab_multiple,
    )


def split_rope(params: dict[str, Any] | None, *, where: str) -> tuple[float, dict[str, Any] | None]:
    """HF rope_parameters -> (theta, scaling dict without theta, or None for plain RoPE)."""
    if not params or params.get("rope_theta") is None:
        raise ConfigError(f"{where}: no rope_theta in the config's rope parameters")
    if (params.get("partial_rotary_factor", 1.0) != 1.0
            and params.get("rope_type") != "proportional"):
        # (proportional RoPE, Gemma 4, takes it as a parameter of its frequencies)
        raise ConfigError(f"{where}: partial_rotary_factor is not supported by native models")
    theta = float(params["rope_theta"])
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def sliding_fields(cfg: Any) -> dict[str, Any]:
    """sliding_window / layer_types, set only when some layer uses a window."""
    layer_types = tuple(getattr(cfg, "layer_types", None) or ())
    window = getattr(cfg, "sliding_window", None)
    if window is None or "sliding_attention" not in layer_types:
        return {}
    return {"sliding_window": int(window), "layer_types": layer_types}


@dataclass(frozen=True)
class MultimodalLayout:
    """Where a multimodal checkpoint keeps its text model: the prefix that stands for the text
    model's `model.` and the LM head's key. transformers 5 writes Qwen3.5's as
    `model.language_model.*` + `lm_head.weight`; Gemma 3's in the original release layout,
    `language_model.model.*` + `language_model.lm_head.weight`."""

    architecture: str
    text_prefix: str = "model.language_model."
    head: str = "lm_head.weight"
    # transformers' Gemma3ForConditionalGeneration does not apply the text config's
    # final_logit_softcapping (its text-only class does); the native model follows the class
    # that loads the checkpoint
    applies_final_softcap: bool = True


class MultimodalBridge(FamilyBridge):
    """A text family's bridge over a multimodal checkpoint (`Qwen3_5ForConditionalGeneration`,
    `Gemma3ForConditionalGeneration`, `Gemma4ForConditionalGeneration`): the text model lives
    under the layout's prefix, and everything else (vision and audio towers, projector,
    multi-token prediction layers) is passthrough:
    never loaded into the native model, copied unchanged from the source checkpoint on export
    (`hf_io.save_hf`), so the export loads as the same multimodal class. config.json keeps its
    shape; the text model's settings are its `text_config`.
    """

    def __init__(self, inner: FamilyBridge, model_type: str,
                 config: dict[str, Any] | None = None) -> None:
        if config is not None:
            inner = inner.bind(self.text_config(config, inner))
        self.inner = inner
        self.family = inner.family
        self.model_types = (model_type,)
        self.layout = inner.multimodal_types[model_type]
        self.architecture = self.layout.architecture
        self.layer_names = inner.layer_names
        super().__init__()

    def _text(self, hf: str) -> str | None:
        """Multimodal key -> the text-only checkpoint's key (None: passthrough)."""
        if hf.startswith(self.layout.text_prefix):
            return "model." + hf[len(self.layout.text_prefix):]
        return TOP_NAMES["head.weight"] if hf == self.layout.head else None

    def _outer(self, hf: str) -> str:
        if hf == TOP_NAMES["head.weight"]:
            return self.layout.head
        return self.layout.text_prefix + hf[len("model."):] if hf.startswith("model.") else hf

    def is_passthrough(self, hf: str) -> bool:
        return self._text(hf) is None

    def to_hf(self, native: str) -> str:
        return self._outer(self.inner.to_hf(native))

    def to_native(self, hf: str) -> str | None:
        text = self._text(hf)
        return None if text is None else self.inner.to_native(text)

    def hf_names(self, native: str, args: ModelArgs) -> list[str]:
        return [self._outer(n) for n in self.inner.hf_names(native, args)]

    def stack_index(self, hf: str) -> int | None:
        text = self._text(hf)
        return None if text is None else self.inner.stack_index(text)

    def native_names(self, hf: str) -> list[str]:
        text = self._text(hf)
        return [] if text is None else self.inner.native_names(text)

    def to_native_tensors(self, hf: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return self.inner.to_native_tensors(self._text(hf) or hf, tensor)

    def to_hf_tensor(self, hf: str, natives: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.inner.to_hf_tensor(self._text(hf) or hf, natives)

    @staticmethod
    def text_config(config: dict[str, Any], inner: FamilyBridge) -> dict[str, Any]:
        """The text model's config.json dict inside a multimodal one."""
        text = dict(config.get("text_config") or {})
        if not text:
            raise ConfigError(f"config.json (model_type '{config.get('model_type')}') has no "
                              "text_config; is it a multimodal checkpoint?")
        text.setdefault("model_type", inner.model_types[0])
        if "tie_word_embeddings" in config:    # the multimodal model ties by its own flag
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        return text

    def args_from_hf(self, config: dict[str, Any], *, vocab_multiple: int = 64) -> ModelArgs:
        args = self.inner.args_from_hf(self.text_config(config, self.inner),
                                       vocab_multiple=vocab_multiple)
        if args.final_logit_softcapping is not None and not self.layout.applies_final_softcap:
            warnings.warn(f"{self.architecture} does not apply text_config."
                          f"final_logit_softcapping ({args.final_logit_softcapping}); neither "
                          "does the native model trained from it")
            args = args.replace(final_logit_softcapping=None)
        return args.replace(hf_config=dict(config))

    def config_from_args(self, args: ModelArgs) -> dict[str, Any]:
        raise PosttrainError("a multimodal checkpoint's config.json comes from the checkpoint; "
                             "models built from args alone are text-only")

    def hf_config(self, args: ModelArgs) -> dict[str, Any]:
        cfg = dict(args.hf_config)
        text = dict(cfg["text_config"])
        text["vocab_size"] = args.vocab_size
        cfg["text_config"] = text
        cfg.pop("quantization_config", None)
        if "vocab_size" in cfg:
            cfg["vocab_size"] = args.vocab_size
        cfg["tie_word_embeddings"] = args.tie_word_embeddings
        if not cfg.get("architectures"):
            cfg["architectures"] = [self.architecture]
        return cfg
