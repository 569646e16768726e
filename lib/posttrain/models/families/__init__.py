"""Family bridges between Hugging Face checkpoints and the native models, by `model_type`."""

from __future__ import annotations

from typing import Any

from posttrain.errors import ConfigError
from posttrain.models.args import ModelArgs
from posttrain.models.families.base import FamilyBridge, MultimodalBridge
from posttrain.models.families.deepseek_v3 import DeepseekV3Bridge
from posttrain.models.families.gemma3 import Gemma3Bridge
from posttrain.models.families.gemma4 import Gemma4Bridge
from posttrain.models.families.gpt_oss import GptOssBridge
from posttrain.models.families.llama import LlamaBridge
from posttrain.models.families.qwen3 import Qwen3Bridge
from posttrain.models.families.qwen3_5 import Qwen3_5Bridge, Qwen3_5MoeBridge
from posttrain.models.families.qwen3_moe import Qwen3MoeBridge

BRIDGES: dict[str, FamilyBridge] = {b.family: b for b in (Qwen3Bridge(), LlamaBridge(),
                                                          Gemma3Bridge(), Qwen3MoeBridge(),
                                                          GptOssBridge(), Qwen3_5Bridge(),
                                                          Qwen3_5MoeBridge(),
                                                          DeepseekV3Bridge(), Gemma4Bridge())}


def register_bridge(bridge: FamilyBridge) -> None:
    """Add a family (e.g. qwen3_moe) without editing this file."""
    BRIDGES[bridge.family] = bridge


def bridge_for_family(family: str) -> FamilyBridge:
    if family not in BRIDGES:
        raise ConfigError(f"unknown model family '{family}'; known: {sorted(BRIDGES)}")
    return BRIDGES[family]


def args_from_hf_config(config: dict[str, Any], *, vocab_multiple: int = 64) -> ModelArgs:
    """Args from a Hugging Face config.json dict, via the bridge of its `model_type`."""
    return bridge_for_config(config).args_from_hf(config, vocab_multiple=vocab_multiple)


def bridge_for_config(config: dict[str, Any]) -> FamilyBridge:
    """The bridge whose HF model_type matches config.json's; for a multimodal checkpoint whose
    text model is a native family, that family's bridge over the multimodal layout."""
    model_type = config.get("model_type")
    for bridge in BRIDGES.values():
        if model_type in bridge.model_types:
            return bridge.bind(config)
        if model_type in bridge.multimodal_types:
            return MultimodalBridge(bridge, model_type, config)
    known = sorted(t for b in BRIDGES.values() for t in b.model_types)
    raise ConfigError(f"config.json model_type '{model_type}' has no native model; known: {known}")


def bridge_for_args(args: ModelArgs) -> FamilyBridge:
    """The bridge for a model's checkpoint layout: the one its config.json names (a multimodal
    checkpoint's layout included), else its family's."""
    bridge = bridge_for_family(args.family)
    return bridge_for_config(args.hf_config if args.hf_config.get("model_type")
                             else bridge.config_from_args(args))


__all__ = ["BRIDGES", "FamilyBridge", "MultimodalBridge", "bridge_for_args",
           "bridge_for_config", "bridge_for_family", "register_bridge"]
