"""The GRPO flow through Metaflow's Runner API, chained to an SFT run by pathspec:

    SFTFlow (arithmetic chats, a few steps) -> GRPOFlow --sft-run SFTFlow/<id>:
    start (resolves the SFT run's export) -> prepare (prompts) -> grpo -> join -> evaluate
    (held-out reward and accuracy, trained vs the SFT checkpoint) -> end
"""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from .conftest import GRPO_FLOW, REPO, TINY_GRPO, get_card, ray_processes_under


def test_grpo_configs_pass_the_schema():
    sys.path.insert(0, str(REPO / "flows"))
    from _posttrain_flow import gpus_per_node, parse_config
    parse = parse_config("posttrain.train.grpo.GRPOConfig")
    for name in ("tiny", "qwen3_0p6b_1gpu", "qwen3_8b_2nodes"):
        resolved = parse((REPO / "configs" / "grpo" / f"{name}.yaml").read_text())
        assert resolved["data"]["format"] == "prompt"
    big = parse((REPO / "configs/grpo/qwen3_8b_2nodes.yaml").read_text())
    # 12 trainer GPUs + 4 engine GPUs over 2 nodes
    assert gpus_per_node(_Cfg(big)) == 8
    assert gpus_per_node(_Cfg(parse(TINY_GRPO.read_text()))) == 0


class _Cfg(dict):
    """The attribute access a Metaflow ConfigValue offers, over a plain dict."""

    def __getattr__(self, name):
        value = self[name]
        return _Cfg(value) if isinstance(value, dict) else value


def test_unknown_key_fails_in_the_parser():
    from metaflow.exception import MetaflowException
    sys.path.insert(0, str(REPO / "flows"))
    from _posttrain_flow import parse_config
    data = yaml.safe_load(TINY_GRPO.read_text())
    data["algorithm"]["clip_hihg"] = 0.3
    with pytest.raises(MetaflowException, match="clip_hihg"):
        parse_config("posttrain.train.grpo.GRPOConfig")(yaml.safe_dump(data))


@pytest.mark.slow
def test_sft_then_grpo_flow_chained_by_pathspec(arithmetic_chain):
    """The chain's GRPO run (tests/flows/conftest.py: SFT 20 steps, then GRPO 3 steps of 8
    prompts with a checkpoint every 2) started from the SFT run's export."""
    sandbox, sft, run = arithmetic_chain.sandbox, arithmetic_chain.sft, arithmetic_chain.grpo
    sft_pathspec, sft_hf = sft.pathspec, sft.data.hf_uri
    start, train, evaluate = run["start"].task, run["join"].task, run["evaluate"].task
    assert start.data.parent_run == sft_pathspec
    assert start.data.base_model_uri == sft_hf
    assert run["prepare"].task.data.manifest_summary["format"] == "prompt"
    result = train.data.train_result
    assert result["steps"] == 3
    assert result["max_sync_diff"] <= 1e-5
    assert result["baseline_eval"]["eval/num_prompts"] == 16
    table = {r["metric"]: r for r in evaluate.data.eval_table}
    assert {"accuracy", "reward_mean", "exact_match_number_mean"} <= set(table)
    acc = table["accuracy"]
    assert acc["delta"] == pytest.approx(acc["model"] - acc["baseline"], abs=1e-9)
    # the baseline is the SFT run's export: its accuracy is the grpo step's start eval
    assert acc["baseline"] == pytest.approx(result["baseline_eval"]["eval/accuracy"],
                                            abs=1e-4)
    prov = evaluate.data.eval_provenance
    assert prov["parent_run"] == sft_pathspec and prov["baseline_uri"] == sft_hf
    assert prov["content_hash"] == run["prepare"].task.data.content_hash
    titles = json.dumps(get_card(sandbox, GRPO_FLOW, f"{run.id}/grpo", "training"))
    for title in ("train reward", "held-out accuracy", "rollout tokens/s",
                  "weight sync check", "time per GRPO step"):
        assert title in titles, title
    tables = [c for c in get_card(sandbox, GRPO_FLOW, f"{run.id}/evaluate", "evaluation")
              if c["type"] == "table"]
    assert len(tables) == 2                         # start vs trained, completions
    assert not ray_processes_under(sandbox.ray_tmpdir)
