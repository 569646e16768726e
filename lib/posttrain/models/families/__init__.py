"""Family bridges between Hugging Face checkpoints and the native models, by `model_type`."""

from __future__ import annotations

from typing import Any

from posttrain.errors import ConfigError
from posttrain.models.families.base import FamilyBridge
from posttrain.models.families.gemma3 import Gemma3Bridge
from posttrain.models.families.gpt_oss import GptOssBridge
from posttrain.models.families.llama import LlamaBridge
from posttrain.models.families.qwen3 import Qwen3Bridge
from posttrain.models.families.qwen3_moe import Qwen3MoeBridge

BRIDGES: dict[str, FamilyBridge] = {b.family: b for b in (Qwen3Bridge(), LlamaBridge(),
                                                          Gemma3Bridge(), Qwen3MoeBridge(),
                                                          GptOssBridge())}


def register_bridge(bridge: FamilyBridge) -> None:
    """Add a family (e.g. qwen3_moe) without editing this file."""
    BRIDGES[bridge.family] = bridge


def bridge_for_family(family: str) -> FamilyBridge:
    if family not in BRIDGES:
        raise ConfigError(f"unknown model family '{family}'; known: {sorted(BRIDGES)}")
    return BRIDGES[family]


def bridge_for_config(config: dict[str, Any]) -> FamilyBridge:
    """The bridge whose HF model_type matches config.json's."""
    model_type = config.get("model_type")
    for bridge in BRIDGES.values():
        if model_type in bridge.model_types:
            return bridge
    if model_type == "gemma3":
        return BRIDGES["gemma3"]   # its args_from_hf explains what is unsupported
    known = sorted(t for b in BRIDGES.values() for t in b.model_types)
    raise ConfigError(f"config.json model_type '{model_type}' has no native model; known: {known}")


__all__ = ["BRIDGES", "FamilyBridge", "bridge_for_config", "bridge_for_family",
           "register_bridge"]
