import json
import math
from fractions import Fraction
from pathlib import Path

import pytest

from posttrain.config import build, load_yaml
from posttrain.errors import ConfigError
from posttrain.rl import builtin_rewards, reward_registry, rewards
from posttrain.rl.builtin_rewards import extract_code
from posttrain.rl.rewards import RewardConfig, RewardSpec, combine, parse_number, register

ROOT = Path(__file__).resolve().parents[3]
P = [[{"role": "user", "content": "What is 23 + 58?"}]]


def call(name, completions, columns=None, **params):
    fn = rewards.get_reward(name)
    return fn(completions, P * len(completions), columns or {}, **params)


@pytest.fixture
def temp_reward():
    """Register test-only reward functions and remove them afterwards."""
    added = []

    def add(name, fn):
        register(name)(fn)
        added.append(name)
    yield add
    for name in added:
        reward_registry._REGISTRY.pop(name)


@pytest.mark.parametrize("text, expected", [
    ("The answer is -24.", -24),
    ("so 1,000 + 234 = 1,234", 1234),
    ("The answer is 81. Let me double check: 23 + 58 = 81, 3 digits", 81),
    ("  The answer is   42  ", 42),
    ("I think it's 7, no wait, 8", 8),
    ("x = −3", -3),
    ("The answer is 2.50.", Fraction(5, 2)),
    ("from 3-5 items", 5),
    ("no number here", None),
    ("", None),
])
def test_parse_number(text, expected):
    assert parse_number(text) == expected


def test_exact_match_number():
    completions = ["The answer is -24.", "= 1,234", "I don't know", "The answer is 81.", "80"]
    answers = ["-24", "1234", "5", 81, "81"]
    assert call("exact_match_number", completions, {"answer": answers}) == [1, 1, 0, 1, 0]


def test_exact_match_number_on_the_bundled_data_format():
    row = json.loads((ROOT / "assets/data/arithmetic/eval.jsonl").read_text().splitlines()[0])
    good = f"Let me add them. The answer is {row['answer']}."
    assert builtin_rewards.exact_match_number([good], [row["prompt"]], {"answer": [row["answer"]]}) == [1.0]


def test_numeric_closeness_gives_partial_credit():
    completions = ["The answer is -24.", "The answer is -22.", "so 30", "no number"]
    answers = ["-24", "-24", "26", "5"]
    assert call("numeric_closeness", completions, {"answer": answers}, scale=2.0) == \
        [1.0, 0.5, pytest.approx(1 / 3), 0.0]
    worked = "55 - 92 = -(92 - 55): 12 - 5 = 7, 9 - 5 - 1 = 3, so -37. The answer is -37."
    assert call("numeric_closeness", [worked], {"answer": ["-37"]}) == [1.0]
    with pytest.raises(ConfigError, match="scale must be > 0"):
        rewards.RewardSpec("numeric_closeness", params={"scale": 0})


def test_format_reward_default_and_custom():
    completions = ["Adding: The answer is 81.", "81", "The answer is 81. Then more text"]
    assert call("format", completions) == [1.0, 0.0, 0.0]
    assert call("format", completions, pattern=r"^\d+$", full_match=True) == [0.0, 1.0, 0.0]


def test_length_penalty_in_chars():
    out = call("length_penalty", ["x" * 5, "x" * 10, "x" * 30],
               target_length=10, penalty_per_unit=0.1, max_penalty=1.5)
    assert out[:2] == [0.0, 0.0] and out[2] == pytest.approx(-1.5)
    assert call("length_penalty", ["x" * 13], target_length=10, penalty_per_unit=0.1) \
        == [pytest.approx(-0.3)]


def test_length_penalty_in_tokens():
    tok_dir = str(ROOT / "assets/tokenizer")
    from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
    text = "The answer is 81. " * 20
    n_tokens = len(ChatTokenizer(TokenizerConfig(path=tok_dir)).encode_text(text))
    assert n_tokens != len(text)
    out = call("length_penalty", [text], target_length=10, penalty_per_unit=1.0, unit="tokens",
               tokenizer=tok_dir)
    assert out == [-(n_tokens - 10)]


def test_python_exec_runs_the_code_in_the_sandbox():
    completions = [
        "Here it is:\n```python\nprint(sum(range(5)))\n```",
        "```\nprint(11)\n```",
        "```python\nwhile True:\n    pass\n```",
        "```python\nimport socket\nsocket.create_connection(('1.1.1.1', 80))\nprint(10)\n```",
        "no code, just 10",
    ]
    out = call("python_exec", completions, {"expected_stdout": ["10", "12", "10", "10", "10"]},
               timeout_s=5.0, max_workers=2)  # room for a slow start under load
    assert out == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_extract_code_takes_the_last_block():
    assert extract_code("```py\na = 1\n```\ntext\n```python\nb = 2\n```") == "b = 2\n"
    assert extract_code("no block") is None


def test_weights_combine_and_metrics():
    specs = [RewardSpec("exact_match_number", weight=1.0), RewardSpec("format", weight=0.5)]
    out = combine(specs)(["The answer is 81.", "81", "The answer is 7."], P * 3,
                         {"answer": ["81", "81", "81"]})
    assert out.components == {"exact_match_number": [1, 1, 0], "format": [1, 0, 1]}
    assert out.total == [1.5, 1.0, 0.5]
    m = out.metrics()
    assert m["reward/total/mean"] == pytest.approx(1.0)
    assert m["reward/format/mean"] == pytest.approx(2 / 3)
    assert m["reward/format/std"] == pytest.approx(math.sqrt(2 / 9))
    assert m["reward/exact_match_number/failures"] == 0.0


def test_config_from_yaml(tmp_path):
    path = tmp_path / "rewards.yaml"
    path.write_text("functions:\n"
                    "  - {name: exact_match_number}\n"
                    "  - {name: length_penalty, weight: 0.5, params: {target_length: 100}}\n")
    cfg = build(RewardConfig, load_yaml(path), "rewards")
    assert [(s.name, s.weight) for s in cfg.functions] == [("exact_match_number", 1.0),
                                                           ("length_penalty", 0.5)]
    out = combine(cfg.functions)(["The answer is 3." + "x" * 200], P, {"answer": ["3"]})
    assert out.total == [pytest.approx(1.0 - 0.5 * 1e-3 * 116)]


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ConfigError, match="unknown reward function 'exact_mach'.*exact_match_number"
                       ".*format.*length_penalty.*python_exec.*reward_model"):
        build(RewardConfig, {"functions": [{"name": "exact_mach"}]}, "rewards")


@pytest.mark.parametrize("spec, match", [
    ({"name": "format", "params": {"patern": "x"}}, r"unknown params \['patern'\]"),
    ({"name": "length_penalty"}, r"required params \['target_length'\]"),
    ({"name": "format", "params": {"pattern": "("}}, "not a valid regex"),
    ({"name": "length_penalty", "params": {"target_length": 5, "unit": "tokens"}},
     "needs params.tokenizer"),
])
def test_bad_params_fail_at_config_time(spec, match):
    with pytest.raises(ConfigError, match=match):
        build(RewardConfig, {"functions": [spec]}, "rewards")


def test_duplicate_or_empty_config_is_an_error():
    with pytest.raises(ConfigError, match="more than once"):
        RewardConfig((RewardSpec("format"), RewardSpec("format")))
    with pytest.raises(ConfigError, match="at least one"):
        RewardConfig(())


def test_a_raising_reward_scores_zero_and_is_reported(temp_reward, caplog):
    def flaky(completions, prompts, columns):
        if any("bad" in c for c in completions):
            raise RuntimeError("cannot score 'bad'")
        return [1.0] * len(completions)

    def broken(completions, prompts, columns):
        raise KeyError("always")

    temp_reward("test_flaky", flaky)
    temp_reward("test_broken", broken)
    reward = combine([RewardSpec("test_flaky", weight=2.0), RewardSpec("test_broken"),
                      RewardSpec("format")])
    out = reward(["The answer is 1.", "bad", "The answer is 2."], P * 3)
    assert out.components["test_flaky"] == [1.0, 0.0, 1.0]  # only the failing sample zeroed
    assert out.components["test_broken"] == [0.0, 0.0, 0.0]
    assert out.components["format"] == [1.0, 0.0, 1.0]  # others still counted
    assert out.total == [3.0, 0.0, 3.0]
    assert out.failures["test_flaky"].count == 1
    assert "RuntimeError: cannot score 'bad'" in out.failures["test_flaky"].first_error
    assert out.failures["test_broken"].count == 3
    assert out.failures["format"].count == 0 and out.failures["format"].first_error is None
    assert out.metrics()["reward/test_broken/failures"] == 3.0
    assert "test_broken" in caplog.text


def test_wrong_length_or_nan_counts_as_a_failure(temp_reward):
    temp_reward("test_short", lambda completions, prompts, columns: [1.0])
    temp_reward("test_nan", lambda completions, prompts, columns: [math.nan] * len(completions))
    out = combine([RewardSpec("test_short"), RewardSpec("test_nan")])(["a", "b"], P * 2)
    assert out.total == [1.0, 1.0]  # test_short works one sample at a time
    assert out.failures["test_short"].count == 0
    assert out.failures["test_nan"].count == 2
    assert "non-finite" in out.failures["test_nan"].first_error


def test_sample_failures_score_zero_without_a_retry(temp_reward):
    """A batched reward marks the samples it could not score; it is called once, not once per
    sample, and only those samples get 0, counted with the first reason."""
    calls = []

    def judge(completions, prompts, columns):
        calls.append(len(completions))
        return [rewards.SampleFailure(f"no score in {c!r}") if "?" in c else 0.5
                for c in completions]

    temp_reward("test_judge", judge)
    out = combine([RewardSpec("test_judge")])(["a", "b?", "c", "d?"], P * 4)
    assert calls == [4]
    assert out.components["test_judge"] == [0.5, 0.0, 0.5, 0.0]
    assert out.failures["test_judge"] == rewards.RewardFailures(2, "no score in 'b?'")


def test_missing_column_is_reported_not_raised():
    out = combine([RewardSpec("exact_match_number")])(["The answer is 1."], P, {"solution": ["1"]})
    assert out.total == [0.0]
    assert "no column 'answer'" in out.failures["exact_match_number"].first_error


def test_mismatched_batch_is_a_caller_error():
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2"):
        combine([RewardSpec("format")])(["a", "b"], P * 2, {"answer": ["1"]})


def test_register_twice_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        register("format")(lambda completions, prompts, columns: [])


USER_REWARDS = '''
def graded(completions, prompts, columns):
    return [float(r == a) for r, a in zip(columns["rubric"], columns["answer"])]
graded.required_columns = ["rubric", "answer"]

def keyed(completions, prompts, columns, *, key="label"):
    return [0.0] * len(completions)
keyed.required_columns = lambda *, key, **params: [key]

def malformed(completions, prompts, columns):
    return [0.0] * len(completions)
malformed.required_columns = "answer"

def undeclared(completions, prompts, columns):
    return [0.0] * len(completions)
'''


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    """A user's reward module on the path; its registry entries are removed afterwards."""
    (tmp_path / "user_rewards_columns.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rewards_columns"
    for key in [k for k in reward_registry._REGISTRY if k.startswith("user_rewards_columns:")]:
        reward_registry._REGISTRY.pop(key)


def test_built_ins_declare_the_columns_they_read():
    assert RewardSpec("exact_match_number").required_columns == ("answer",)
    assert RewardSpec("numeric_closeness", params={"column": "sol"}).required_columns == ("sol",)
    assert RewardSpec("python_exec").required_columns == ("expected_stdout",)
    assert RewardSpec("format").required_columns == ()
    cfg = RewardConfig((RewardSpec("python_exec"), RewardSpec("exact_match_number"),
                        RewardSpec("numeric_closeness"), RewardSpec("format")))
    assert cfg.required_columns == ("answer", "expected_stdout")


def test_user_rewards_declare_columns_by_attribute(user_rewards):
    assert RewardSpec(f"{user_rewards}:graded").required_columns == ("rubric", "answer")
    assert RewardSpec(f"{user_rewards}:keyed").required_columns == ("label",)
    assert RewardSpec(f"{user_rewards}:keyed", params={"key": "y"}).required_columns == ("y",)
    assert RewardSpec(f"{user_rewards}:undeclared").required_columns == ()
    with pytest.raises(ConfigError, match="malformed.*required_columns must be a list of column "
                                          "names, got 'answer'"):
        RewardSpec(f"{user_rewards}:malformed")


def test_a_grpo_config_requires_the_columns_of_its_rewards(user_rewards):
    from posttrain.config.recipes import load_recipe
    from posttrain.train.grpo import GRPOConfig
    config = ROOT / "configs/grpo/tiny.yaml"
    assert load_recipe(config, GRPOConfig).data.required_columns == ["answer"]
    cfg = load_recipe(config, GRPOConfig, {
        "data.required_columns": ["id"],
        "rewards.functions": [{"name": "format"}, {"name": f"{user_rewards}:graded"}]})
    assert cfg.data.required_columns == ["answer", "id", "rubric"]
    assert cfg.data.format_config().required_columns == ("answer", "id", "rubric")
    only_format = {"rewards.functions": [{"name": "format"}]}
    assert load_recipe(config, GRPOConfig, only_format).data.required_columns == []
