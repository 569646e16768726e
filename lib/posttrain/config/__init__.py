"""Typed, frozen configuration built from YAML; unknown keys fail at load naming the key.

The whole schema lives here, so that reading and checking a config (``posttrain validate``, a
flow's launch) imports neither torch nor transformers: `loader` (YAML -> dataclasses),
`registry` (a config's kind -> its schema), the parts' slices (`data`, `parallel`, `model`,
`train`, `rl`, `eval`; each part still receives only its own), and one module per recipe
(`recipes`: prepare; `sft`, `dpo`, `reward`, `distill`, `sequence`, `grpo`, `sequence_rl`).
Slices defined in modules that are pure Python already stay there (`posttrain.rl.rewards`,
`posttrain.rl.dynamic`, `posttrain.train.trackers`, `posttrain.retrain`,
`posttrain.promotion`). The library's modules import their slice from here and re-export it,
so `from posttrain.train.grpo import GRPOConfig` still works (the same class).
`tests/lib/config/test_light_schema.py` checks that no heavy module is imported.
"""

from posttrain.config.loader import build, load_yaml, to_dict

__all__ = ["build", "load_yaml", "to_dict"]
