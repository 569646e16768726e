"""The SFT recipe: what it adds to the recipe kernel (perplexity); its config schema is
`posttrain.config.sft`.

Everything else (worker, data rule, steps, checkpoints, export) is the kernel's
(`posttrain.train.recipe`); the loss root is the engine's `CausalLMLoss`.
"""

from __future__ import annotations

import math

from posttrain.config.sft import EvalConfig, GenerateConfig, SFTConfig
from posttrain.train.recipe import Recipe

__all__ = ["EvalConfig", "GenerateConfig", "SFT", "SFTConfig"]


class SFT(Recipe):
    """Supervised fine-tuning: the kernel's defaults (causal-LM loss, mean over loss tokens),
    plus perplexity in the held-out metrics."""

    name = "sft"
    config_cls = SFTConfig

    def eval_metrics(self, sums: dict[str, float], units: int) -> dict[str, float]:
        out = super().eval_metrics(sums, units)
        out["eval_perplexity"] = math.exp(min(out["eval_loss"], 50.0))
        return out

    @staticmethod
    def postfix(m: dict) -> dict[str, str]:
        return {**Recipe.postfix(m), "lr": f"{m['lr']:.2e}"}

    @staticmethod
    def summary(result: dict) -> list[str]:
        ev = result.get("eval") or {}
        return Recipe.summary(result) + ([
            f"held-out loss {ev['eval_loss']:.4f} (perplexity {ev['eval_perplexity']:.2f}) "
            f"over {ev['eval_tokens']} tokens"] if ev else [])
