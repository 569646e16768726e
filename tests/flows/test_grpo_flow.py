"""The GRPO flow through Metaflow's Runner API, chained to an SFT run by pathspec:

    SFTFlow (arithmetic chats, a few steps) -> GRPOFlow --sft-run SFTFlow/<id>:
    start (resolves the SFT run's export) -> prepare (prompts) -> grpo -> join -> evaluate
    (held-out reward and accuracy, trained vs the SFT checkpoint) -> end
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import GRPO_FLOW, REPO, TINY_GRPO, get_card, ray_processes_under


def test_grpo_configs_pass_the_schema():
    sys.path.insert(0, str(REPO / "flows"))
    from _flow_ray import gpus_per_node
    from _posttrain_flow import parse_config
    parse = parse_config("posttrain.train.grpo.GRPOConfig")
    for name in ("tiny", "qwen3_0p6b_1gpu", "qwen3_8b_2nodes"):
        resolved = parse((REPO / "configs" / "grpo" / f"{name}.yaml").read_text())
        assert resolved["data"]["format"] == "prompt"
    # PPO runs in this flow too: `--config config configs/ppo/tiny.yaml`
    ppo = parse((REPO / "configs/ppo/tiny.yaml").read_text())
    assert ppo["algorithm"]["advantage"] == "gae" and ppo["critic"]["lam"] == 0.95
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


def _small_grpo(box, name: str, **changes):
    """The tiny GRPO config, one short step, starting from `changes`' model."""
    return box.config(TINY_GRPO, name=name, **{
        "train.max_steps": 1, "train.prompts_per_step": 4, "train.samples_per_prompt": 4,
        "eval.max_prompts": 4, "eval.num_records": 2, **changes})


def _run_grpo(box, config, **params):
    from metaflow import Runner
    with Runner(str(GRPO_FLOW), cwd=str(REPO), env=box.env, show_output=False,
                config=[("config", str(config))], pylint=False) as runner:
        executing = runner.run(**params)
        return executing.run, executing.stdout


@pytest.mark.slow
def test_without_sft_run_the_flow_starts_from_the_newest_sft_run_of_its_base_config(
        arithmetic_chain, monkeypatch):
    """`python flows/grpo_flow.py run` as typed: the config's model.hf_dir is not on this disk,
    model.produced_by names the SFT config that makes it, and an SFTFlow run of that config
    (the chain's) is found through the Metaflow client by its `config:` tag."""
    box, sft = arithmetic_chain.sandbox, arithmetic_chain.sft
    monkeypatch.setenv("USER", box.env["USER"])
    config = _small_grpo(box, "grpo_found.yaml", **{
        "model.hf_dir": str(box.root / "not_here" / "hf"),
        "model.produced_by": str(arithmetic_chain.sft_config)})
    run, stdout = _run_grpo(box, config)
    assert run.successful, stdout[-3000:]
    start = run["start"].task
    assert start.data.parent_run == sft.pathspec
    assert start.data.base_model_uri == sft.data.hf_uri
    assert run["base"].task.data.base_recipe is None              # nothing trained
    assert f"newest successful SFTFlow run of {arithmetic_chain.sft_config}" in stdout
    assert run["end"].task.data.lineage["parents"] == [sft.pathspec]


@pytest.mark.slow
def test_without_any_sft_run_the_flow_trains_its_base_first(arithmetic_chain, monkeypatch):
    """No SFTFlow run of the base config exists (a config the chain did not run): the base step
    trains it, says so, and GRPO starts from that export."""
    box = arithmetic_chain.sandbox
    monkeypatch.setenv("USER", box.env["USER"])
    base = box.config(REPO / "configs/sft/arithmetic_tiny.yaml", name="sft_base.yaml", **{
        "train.max_steps": 3, "eval.max_batches": 1, "eval.generate.num_samples": 1})
    config = _small_grpo(box, "grpo_trains_base.yaml", **{
        "model.hf_dir": str(box.root / "not_here" / "hf"), "model.produced_by": str(base)})
    run, stdout = _run_grpo(box, config)
    assert run.successful, stdout[-3000:]
    assert "the base step trains it first" in stdout
    assert run["start"].task.data.parent_run is None
    trained = run["base"].task.data.base_model_uri
    assert trained.endswith("/base/train/hf") and (Path(trained) / "config.json").is_file()
    joined = run["join"].task.data
    assert joined.base_model_uri == trained and joined.train_result["steps"] == 1
    assert run["evaluate"].task.data.eval_provenance["baseline_uri"] == trained


def test_missing_inputs_stop_the_start_step_naming_them_and_what_makes_them():
    from metaflow.exception import MetaflowException
    sys.path.insert(0, str(REPO / "flows"))
    from _posttrain_flow import check_inputs
    data = yaml.safe_load(TINY_GRPO.read_text())
    check_inputs(data)                                     # the bundled files are there
    data["data"]["eval"][0]["path"] = "assets/data/gone/eval.jsonl"
    data["tokenizer"]["path"] = "no_such_tokenizer"
    with pytest.raises(MetaflowException) as e:
        check_inputs(data)
    assert "nothing was run" in str(e.value)
    assert "tokenizer.path: no_such_tokenizer not found" in str(e.value)
    assert ("data.eval[0].path: assets/data/gone/eval.jsonl not found (bundled data: `make "
            "assets` writes it)") in str(e.value)
    # a cluster's mounts and object stores are checked where they are read
    big = yaml.safe_load((REPO / "configs/grpo/qwen3_8b_2nodes.yaml").read_text())
    check_inputs(big)
