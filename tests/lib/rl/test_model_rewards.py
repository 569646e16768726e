"""Model-based rewards (`posttrain.rl.model_rewards`) on real tiny models built here.

- the batched reward-model scorer equals the one-sequence-per-forward scorer
  (`load_reward_model`) within 1e-5, in the callers' order, over several padded batches;
- the judge's score parser on a table of answers;
- a real judge (the committed arithmetic SFT checkpoint) scores a batch end to end, and its
  scores are the parse of that judge engine's own greedy answers to the same rubric prompts,
  rendered here independently; unparseable answers are counted failures;
- placement: ``actor`` scores on a Ray actor of its own (started by `open`, reused), equal to
  ``local``, and `close` kills it; a GRPO config with ``placement: actor`` needs
  ``run.launcher: ray``;
- bad params fail at config time naming the param; a missing model fails at `open` (the run's
  start), naming the config that makes it.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from posttrain.config import build
from posttrain.errors import ConfigError
from posttrain.rl import model_rewards
from posttrain.rl.model_rewards import RewardModelScorer, parse_score
from posttrain.rl.rewards import RewardConfig, RewardSpec, combine

ROOT = Path(__file__).resolve().parents[3]
JUDGE = ROOT / "tests" / "fixtures" / "arithmetic_sft"
PROMPTS = [[{"role": "user", "content": f"What is {i} + {3 * i}?"}] for i in range(9)]
COMPLETIONS = [f"{i} + {3 * i} = {4 * i}. The answer is {4 * i}." * (1 + i % 3)
               for i in range(9)]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> str:
    """A reward-model export (random body and head) in the reward recipe's format."""
    from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
    from posttrain.train.engine import ModelInitConfig, write_random_hf_model
    from posttrain.train.reward import _write_head
    out = tmp_path_factory.mktemp("rm") / "hf"
    vocab = ChatTokenizer(TokenizerConfig(path=str(ROOT / "assets/tokenizer"))).vocab_size
    write_random_hf_model(ModelInitConfig("qwen3", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "tie_word_embeddings": False}, seed=0), vocab, out,
        tokenizer_dir=str(ROOT / "assets/tokenizer"))
    torch.manual_seed(1)
    _write_head(out, {"weight": torch.randn(1, 64), "bias": torch.randn(1)}, 64)
    return str(out)


def test_batched_scores_equal_one_sequence_per_forward(rm_dir):
    from posttrain.models.reward_model import load_reward_model, reward_input_ids
    one = load_reward_model(rm_dir)
    expected = [one(p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    scorer = RewardModelScorer(rm_dir, batch_size=4, max_tokens=240)
    lengths = {i: len(reward_input_ids(scorer.tokenizer, p, c))
               for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS))}
    batches = scorer.batches(lengths)
    assert len(batches) >= 3 and sorted(i for b in batches for i in b) == list(range(9))
    for b in batches:                        # the limits, the longest sequence first
        assert len(b) <= 4 and (len(b) == 1 or len(b) * lengths[b[0]] <= 240)
        assert lengths[b[0]] == max(lengths[i] for i in b)
    got = scorer.score(PROMPTS, COMPLETIONS)
    assert max(abs(a - b) for a, b in zip(got, expected)) <= 1e-5
    assert len(set(expected)) == len(expected)     # distinct: the order is checked too


def test_reward_model_function_opens_once_and_closes(rm_dir):
    reward = combine([RewardSpec("reward_model", weight=2.0, params={"dir": rm_dir}),
                      RewardSpec("format", weight=0.1)])
    reward.open()
    (scorer,) = model_rewards._OPEN.values()
    first = reward(COMPLETIONS[:3], PROMPTS[:3])
    reward(COMPLETIONS[3:], PROMPTS[3:])
    assert list(model_rewards._OPEN.values()) == [scorer]        # loaded once
    direct = scorer.score(PROMPTS[:3], COMPLETIONS[:3])
    assert first.components["reward_model"] == direct
    assert first.total == [2 * r + 0.1 for r in direct]
    reward.close()
    assert model_rewards._OPEN == {}


def test_a_missing_model_fails_when_the_run_opens_its_rewards(tmp_path):
    """Not at config time (a flow compiles its config where the model is not), and not as a
    failure counted at every step: `open` raises, naming what makes the model."""
    spec = RewardSpec("reward_model", params={"dir": str(tmp_path / "hf"),
                                              "produced_by": "configs/reward/tiny.yaml"})
    with pytest.raises(FileNotFoundError, match=r"no reward_head.json.*posttrain "
                                                r"train-reward --config configs/reward/tiny"):
        combine([spec]).open()
    judge = RewardSpec("llm_judge", params={"dir": str(tmp_path), "rubric": "{completion}"})
    with pytest.raises(FileNotFoundError, match="not a Hugging Face checkpoint"):
        combine([judge]).open()
    assert model_rewards._OPEN == {}


@pytest.mark.parametrize("text, pattern, score_range, expected", [
    ("Score: 7", None, (0, 10), 0.7),
    ("Score: 3.5 ... on reflection, Score: 8", None, (0, 10), 0.8),   # the last one
    ("Score:-2", None, (-5, 5), 0.3),
    ("Score: 12", None, (0, 10), 1.0),                                  # clipped
    ("Score: 7", None, None, 7.0),                                      # no range: raw
    ("I would rate it highly.", None, (0, 10), None),
    ("score: 7", None, (0, 10), None),                                  # case matters
    ("[[4]] out of 5", r"\[\[(\d)\]\]", (1, 5), 0.75),
    ("The answer is 42.", r"answer is \d+", (0, 1), None),            # no group, not a number
    ("GOOD", r"GOOD|BAD", (0, 1), None),
])
def test_parse_score(text, pattern, score_range, expected):
    got = parse_score(text, pattern or model_rewards.DEFAULT_SCORE_PATTERN, score_range)
    assert got == (pytest.approx(expected) if expected is not None else None)


RUBRIC = "What is {completion} + {answer}?"
PATTERN = r"The answer is (-?\d+)"


def test_judge_scores_are_its_own_greedy_answers_parsed():
    """The plumbing, not the judge's taste: each score is the parse of the judge engine's
    greedy answer to the rubric rendered with that sample's completion and row."""
    from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
    from posttrain.rl.engine import SamplingConfig
    from posttrain.rl.factory import RolloutEngineConfig, load_engine
    completions, answers = ["3", "17", "40", "8"], ["5", "2", "11", "60"]
    params = {"dir": str(JUDGE), "rubric": RUBRIC, "score_pattern": PATTERN,
              "score_range": [0, 200], "max_new_tokens": 40}
    spec = RewardSpec("llm_judge", params=params)
    assert spec.required_columns == ("answer",)
    reward = combine([spec])
    out = reward(completions, PROMPTS[:4], {"answer": answers})
    reward.close()
    # the same judge, asked here
    tok = ChatTokenizer(TokenizerConfig(path=str(JUDGE)))
    engine = load_engine(RolloutEngineConfig(), str(JUDGE))
    ids = [tok.encode_prompt([{"role": "user", "content": f"What is {c} + {a}?"}])
           for c, a in zip(completions, answers)]
    stops = (tok.eos_token_id, tok.end_of_turn_token_id)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=40,
                              stop_token_ids=tuple(t for t in stops if t is not None))
    texts = [tok.hf.decode(g[0].completion_ids, skip_special_tokens=True)
             for g in engine.generate(ids, sampling, 1)]
    found = [re.findall(PATTERN, t) for t in texts]
    expected = [min(1.0, int(f[-1]) / 200) if f else 0.0 for f in found]
    print("judge answers:", texts)
    assert out.components["llm_judge"] == pytest.approx(expected, abs=1e-12)
    assert out.failures["llm_judge"].count == sum(not f for f in found)
    assert any(found), "the judge parsed nothing: the test proves nothing"


@pytest.mark.slow                         # starts a Ray cluster
def test_actor_placement_scores_as_local_and_close_kills_it(rm_dir):
    ray = pytest.importorskip("ray")
    local = RewardModelScorer(rm_dir).score(PROMPTS, COMPLETIONS)
    tmp = tempfile.mkdtemp(prefix="ptrm", dir="/tmp")     # short: Ray's socket paths
    ray.init(num_cpus=1, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
             configure_logging=False)
    try:
        reward = combine([RewardSpec("reward_model", params={"dir": rm_dir,
                                                              "placement": "actor"})])
        reward.open()                                   # the actor starts with the run
        (handle,) = model_rewards._OPEN.values()
        assert _actor_states() == ["ALIVE"]
        got = reward(COMPLETIONS, PROMPTS)
        reward(COMPLETIONS[:2], PROMPTS[:2])
        assert list(model_rewards._OPEN.values()) == [handle]          # one actor, reused
        assert got.failures["reward_model"].count == 0
        assert max(abs(a - b) for a, b in zip(got.components["reward_model"], local)) <= 1e-5
        reward.close()
        assert model_rewards._OPEN == {}
        assert _actor_states(until="DEAD") == ["DEAD"]
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _actor_states(until: str | None = None, wait_s: float = 30.0) -> list[str]:
    """The actors' states from the GCS table, polled until all are `until` (ray.kill is
    asynchronous)."""
    from ray._private import state
    deadline = time.monotonic() + wait_s
    while True:
        states = [a["State"] for a in state.actors().values()]
        if until is None or set(states) == {until} or time.monotonic() > deadline:
            return states
        time.sleep(0.2)


def test_actor_placement_needs_ray_in_a_grpo_config(rm_dir, tmp_path):
    import yaml

    from posttrain.config.recipes import load_recipe
    from posttrain.train.grpo import GRPOConfig
    cfg = yaml.safe_load((ROOT / "configs/grpo/tiny.yaml").read_text())
    cfg["model"]["hf_dir"] = str(JUDGE)
    cfg["rewards"]["functions"] = [{"name": "reward_model",
                                    "params": {"dir": rm_dir, "placement": "actor"}}]
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError,
                       match=r"rewards.functions\[reward_model\].params.placement.*run.launcher"):
        load_recipe(path, GRPOConfig)
    assert load_recipe(path, GRPOConfig, {"run.launcher": "ray"}).rewards.functions[0] \
        .params["placement"] == "actor"


@pytest.mark.parametrize("spec, match", [
    ({"name": "reward_model", "params": {"dir": "RM", "placement": "gpu"}},
     "params.placement 'gpu'"),
    ({"name": "reward_model", "params": {"dir": "RM", "num_gpus": 1}},
     "num_gpus.*placement: actor"),
    ({"name": "reward_model", "params": {"dir": "RM", "placement": "actor", "num_gpus": 1}},
     "set device: cuda"),
    ({"name": "reward_model", "params": {"dir": "RM", "batch_size": 0}}, "batch_size"),
    ({"name": "llm_judge", "params": {"dir": "JUDGE", "rubric": "Rate {prompt}"}},
     "no {completion}"),
    ({"name": "llm_judge", "params": {"dir": "JUDGE", "rubric": "{completion} {a.b}"}},
     "not plain names"),
    ({"name": "llm_judge", "params": {"dir": "JUDGE", "rubric": "{completion",}},
     "not a valid template"),
    ({"name": "llm_judge", "params": {"dir": "JUDGE", "rubric": "{completion}",
                                      "score_pattern": "("}}, "score_pattern.*regex"),
    ({"name": "llm_judge", "params": {"dir": "JUDGE", "rubric": "{completion}",
                                      "score_range": [5, 1]}}, "score_range"),
    ({"name": "llm_judge", "params": {"dir": "JUDGE", "rubric": "{completion}",
                                      "engine": {"kind": "tpu"}}}, "params.engine"),
    ({"name": "llm_judge", "params": {"dir": "JUDGE"}}, r"required params \['rubric'\]"),
])
def test_bad_params_fail_at_config_time(spec, match, rm_dir):
    params = {k: {"RM": rm_dir, "JUDGE": str(JUDGE)}.get(v, v) if isinstance(v, str) else v
              for k, v in spec["params"].items()}
    with pytest.raises(ConfigError, match=match):
        build(RewardConfig, {"functions": [{**spec, "params": params}]}, "rewards")
