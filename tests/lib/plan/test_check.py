"""The start-of-run check: a plan that does not fit stops naming the part and the knobs;
run.plan_check warn / off launches anyway; the flows' start step raises it as a one-line
Metaflow error."""

from __future__ import annotations

import logging
import sys

import pytest

from posttrain.config.loader import build
from posttrain.plan import PlanError, check_run
from posttrain.train.sft import SFTConfig

from .conftest import ROOT, bundled, local_data, qwen3_0p6b_config_dir


@pytest.fixture(scope="module")
def too_big(tmp_path_factory) -> dict:
    """Full fine-tuning of Qwen3-0.6B on one L4 (22.5 GiB) with 4 x 4,096-token micro-batches
    and no activation checkpointing: activations alone need ~60 GiB."""
    qwen = qwen3_0p6b_config_dir(tmp_path_factory.mktemp("qwen"))
    cfg = local_data(bundled("sft/qwen3_0p6b_full_1gpu.yaml", **{
        "run.gpu": "l4", "train.parallel": {"mixed_precision": "bf16",
                                           "activation_checkpointing": "none"}}))
    cfg["model"]["hf_dir"] = str(qwen)
    return cfg


def test_a_plan_that_does_not_fit_names_the_part_and_the_knobs(too_big):
    with pytest.raises(PlanError) as e:
        check_run(build(SFTConfig, too_big, where="test"))
    text = str(e.value)
    assert "trainer rank: predicted peak" in text and "of l4" in text
    assert "activations:" in text
    for knob in ("parallel.activation_checkpointing: full", "max_tokens_per_pack",
                 "parallel.cp", "parallel.tp", "run.plan_check: warn or off"):
        assert knob in text


def test_the_same_plan_fits_with_the_knobs_it_names(too_big):
    fixed = {**too_big, "train": {**too_big["train"], "parallel": {
        "mixed_precision": "bf16", "activation_checkpointing": "full"}}}
    fixed["run"] = {**too_big["run"], "gpu": "h100-80g"}
    plan = check_run(build(SFTConfig, fixed, where="test"))
    assert plan is not None and plan.peak_bytes["trainer"] < 60 << 30


def test_plan_check_warn_and_off_launch_anyway(too_big, caplog):
    warn = {**too_big, "run": {**too_big["run"], "plan_check": "warn"}}
    with caplog.at_level(logging.WARNING):
        assert check_run(build(SFTConfig, warn, where="test")) is not None
    assert "does not fit" in caplog.text
    off = {**too_big, "run": {**too_big["run"], "plan_check": "off"}}
    assert check_run(build(SFTConfig, off, where="test")) is None


def test_unknown_gpu_kind_is_a_config_error_naming_the_key(too_big):
    from posttrain.errors import ConfigError
    bad = {**too_big, "run": {**too_big["run"], "gpu": "h900"}}
    with pytest.raises(ConfigError, match=r"run.gpu.*h900.*h100-80g"):
        build(SFTConfig, bad, where="test")


def test_the_flow_start_step_stops_with_the_plan(too_big):
    sys.path.insert(0, str(ROOT / "flows"))
    try:
        from _posttrain_flow import check_plan
        from metaflow.exception import MetaflowException
    finally:
        sys.path.remove(str(ROOT / "flows"))
    with pytest.raises(MetaflowException, match="nothing was run: the memory plan does not fit"):
        check_plan(too_big, "posttrain.train.sft.SFTConfig")
    # the bundled tiny CPU config fits this machine
    check_plan(bundled("sft/tiny.yaml"), "posttrain.train.sft.SFTConfig")


# each recipe flow's schema (its `SCHEMA`, which `RecipeFlow.start` checks the plan with)
FLOW_SCHEMAS = {"sft": "posttrain.config.sft.SFTConfig", "dpo": "posttrain.config.dpo.DPOConfig",
                "reward": "posttrain.config.reward.RewardConfig",
                "distill": "posttrain.config.distill.DistillConfig",
                "grpo": "posttrain.config.grpo.GRPOConfig",
                "sequence": "posttrain.config.sequence.SequenceConfig"}


def test_every_recipe_flow_start_step_plans_its_bundled_tiny_config():
    """What each recipe flow's start step runs on its bundled tiny CPU config: a plan is made
    (the base model is readable or built from `model.init`) and fits this machine. The flow
    tests run their start steps with `run.plan_check: off` (tests/flows/conftest.py), except
    the SFT flow's, which goes through the same `RecipeFlow.start`; here each recipe's check
    costs a quarter of a second instead of 3 s of a Metaflow task's imports and tracing.
    GRPO's tiny config starts from an SFT run's export, which the flow's start step cannot
    read yet; it is planned from that SFT config's random model instead."""
    from posttrain.plan import check_fits
    sys.path.insert(0, str(ROOT / "flows"))
    try:
        from _posttrain_flow import build_config, check_plan
    finally:
        sys.path.remove(str(ROOT / "flows"))
    for recipe, schema in FLOW_SCHEMAS.items():
        cfg = bundled(f"{recipe}/tiny.yaml")
        for flow_file in (ROOT / "flows").glob("*_flow.py"):
            if f"{recipe.upper()}_SCHEMA = \"{schema}\"" in flow_file.read_text():
                break
        else:
            raise AssertionError(f"no flow declares {recipe.upper()}_SCHEMA = {schema!r}")
        if recipe == "grpo":
            cfg["model"] = {"init": bundled("sft/arithmetic_tiny.yaml")["model"]["init"]}
        check_plan(cfg, schema)
        plan = check_run(build_config(schema, cfg))
        assert plan is not None and not check_fits(plan), recipe
        assert plan.peak_bytes["trainer"] > 0, recipe
