"""The command line: `--set KEY=VALUE` overrides (any config key, read as YAML) and what a
missing starting checkpoint is reported with."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config.recipes import load_recipe
from posttrain.errors import ConfigError
from posttrain.train.grpo import GRPOConfig
from steps.cli import build_parser
from steps.arguments import overrides_from

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/grpo/tiny.yaml"


def test_set_overrides_any_key_with_yaml_values():
    args = build_parser().parse_args([
        "train-grpo", "--config", str(CONFIG), "--launcher", "ray", "--max-steps", "3",
        "--set", "rollout.placement=separate", "--set", "rollout.max_staleness=1",
        "--set", "rollout.resources_per_engine={num_cpus: 1}", "--set", "sampling.top_p=0.9"])
    overrides = overrides_from(args)
    assert overrides == {"run.launcher": "ray", "train.max_steps": 3,
                         "rollout.placement": "separate", "rollout.max_staleness": 1,
                         "rollout.resources_per_engine": {"num_cpus": 1},
                         "sampling.top_p": 0.9}
    cfg = load_recipe(CONFIG, GRPOConfig, overrides)
    assert (cfg.rollout.max_staleness, cfg.rollout.placement) == (1, "separate")
    assert cfg.rollout.resources_per_engine == {"num_cpus": 1} and cfg.sampling.top_p == 0.9


@pytest.mark.parametrize("item, says", [("rollout.max_staleness", "KEY=VALUE"),
                                        ("=3", "KEY=VALUE"),
                                        ("sampling.top_p=[0.9", "not YAML")])
def test_a_malformed_set_is_refused_by_name(item, says):
    args = build_parser().parse_args(["train-grpo", "--config", str(CONFIG), "--set", item])
    with pytest.raises(ConfigError, match=says):
        overrides_from(args)


def test_staleness_without_separate_engines_is_refused_naming_the_keys():
    with pytest.raises(ConfigError, match="rollout.max_staleness.*rollout.placement: separate"):
        load_recipe(CONFIG, GRPOConfig, {"rollout.max_staleness": 1})


def test_a_missing_base_model_names_the_command_that_makes_it(tmp_path):
    from steps.common import check_base_model
    cfg = load_recipe(CONFIG, GRPOConfig, {"model.hf_dir": str(tmp_path / "sft" / "hf")})
    with pytest.raises(ConfigError, match=r"hf/config.json not found; it is the export of "
                       r"configs/sft/arithmetic_tiny.yaml: train it first with `posttrain "
                       r"train-sft --config configs/sft/arithmetic_tiny.yaml`"):
        check_base_model(cfg.model)
    bare = load_recipe(CONFIG, GRPOConfig, {"model.hf_dir": str(tmp_path / "x"),
                                            "model.produced_by": None})
    with pytest.raises(ConfigError, match="point model.hf_dir at a Hugging Face checkpoint"):
        check_base_model(bare.model)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text("{}")
    check_base_model(bare.model)                       # there: nothing to say
