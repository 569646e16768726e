"""Eval suites: the schema fails naming the key; every task kind against values computed here
by other means (the prepared-shard held-out loss, Hugging Face log-probs, the full-recompute
greedy generator, the reward registry); a model compared with itself has every delta 0."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.config.loader import build
from posttrain.errors import ConfigError
from posttrain.eval.heldout import sequence_logps
from posttrain.eval.suites import GraderConfig, SuiteConfig, load_suite, run_suite
from posttrain.train.engine import ModelInitConfig, write_random_hf_model

from ..rl.test_native_engine import recompute_greedy

REPO = Path(__file__).resolve().parents[3]
TOKENIZER = str(REPO / "assets" / "tokenizer")
DATA = REPO / "assets" / "data"
# peaked logits (initializer_range 0.5): no near-ties in greedy decoding
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "tie_word_embeddings": True, "initializer_range": 0.5}


def _head(src: Path, dst: Path, n: int) -> str:
    dst.write_text("".join(src.read_text().splitlines(keepends=True)[:n]))
    return str(dst)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
    root = tmp_path_factory.mktemp("suites")
    vocab = ChatTokenizer(TokenizerConfig(path=TOKENIZER)).vocab_size
    models = [write_random_hf_model(ModelInitConfig("qwen3", dict(TINY), seed=s), vocab,
                                    root / f"model{s}", tokenizer_dir=TOKENIZER) for s in (0, 1)]
    return {"root": root, "model": models[0], "baseline": models[1],
            "chat": _head(DATA / "chat" / "eval.jsonl", root / "chat.jsonl", 12),
            "prefs": _head(DATA / "preference" / "eval.jsonl", root / "prefs.jsonl", 16),
            "prompts": _head(DATA / "arithmetic" / "eval.jsonl", root / "prompts.jsonl", 8)}


def _suite(*tasks: dict, **top) -> SuiteConfig:
    return build(SuiteConfig, {"tokenizer": {"path": TOKENIZER}, "tasks": list(tasks), **top},
                 where="suite")


# --------------------------------------------------------------------------- schema


@pytest.mark.parametrize("task, match", [
    ({"name": "a", "kind": "heldout_loss", "data": {"path": "x"}, "gradr": {}},
     r"suite\.tasks\[0\]\.gradr: unknown key \(did you mean 'grader'\?\)"),
    ({"name": "a", "kind": "heldout_loss", "data": {"path": "x"},
      "grader": {"kind": "exact_match"}}, r"tasks\[0\]: grader: applies to kind generation"),
    ({"name": "a", "kind": "generation", "data": {"path": "x"}}, r"tasks\[0\]: grader: required"),
    ({"name": "a", "kind": "generation", "data": {"path": "x"}, "grader": {"kind": "regex"}},
     r"tasks\[0\]\.grader: pattern: required"),
    ({"name": "a", "kind": "generation", "data": {"path": "x"},
      "grader": {"kind": "regex", "pattern": "(a)(b)"}}, r"grader: pattern: .* 2 capture"),
    ({"name": "a", "kind": "generation", "data": {"path": "x"},
      "grader": {"kind": "exact_match"}, "generation": {"samples_per_prompt": 4}},
     r"tasks\[0\]\.generation: samples_per_prompt > 1 needs temperature > 0"),
    ({"name": "a", "kind": "reward", "data": {"path": "x"}}, r"tasks\[0\]: rewards: list"),
    ({"name": "a", "kind": "reward", "data": {"path": "x"},
      "rewards": [{"name": "exact_match_number"}], "accuracy_reward": "format"},
     r"accuracy_reward: 'format' is not one of"),
    ({"name": "a", "kind": "reward", "data": {"path": "x"}, "rewards": [{"name": "nope"}]},
     r"unknown reward function 'nope'"),
    ({"name": "a", "kind": "preference", "data": {"path": "x"}, "beta": 0.0},
     r"tasks\[0\]: beta must be > 0"),
    ({"name": "a b", "kind": "preference", "data": {"path": "x"}}, r"tasks\[0\]: name:"),
    ({"name": "a", "kind": "generation", "data": {"path": "x", "shape": "text"},
      "grader": {"kind": "exact_match"}}, r"data.shape: 'text' is not a shape of format prompt"),
])
def test_schema_errors_name_the_key(task, match):
    with pytest.raises(ConfigError, match=match):
        _suite(task)


def test_suite_level_errors():
    task = {"name": "a", "kind": "heldout_loss", "data": {"path": "x"}}
    with pytest.raises(ConfigError, match=r"tasks: task names must be unique; \['a'\]"):
        _suite(task, task)
    with pytest.raises(ConfigError, match=r"suite\.dtyp: unknown key"):
        _suite(task, dtyp="float32")
    with pytest.raises(ConfigError, match="rollout.placement"):
        _suite(task, rollout={"placement": "separate"})


def test_bundled_suite_parses_and_covers_every_kind():
    cfg = load_suite(str(REPO / "configs" / "eval" / "tiny.yaml"))
    kinds = {t.kind for t in cfg.tasks}
    assert kinds == {"heldout_loss", "generation", "preference", "reward"}
    assert {t.grader.kind for t in cfg.tasks if t.grader} == {"exact_match_number", "regex"}


def test_tasks_read_any_shape_of_their_format(tmp_path):
    """A task reads rows as prepare does (`RowParser`): ShareGPT rows give the token columns of
    their messages twins."""
    from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
    from posttrain.eval.suites import _read_rows
    rows = [json.loads(x) for x in (DATA / "chat" / "eval.jsonl").read_text().splitlines()[:4]]
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    (tmp_path / "sharegpt.jsonl").write_text("".join(json.dumps({"conversations": [
        {"from": speaker[m["role"]], "value": m["content"]} for m in r["messages"]]}) + "\n"
        for r in rows))
    tokenizer = ChatTokenizer(TokenizerConfig(path=TOKENIZER))
    read = [_read_rows(_suite({"name": "a", "kind": "heldout_loss",
                               "data": {"path": str(path)}}).tasks[0], tokenizer)[0]
            for path in (tmp_path / "sharegpt.jsonl", DATA / "chat" / "eval.jsonl")]
    for (_, got), (_, want) in zip(*read):
        assert got["input_ids"].tolist() == want["input_ids"].tolist()
        assert got["loss_mask"].tolist() == want["loss_mask"].tolist()
    assert len(read[0]) == 4


@pytest.mark.parametrize("grader, answer, reference, expected", [
    ({"kind": "exact_match"}, "  Paris \n", "Paris", 1.0),
    ({"kind": "exact_match"}, "paris", "Paris", 0.0),
    ({"kind": "exact_match_number"}, "so 1,234. The answer is 1234.0", "1234", 1.0),
    ({"kind": "exact_match_number"}, "The answer is 12, not 13", "13", 0.0),
    ({"kind": "exact_match_number"}, "no number", "13", 0.0),
    # the capture group of the last match
    ({"kind": "regex", "pattern": r"answer is (-?\d+)"}, "answer is 3 ... answer is -4.",
     "-4", 1.0),
    ({"kind": "regex", "pattern": r"answer is (-?\d+)"}, "answer is -4 ... answer is 3",
     "-4", 0.0),
    ({"kind": "regex", "pattern": r"answer is (-?\d+)"}, "nothing", "-4", 0.0),
    # no group: the whole match
    ({"kind": "regex", "pattern": r"\d+ apples"}, "I have 3 apples", "3 apples", 1.0),
    # full_match: the whole stripped answer must match
    ({"kind": "regex", "pattern": r"(\d+)", "full_match": True}, " 42 \n", "42", 1.0),
    ({"kind": "regex", "pattern": r"(\d+)", "full_match": True}, "42 apples", "42", 0.0),
])
def test_graders(grader, answer, reference, expected):
    assert build(GraderConfig, grader).score(answer, reference) == expected


# --------------------------------------------------------------------------- task kinds


def test_heldout_loss_equals_the_prepared_shard_evaluator(env, tmp_path):
    from posttrain.config.recipes import DataConfig, OutputConfig, PrepareConfig
    from posttrain.data.loader import LoaderConfig, sources_from_manifest
    from posttrain.data.packing import PackingConfig
    from posttrain.data.sources import SourceConfig
    from posttrain.data.tokenizer import TokenizerConfig
    from posttrain.models.hf_io import load_hf
    from steps import prepare
    prepare.run(PrepareConfig(TokenizerConfig(path=TOKENIZER),
                              DataConfig(train=[SourceConfig(path=env["chat"], name="chat")],
                                         max_tokens_per_sample=512),
                              OutputConfig(dir=str(tmp_path / "prepared"))), show_progress=False)
    sources = sources_from_manifest(str(tmp_path / "prepared"), "train")
    result = run_suite(_suite({"name": "chat", "kind": "heldout_loss",
                               "data": {"path": env["chat"]}, "max_tokens_per_sample": 512},
                              max_tokens_per_forward=700),
                       env["model"], env["baseline"])
    task = result.tasks[0]
    assert task.num_samples == 12 and len(task.records) == 12
    for which in ("model", "baseline"):
        expected = _prepared_loss(load_hf(env[which]), sources,
                                  LoaderConfig(packing=PackingConfig(max_tokens_per_pack=512)))
        assert getattr(task, which)["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert getattr(task, which)["perplexity"] == pytest.approx(math.exp(expected["loss"]),
                                                                   rel=1e-4)
        assert sum(r[f"{which}_tokens"] for r in task.records) == expected["tokens"]
    assert task.delta["loss"] == task.model["loss"] - task.baseline["loss"]
    # per-record losses weighted by their tokens give the task's loss
    total = sum(r["model_loss"] * r["model_tokens"] for r in task.records)
    assert total / sum(r["model_tokens"] for r in task.records) == pytest.approx(
        task.model["loss"], rel=1e-6)


@torch.no_grad()
def _prepared_loss(model, sources, cfg) -> dict:
    """Token-mean cross-entropy over the prepared shards, packed as training packs them."""
    from posttrain.data.loader import TrainLoader
    from posttrain.losses.sft import sft_loss_sum
    total, tokens = 0.0, 0
    with TrainLoader(sources, cfg) as loader:
        for batch in loader:
            hidden = model(batch["input_ids"], batch["position_ids"], batch["document_lengths"])
            total += float(sft_loss_sum(hidden, model.head.weight, batch["labels"],
                                        real_vocab_size=model.head.real_vocab_size))
            tokens += batch["num_loss_tokens"]
    return {"loss": total / tokens, "tokens": tokens}


def _hf_response_logp(hf_model, enc) -> float:
    ids = torch.tensor([enc.input_ids])
    logp = torch.log_softmax(hf_model(ids).logits.float(), dim=-1)[0]
    return sum(float(logp[t - 1, enc.input_ids[t]]) for t in range(1, len(enc.input_ids))
               if enc.loss_mask[t])


def test_preference_accuracy_matches_hugging_face_log_probs(env):
    from transformers import AutoModelForCausalLM

    from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
    beta = 0.5
    result = run_suite(_suite({"name": "prefs", "kind": "preference",
                               "data": {"path": env["prefs"]}, "beta": beta},
                              max_tokens_per_forward=300),
                       env["model"], env["baseline"])
    task = result.tasks[0]
    tok = ChatTokenizer(TokenizerConfig(path=TOKENIZER))
    rows = [json.loads(line) for line in Path(env["prefs"]).read_text().splitlines()]
    logps = {}
    for which in ("model", "baseline"):
        hf = AutoModelForCausalLM.from_pretrained(env[which]).eval()
        with torch.no_grad():
            logps[which] = [[_hf_response_logp(hf, enc) for enc in tok.encode_preference(
                r["prompt"], r["chosen"], r["rejected"])] for r in rows]
    margins = [beta * ((mc - bc) - (mr - br))
               for (mc, mr), (bc, br) in zip(logps["model"], logps["baseline"])]
    n = len(rows)
    assert task.model["reward_accuracy"] == sum(m > 0 for m in margins) / n
    assert 0 < task.model["reward_accuracy"] < 1       # random models: a real mix
    assert task.model["reward_margin"] == pytest.approx(sum(margins) / n, rel=1e-4, abs=1e-5)
    for which in ("model", "baseline"):
        assert getattr(task, which)["logp_accuracy"] == sum(c > r for c, r in logps[which]) / n
    # the baseline against itself: every pair ties
    assert task.baseline["reward_accuracy"] == 0.0 and task.baseline["reward_margin"] == 0.0
    for rec, (mc, mr), m in zip(task.records, logps["model"], margins):
        assert rec["model_logp_chosen"] == pytest.approx(mc, rel=1e-5)
        assert rec["model_logp_rejected"] == pytest.approx(mr, rel=1e-5)
        assert rec["reward_margin"] == pytest.approx(m, rel=1e-3, abs=1e-4)


def _greedy_answers(hf_dir: str, path: str, max_new_tokens: int) -> list[str]:
    """Greedy answers by full recomputation (no KV cache, one sequence at a time), cut after
    the first stop token: the reference the engine's answers must equal."""
    from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
    from posttrain.models.hf_io import load_hf
    tok = ChatTokenizer(TokenizerConfig(path=TOKENIZER))
    model = load_hf(hf_dir).eval()
    stop = {tok.eos_token_id, tok.hf.convert_tokens_to_ids("<|im_end|>")}
    out = []
    for line in Path(path).read_text().splitlines():
        out.append(_greedy_text(model, tok, tok.encode_prompt(json.loads(line)["prompt"]),
                                max_new_tokens, stop))
    return out


def _greedy_text(model, tok, prompt: list[int], max_new_tokens: int, stop: set[int]) -> str:
    """`recompute_greedy`'s answer cut after its first stop token, decoded."""
    ids = recompute_greedy(model, prompt, max_new_tokens)
    ends = [i for i, t in enumerate(ids) if t in stop]
    return tok.hf.decode(ids[:ends[0] + 1] if ends else ids, skip_special_tokens=True)


def test_generation_grading_counts(env, tmp_path):
    """References made to equal the model's own greedy answers on the first k rows (and the
    baseline's on one other row): accuracy is exactly k / n, whatever the answers are."""
    answers = {w: _greedy_answers(env[w], env["prompts"], 12) for w in ("model", "baseline")}
    rows = [json.loads(line) for line in Path(env["prompts"]).read_text().splitlines()]
    k = 5
    for i, row in enumerate(rows):
        row["answer"] = (answers["model"][i].strip() if i < k else
                         answers["baseline"][i].strip() if i == k else "never said")
    data = tmp_path / "graded.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    generation = {"max_new_tokens": 12, "stop_tokens": ["<|im_end|>"]}
    result = run_suite(_suite(
        {"name": "exact", "kind": "generation", "data": {"path": str(data)},
         "grader": {"kind": "exact_match"}, "generation": generation},
        {"name": "regex", "kind": "generation", "data": {"path": str(data)},
         "grader": {"kind": "regex", "pattern": "(.+)", "full_match": True},
         "generation": generation},
        {"name": "first3", "kind": "generation", "data": {"path": str(data)}, "max_samples": 3,
         "grader": {"kind": "exact_match"}, "generation": generation}),
        env["model"], env["baseline"])
    n = len(rows)
    expected_baseline = sum(answers["baseline"][i].strip() == rows[i]["answer"]
                            for i in range(n)) / n
    assert expected_baseline >= 1 / n
    for task in result.tasks[:2]:
        assert task.model["accuracy"] == pytest.approx(k / n)
        assert task.baseline["accuracy"] == pytest.approx(expected_baseline)
        assert task.delta["accuracy"] == task.model["accuracy"] - task.baseline["accuracy"]
        assert [r["model_output"] for r in task.records] == answers["model"]
        assert [r["baseline_output"] for r in task.records] == answers["baseline"]
        assert [r["model_correct"] for r in task.records] == [1.0] * k + [0.0] * (n - k)
        assert [r["reference"] for r in task.records] == [r["answer"] for r in rows]
    first3 = result.tasks[2]
    assert first3.num_samples == 3 and first3.model["accuracy"] == 1.0


def test_reward_task_scores_with_the_registry(env):
    from posttrain.rl.builtin_rewards import exact_match_number, format_reward
    result = run_suite(_suite({
        "name": "reward", "kind": "reward", "data": {"path": env["prompts"]},
        "rewards": [{"name": "exact_match_number", "weight": 1.0},
                    {"name": "format", "weight": 0.5,
                     "params": {"pattern": r"\d", "full_match": False}}],
        "accuracy_reward": "exact_match_number",
        "generation": {"max_new_tokens": 10, "stop_tokens": ["<|im_end|>"]}}),
        env["model"], env["baseline"])
    task = result.tasks[0]
    answers = _greedy_answers(env["model"], env["prompts"], 10)
    refs = [json.loads(line)["answer"] for line in Path(env["prompts"]).read_text().splitlines()]
    em = exact_match_number(answers, [[]] * len(answers), {"answer": refs})
    fmt = format_reward(answers, [[]] * len(answers), {}, pattern=r"\d")
    assert [r["model_output"] for r in task.records] == answers
    assert [r["model_reward"] for r in task.records] == [a + 0.5 * b for a, b in zip(em, fmt)]
    assert task.model["exact_match_number_mean"] == task.model["accuracy"] == sum(em) / len(em)
    assert task.model["format_mean"] == sum(fmt) / len(fmt)
    assert task.model["reward_mean"] == pytest.approx(sum(em) / len(em) + 0.5 * sum(fmt) / len(fmt))
    assert set(task.model) == set(task.baseline) == set(task.delta)


def test_a_model_against_itself_has_zero_deltas(env):
    suite = load_suite(str(REPO / "configs" / "eval" / "tiny.yaml"), overrides={
        "tokenizer.path": TOKENIZER, "tasks": [
            {"name": "loss", "kind": "heldout_loss", "data": {"path": env["chat"]}},
            {"name": "gen", "kind": "generation", "data": {"path": env["prompts"]},
             "grader": {"kind": "exact_match_number"},
             "generation": {"max_new_tokens": 8, "temperature": 1.0,
                            "samples_per_prompt": 2, "seed": 3}},
            {"name": "prefs", "kind": "preference", "data": {"path": env["prefs"]}},
            {"name": "reward", "kind": "reward", "data": {"path": env["prompts"]},
             "rewards": [{"name": "exact_match_number"}, {"name": "format"}],
             "generation": {"max_new_tokens": 8, "temperature": 1.0, "seed": 1}}]})
    result = run_suite(suite, env["model"], env["model"])
    table = result.table()
    assert {r["task"] for r in table} == {"loss", "gen", "prefs", "reward"}
    for row in table:
        assert row["delta"] == 0.0 and row["model"] == row["baseline"], row
    for task in result.tasks:
        for rec in task.records:
            assert rec.get("model_output") == rec.get("baseline_output")
    json.dumps(result.to_dict())            # the published artifact is plain JSON


def test_heldout_samples_are_the_greedy_answers(env):
    """A held-out loss task's `samples`: the native engine's greedy answers to the chats' last
    assistant turns, equal to full recomputation cut after the first stop token."""
    from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
    from posttrain.models.hf_io import load_hf
    result = run_suite(_suite({"name": "loss", "kind": "heldout_loss",
                               "data": {"path": env["chat"]}, "samples": 3,
                               "generation": {"max_new_tokens": 10}}),
                       env["model"], env["baseline"])
    tok = ChatTokenizer(TokenizerConfig(path=TOKENIZER))
    stop = {tok.end_of_turn_token_id, tok.eos_token_id}
    chats = [json.loads(line)["messages"] for line in
             Path(env["chat"]).read_text().splitlines()[:3]]
    for which in ("model", "baseline"):
        model, expected = load_hf(env[which]).eval(), []
        for messages in chats:
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            expected.append(_greedy_text(model, tok, tok.encode_prompt(messages[:last]), 10,
                                         stop))
        got = [r[f"{which}_output"] for r in result.tasks[0].records[:3]]
        assert got == expected, which


def test_sequence_logps_do_not_depend_on_packing(env):
    from posttrain.models.hf_io import load_hf
    model = load_hf(env["model"])
    gen = torch.Generator().manual_seed(0)
    docs = [(torch.randint(0, 3000, (n,), generator=gen).tolist(), [0] * 3 + [1] * (n - 3))
            for n in (5, 40, 17, 64, 9)]
    one_per_row = sequence_logps(model, docs, max_tokens_per_forward=2)
    packed = sequence_logps(model, docs, max_tokens_per_forward=256)
    assert [n for _, n in packed] == [len(ids) - 3 for ids, _ in docs]
    for (a, na), (b, nb) in zip(one_per_row, packed):
        assert na == nb and a == pytest.approx(b, rel=1e-5)
