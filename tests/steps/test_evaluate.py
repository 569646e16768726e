"""The evaluation step as a user runs it: `python -m steps.evaluate` on the bundled
suite with two tiny random checkpoints, and `posttrain evaluate`'s one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from posttrain.train.engine import ModelInitConfig, write_random_hf_model

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "assets" / "tokenizer")
SUITE = ROOT / "configs" / "eval" / "tiny.yaml"
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
    root = tmp_path_factory.mktemp("ckpt")
    vocab = ChatTokenizer(TokenizerConfig(path=TOKENIZER)).vocab_size
    a, b = (write_random_hf_model(ModelInitConfig("qwen3", TINY, seed=s), vocab,
                                  root / f"m{s}", tokenizer_dir=TOKENIZER) for s in (0, 1))
    return a, b


def test_cli_runs_the_bundled_suite_and_writes_the_result(checkpoints, tmp_path):
    model, baseline = checkpoints
    out = tmp_path / "result" / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "steps.evaluate", "--suite", str(SUITE),
                           "--model", model, "--baseline", baseline, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    suite = yaml.safe_load(SUITE.read_text())
    names = [t["name"] for t in suite["tasks"]]
    assert list(result["tasks"]) == names
    assert result["model_dir"] == model and result["baseline_dir"] == baseline
    # the table is the tasks' metrics, in suite order, with delta = model - baseline
    assert [r["task"] for r in result["table"]] == [
        n for n in names for _ in result["tasks"][n]["model"]]
    for row in result["table"]:
        task = result["tasks"][row["task"]]
        assert row["model"] == task["model"][row["metric"]]
        assert row["baseline"] == task["baseline"][row["metric"]]
        assert row["delta"] == pytest.approx(row["model"] - row["baseline"], abs=1e-12)
    metrics = {(r["task"], r["metric"]) for r in result["table"]}
    assert {("chat_loss", "loss"), ("chat_loss", "perplexity"), ("arithmetic_answer", "accuracy"),
            ("arithmetic_format", "accuracy"), ("preference", "reward_accuracy"),
            ("preference", "logp_accuracy"), ("arithmetic_reward", "reward_mean"),
            ("arithmetic_reward", "accuracy")} <= metrics
    # per-sample records: one per evaluated row, both checkpoints' outputs side by side
    for task in suite["tasks"]:
        got = result["tasks"][task["name"]]
        assert len(got["records"]) == got["num_samples"] == task.get("max_samples",
                                                                     got["num_samples"])
    answer = result["tasks"]["arithmetic_answer"]["records"][0]
    assert {"prompt", "reference", "model_output", "baseline_output", "model_correct",
            "baseline_correct"} <= set(answer)
    assert result["tasks"]["preference"]["num_samples"] == 100
    # the printed table: a header and one line per row
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["task", "metric"])
    assert len([ln for ln in lines[header + 1:] if ln.split() and ln.split()[0] in names]) == \
        len(result["table"])


def test_posttrain_evaluate_reports_user_mistakes_in_one_line(checkpoints, tmp_path, capsys):
    from steps.cli import main
    model, _ = checkpoints
    assert main(["evaluate", "--suite", str(SUITE), "--model", model,
                 "--baseline", str(tmp_path / "missing")]) == 2
    assert "--baseline" in capsys.readouterr().err
    bad = yaml.safe_load(SUITE.read_text())
    bad["tasks"][0]["max_sampels"] = 3
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert main(["evaluate", "--suite", str(path), "--model", model, "--baseline", model]) == 2
    err = capsys.readouterr().err
    assert "tasks[0].max_sampels: unknown key (did you mean 'max_samples'?)" in err


def test_recipe_suites_run_from_the_recipe_config(checkpoints, tmp_path):
    """`posttrain evaluate --recipe R --config C`: the evaluation a recipe's flow runs, built
    from its config (SFT: held-out loss per eval source and greedy answers; distillation: KL
    to the teacher, which is 0 for the teacher itself)."""
    from steps import evaluate
    model, other = checkpoints
    sft = evaluate.run(evaluate.recipe_suite("sft", ROOT / "configs/sft/tiny.yaml",
                                             overrides={"eval.max_samples": 8}), model, other)
    chat = sft.tasks[0]
    assert chat.kind == "heldout_loss" and chat.num_samples == 8
    assert set(chat.model) == {"loss", "perplexity"} and chat.model != chat.baseline
    answered = [r for r in chat.records if "model_output" in r]
    assert len(answered) == 4 and all("baseline_output" in r for r in answered)  # generate: 4
    cfg = ROOT / "configs/distill/tiny.yaml"
    kl = evaluate.run(evaluate.recipe_suite("distill", cfg, {"teacher": other},
                                            overrides={"eval.max_samples": 6}), other, model)
    task = kl.tasks[0]
    assert task.model["kl_teacher_model"] == pytest.approx(0.0, abs=1e-6)
    assert task.baseline["kl_teacher_model"] > 0.01 and task.delta["kl_teacher_model"] < 0
    out = tmp_path / "eval.json"
    from steps.cli import main
    assert main(["evaluate", "--recipe", "distill", "--config", str(cfg), "--model", model,
                 "--teacher", model, "--out", str(out)]) == 0
    only = json.loads(out.read_text())
    assert only["baseline_dir"] is None
    assert all(r["baseline"] is None and r["delta"] is None for r in only["table"])


def test_a_suite_skips_bad_rows_when_told_and_counts_them(checkpoints, tmp_path):
    from posttrain.config.loader import build
    from posttrain.errors import DataError
    from posttrain.eval.suites import SuiteConfig, run_suite
    model, _ = checkpoints
    rows = (ROOT / "assets/data/chat/eval.jsonl").read_text().splitlines()[:5]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join([rows[0], "{not json", rows[1], '{"messages": 3}', *rows[2:]]))
    task = {"name": "chat", "kind": "heldout_loss", "data": {"path": str(data)}}
    suite = {"tokenizer": {"path": TOKENIZER}, "tasks": [task]}
    with pytest.raises(DataError, match="chat.jsonl"):
        run_suite(build(SuiteConfig, suite), model)
    skipping = build(SuiteConfig, {**suite, "tasks": [{**task, "on_bad_row": "skip"}]})
    result = run_suite(skipping, model).tasks[0]
    assert (result.num_samples, result.skipped_rows) == (5, 2)
