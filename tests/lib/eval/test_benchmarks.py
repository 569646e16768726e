"""Standard benchmark scoring: GSM8K extraction on a table of strings, pass@k against a
brute-force count over subsets, multiple-choice rows of every common shape, multiple-choice
accuracy against Hugging Face log-probs and an argmax by hand, GSM8K-graded sampling with
pass@k against answers scored here, and the recipes' `eval.tasks`."""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from itertools import combinations
from pathlib import Path

import pytest
import torch

from posttrain.config.loader import build
from posttrain.errors import ConfigError, DataError
from posttrain.eval.benchmarks import (ChoiceConfig, extract_gsm8k, gsm8k_number,
                                       parse_choice_row, pass_at_k, pass_at_k_metrics)
from posttrain.eval.suites import GraderConfig, SuiteConfig, load_suite, run_suite

REPO = Path(__file__).resolve().parents[3]
TOKENIZER = str(REPO / "assets" / "tokenizer")
SAMPLES = REPO / "assets" / "data" / "eval"
STANDARD = REPO / "configs" / "eval" / "standard_tiny.yaml"
ARITHMETIC_SFT = str(REPO / "tests" / "fixtures" / "arithmetic_sft")


# --------------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize("text, mode, expected", [
    ("3 + 4 = 7.\n#### 7", "auto", "7"),
    ("#### 1,234", "auto", "1234"),
    ("#### -5", "auto", "-5"),
    ("first #### 12 then #### 13", "auto", "12"),              # strict: the first marker
    ("The answer is $1,000.", "auto", "1000"),                 # no marker: the last number
    ("I think 12, no wait, 15", "auto", "15"),
    ("It costs 8 dollars.", "flexible", "8"),
    ("-3 degrees", "auto", "-3"),
    ("half is 7/2", "auto", "2"),                              # as lm-eval reads it
    ("####  7", "auto", "7"),                                  # no "#### N": flexible
    ("####  7", "strict", None),
    ("The answer is 42", "strict", None),
    ("#### 5 and later 9", "flexible", "9"),
    ("no numbers here", "auto", None),
    ("#### forty", "auto", None),
    ("costs $18 and 0.5 kg", "auto", "0.5"),
    ("versions 1.2.3", "auto", "1.2.3"),                        # kept, but not a number
])
def test_gsm8k_extraction(text, mode, expected):
    assert extract_gsm8k(text, mode) == expected


@pytest.mark.parametrize("text, number", [
    ("#### 3.50", Fraction(7, 2)), ("$1,000,000", Fraction(1000000)), ("is .5", Fraction(1, 2)),
    ("versions 1.2.3", None), ("nothing", None), ("so -12.", Fraction(-12)),
])
def test_gsm8k_number(text, number):
    assert gsm8k_number(text) == number


@pytest.mark.parametrize("grader, answer, reference, expected", [
    ({"kind": "gsm8k"}, "42 + 30 = 72.\n#### 72", "She has <<40+32=72>>72.\n#### 72", 1.0),
    ({"kind": "gsm8k"}, "So the total is 72.0 dollars.", "#### 72", 1.0),  # numbers, not text
    ({"kind": "gsm8k"}, "#### 70, then 72", "#### 72", 0.0),
    ({"kind": "gsm8k", "extract": "flexible"}, "#### 70, then 72", "#### 72", 1.0),
    ({"kind": "gsm8k", "extract": "strict"}, "The answer is 72", "72", 0.0),
    ({"kind": "gsm8k"}, "The answer is $1,250.", "1250", 1.0),
    ({"kind": "gsm8k"}, "no idea", "#### 3", 0.0),
])
def test_gsm8k_grader(grader, answer, reference, expected):
    assert build(GraderConfig, grader).score(answer, reference) == expected


def test_bundled_gsm8k_sample_references():
    rows = [json.loads(x) for x in (SAMPLES / "gsm8k_sample.jsonl").read_text().splitlines()]
    assert [gsm8k_number(r["answer"]) for r in rows] == [7, 252, 7, 960, Fraction(33, 4)]


# --------------------------------------------------------------------------- pass@k


def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_correct_sample():
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert abs(pass_at_k(n, c, k) - brute) <= 1e-12, (n, c, k)
    # a large n, where C(n, k) overflows floats: the product form stays exact enough
    assert pass_at_k(2000, 10, 1000) == pytest.approx(
        1 - math.comb(1990, 1000) / math.comb(2000, 1000), abs=1e-12)
    assert pass_at_k_metrics([0, 2, 4], 4, (1, 2)) == pytest.approx(
        {"pass@1": (0 + 0.5 + 1) / 3, "pass@2": (0 + 5 / 6 + 1) / 3}, abs=1e-12)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


# --------------------------------------------------------------------------- schema


def _suite(*tasks: dict) -> SuiteConfig:
    return build(SuiteConfig, {"tokenizer": {"path": TOKENIZER}, "tasks": list(tasks)},
                 where="suite")


GEN = {"name": "g", "kind": "generation", "data": {"path": "x"}, "grader": {"kind": "gsm8k"}}
MC = {"name": "m", "kind": "multiple_choice", "data": {"path": "x"}}


@pytest.mark.parametrize("task, match", [
    (dict(GEN, pass_at_k=[1, 4], generation={"temperature": 1.0, "samples_per_prompt": 2}),
     r"tasks\[0\]: pass_at_k: k=4 needs 1 <= k <= generation.samples_per_prompt \(n = 2"),
    (dict(GEN, pass_at_k=[1]), None),
    (dict(GEN, pass_at_k=[1, 1], generation={"temperature": 1.0, "samples_per_prompt": 2}),
     r"pass_at_k: \[1, 1\] lists a k twice"),
    (dict(MC, pass_at_k=[1]), r"tasks\[0\]: pass_at_k: applies to kind generation"),
    (dict(GEN, grader={"kind": "regex", "pattern": "x", "extract": "strict"}),
     r"grader: extract applies to kind gsm8k"),
    (dict(GEN, multiple_choice={}), r"multiple_choice: applies to kind multiple_choice"),
    (dict(MC, multiple_choice={"continuation": "letter"}),
     r"tasks\[0\]\.multiple_choice: continuation: letter .* \{choices\}"),
    (dict(MC, multiple_choice={"template": "Q: {q}"}), r"template: .* must contain \{question\}"),
    (dict(MC, multiple_choice={"choice_column": "x"}),
     r"multiple_choice\.choice_column: unknown key \(did you mean 'choices_column'\?\)"),
])
def test_schema_errors_name_the_key(task, match):
    if match is None:
        _suite(task)
        return
    with pytest.raises(ConfigError, match=match):
        _suite(task)


def test_bundled_standard_suite_parses():
    cfg = load_suite(str(STANDARD))
    assert [t.kind for t in cfg.tasks] == ["generation", "multiple_choice", "multiple_choice"]
    assert cfg.tasks[0].grader.kind == "gsm8k" and cfg.tasks[0].pass_at_k == (1, 4)


# --------------------------------------------------------------------------- row shapes


@pytest.mark.parametrize("row, gold, choices", [
    # MMLU: a list and a 0-based index, or a letter
    ({"question": "q", "choices": ["a", "b", "c"], "answer": 2}, 2, ["a", "b", "c"]),
    ({"question": "q", "choices": ["a", "b", "c"], "answer": "B"}, 1, ["a", "b", "c"]),
    # HellaSwag: ctx, endings, label as a string of digits
    ({"ctx": "q", "endings": ["a", "b", "c", "d"], "label": "3", "activity_label": "x"}, 3,
     ["a", "b", "c", "d"]),
    # ARC: {text, label} and answerKey among the labels (letters or digits)
    ({"question": "q", "choices": {"text": ["a", "b", "c"], "label": ["A", "B", "C"]},
      "answerKey": "C"}, 2, ["a", "b", "c"]),
    ({"question": "q", "choices": {"text": ["a", "b", "c"], "label": ["1", "2", "3"]},
      "answerKey": "1"}, 0, ["a", "b", "c"]),
])
def test_common_row_shapes(row, gold, choices):
    got = parse_choice_row(row, ChoiceConfig())
    assert (got.question, got.gold, got.choices) == ("q", gold, choices)
    assert got.continuations == [" " + c for c in choices]


def test_configured_columns_template_and_letters():
    cfg = ChoiceConfig(question_column="stem", choices_column="opts", answer_column="key",
                       prompt="chat", template="{question}\n{choices}\nAnswer:",
                       continuation="letter")
    got = parse_choice_row({"stem": "2+2?", "opts": ["3", "4"], "key": 1}, cfg)
    assert got.context == "2+2?\nA. 3\nB. 4\nAnswer:"
    assert (got.continuations, got.gold) == (["A", "B"], 1)     # chat: no delimiter


@pytest.mark.parametrize("row, match", [
    ({"question": "q", "choices": ["a", "b"], "answer": 2},
     r"f\.jsonl:7, field 'answer': 2 is option 2, but the row has 2 options"),
    ({"question": "q", "choices": ["a", "b"], "answer": "maybe"},
     r"field 'answer': 'maybe' is not an option's index, label or letter"),
    ({"question": "q", "choices": ["a"], "answer": 0}, r"field 'choices': must be a list of at"),
    ({"prompt": "q", "choices": ["a", "b"], "answer": 0},
     r"field 'question': no question column: the row has answer, choices, prompt, none of "
     r"question, ctx, query, context \(set multiple_choice.question_column\)"),
    ({"question": "q", "choices": {"text": ["a", "b"]}, "answer": 0},
     r"field 'choices': a mapping of options needs 'text' and 'label'"),
])
def test_bad_rows_name_file_line_and_field(row, match):
    with pytest.raises(DataError, match=match):
        parse_choice_row(row, ChoiceConfig(), file="f.jsonl", line=7)


# --------------------------------------------------------------------------- scoring


@pytest.fixture(scope="module")
def random_model(tmp_path_factory) -> str:
    from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
    from posttrain.train.engine import ModelInitConfig, write_random_hf_model
    vocab = ChatTokenizer(TokenizerConfig(path=TOKENIZER)).vocab_size
    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "tie_word_embeddings": True, "initializer_range": 0.5}
    return write_random_hf_model(ModelInitConfig("qwen3", tiny, seed=0), vocab,
                                 tmp_path_factory.mktemp("mc") / "model", tokenizer_dir=TOKENIZER)


def _hand_logp(hf_model, context_ids: list[int], option_ids: list[int]) -> float:
    ids = torch.tensor([context_ids + option_ids])
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(ids).logits.float(), dim=-1)[0]
    return sum(float(logp[t - 1, ids[0, t]]) for t in range(len(context_ids), ids.shape[1]))


def test_multiple_choice_accuracy_matches_an_argmax_by_hand(random_model):
    """The bundled sample through the bundled suite's two multiple-choice tasks (plain text
    with option texts, chat template with letters), against log-probs of the Hugging Face
    model on ids tokenized here, and an argmax written here."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    suite = load_suite(str(STANDARD))
    tasks = [t for t in suite.tasks if t.kind == "multiple_choice"]
    result = run_suite(SuiteConfig(tasks=tuple(tasks), tokenizer=suite.tokenizer,
                                   max_tokens_per_forward=256), random_model)
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    hf = AutoModelForCausalLM.from_pretrained(random_model).eval()
    rows = [json.loads(x) for x in (SAMPLES / "mc_sample.jsonl").read_text().splitlines()]

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids

    for task in result.tasks:
        chat = task.name == "mc_sample_letters"
        expected_logps, right, right_norm = [], 0, 0
        for row in rows:
            if chat:
                listing = "\n".join(f"{'ABCD'[i]}. {c}" for i, c in enumerate(row["choices"]))
                text = (f"{row['question']}\n{listing}\nAnswer with the letter of the correct "
                        "option.")
                context = encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                                         add_generation_prompt=True,
                                                         tokenize=False))
                options = list("ABCD")
                pairs = [(context, encode(o)) for o in options]
            else:
                text = f"Question: {row['question']}\nAnswer:"
                options = row["choices"]
                pairs = [(encode(text), encode(f"{text} {o}")[len(encode(text)):])
                         for o in options]
            lls = [_hand_logp(hf, c, o) for c, o in pairs]
            expected_logps.append(lls)
            best = max(range(len(lls)), key=lambda j: lls[j])
            best_norm = max(range(len(lls)), key=lambda j: lls[j] / len(options[j]))
            right += best == row["answer"]
            right_norm += best_norm == row["answer"]
        assert task.num_samples == len(rows) == 5
        for rec, lls in zip(task.records, expected_logps):
            assert rec["model_logps"] == pytest.approx(lls, rel=1e-5, abs=1e-5)
        assert task.model["accuracy"] == right / len(rows)
        assert task.model["accuracy_norm"] == right_norm / len(rows)
        assert [r["gold"] for r in task.records] == [r["answer"] for r in rows]
    plain = result.tasks[0]
    # the option texts differ in length: the normalization changes some choices here
    assert [r["model_choice"] for r in plain.records] != \
        [r["model_choice_norm"] for r in plain.records]


def _gsm8k_rows(path: Path, n: int) -> Path:
    """The first `n` arithmetic prompts in GSM8K's shape (a solution ending in "#### N")."""
    out = []
    for line in (REPO / "assets/data/arithmetic/eval.jsonl").read_text().splitlines()[:n]:
        row = json.loads(line)
        question = row["prompt"][0]["content"]
        expr = question.removeprefix("What is ").removesuffix("?")
        out.append({"question": question,
                    "answer": f"{expr} = <<{expr.replace(' ', '')}={row['answer']}>>"
                              f"{row['answer']}\n#### {row['answer']}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def test_gsm8k_sampling_pass_at_k_matches_answers_scored_by_hand(tmp_path):
    """The arithmetic SFT checkpoint samples 4 answers to each of 6 prompts; every answer is
    scored here (its last integer against the "#### N" of the row), and pass@k is the
    binomial formula over those counts."""
    n, rows = 4, 6
    data = _gsm8k_rows(tmp_path / "gsm8k.jsonl", rows)
    suite = build(SuiteConfig, {"tasks": [{     # the checkpoint's own tokenizer
        "name": "gsm8k", "kind": "generation", "data": {"path": str(data)},
        "columns": {"prompt": "question"}, "grader": {"kind": "gsm8k"},
        "generation": {"max_new_tokens": 48, "temperature": 1.0, "samples_per_prompt": n,
                       "seed": 0, "stop_tokens": ["<|im_end|>"]},
        "pass_at_k": [1, 2, 4]}]})
    task = run_suite(suite, ARITHMETIC_SFT).tasks[0]
    references = [int(json.loads(x)["answer"].split("#### ")[1])
                  for x in data.read_text().splitlines()]
    counts = []
    for rec, want in zip(task.records, references):
        assert len(rec["model_samples"]) == n and rec["model_output"] == rec["model_samples"][0]
        hits = [int(bool(re.findall(r"-?\d+", s)) and int(re.findall(r"-?\d+", s)[-1]) == want)
                for s in rec["model_samples"]]
        assert rec["model_correct"] == hits[0] and rec["model_num_correct"] == sum(hits)
        counts.append(sum(hits))
    assert 0 < sum(counts) < n * rows and len(set(counts)) > 1, counts   # a real mix
    assert task.model["accuracy"] == pytest.approx(sum(counts) / (n * rows), abs=1e-12)
    for k in (1, 2, 4):
        by_hand = sum(1 - math.comb(n - c, k) / math.comb(n, k) for c in counts) / rows
        assert task.model[f"pass@{k}"] == pytest.approx(by_hand, abs=1e-12)
    assert list(task.model)[:4] == ["accuracy", "pass@1", "pass@2", "pass@4"]


# --------------------------------------------------------------------------- recipes


def test_a_recipe_adds_tasks_to_its_evaluation():
    from steps.evaluate import recipe_suite
    mc = {"name": "mc", "kind": "multiple_choice",
          "data": {"path": str(SAMPLES / "mc_sample.jsonl")}}
    for recipe, config in (("sft", "configs/sft/arithmetic_tiny.yaml"),
                           ("grpo", "configs/grpo/tiny.yaml"), ("dpo", "configs/dpo/tiny.yaml")):
        suite = recipe_suite(recipe, str(REPO / config), overrides={"eval.tasks": [mc]})
        assert [t.name for t in suite.tasks][-1] == "mc" and len(suite.tasks) >= 2
        assert suite.tasks[-1].kind == "multiple_choice"
    with pytest.raises(ConfigError, match=r"eval\.tasks: task names \['arithmetic'\] repeat"):
        recipe_suite("sft", str(REPO / "configs/sft/arithmetic_tiny.yaml"),
                     overrides={"eval.tasks": [dict(mc, name="arithmetic")]})
    with pytest.raises(ConfigError, match=r"eval\.tasks run beside the held-out evaluation"):
        recipe_suite("sft", str(REPO / "configs/sft/arithmetic_tiny.yaml"),
                     overrides={"eval.tasks": [mc], "data.eval": []})
    from posttrain.train.sequence_rl import SequenceRLEvalConfig
    with pytest.raises(ConfigError, match="tasks: an event-sequence model has no evaluation"):
        build(SequenceRLEvalConfig, {"tasks": [mc]})
