"""run.trackers: MLflow (a local file store) and W&B (offline, the real `wandb` package).

One tiny SFT run (inline, 3 steps, a checkpoint after each) logs to both; its last checkpoint is
then removed, as if the machine had died right after step 3 was logged, and the run started
again: it continues from step 2, into the same tracker runs. Read back with each tracker's own
reader (MlflowClient; `wandb leet inspect --json` over the offline run files), every number of
metrics.jsonl is there at its step, with the resolved config as params/config and the lineage
as tags; a flow's evaluation results join the same runs. Without training: config errors name
the key, a missing package names the pip command, a tracker that cannot start stops the run,
and logging errors mid-run are warnings until the tracker is dropped.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config.loader import build
from posttrain.errors import ConfigError
from posttrain.lineage import SHORT, config_hash
from posttrain.train.sft import SFTConfig
from posttrain.train.trackers import (MAX_FAILURES, TrackerConfig, TrackerError, flatten,
                                      log_evaluation, open_trackers, suite_metrics)

ROOT = Path(__file__).resolve().parents[3]
STEPS = 3

CONFIG = {
    "run": {"num_workers": 1, "launcher": "inline"},
    "tokenizer": {"path": str(ROOT / "assets" / "tokenizer")},
    "data": {"format": "chat", "max_tokens_per_sample": 128, "on_bad_row": "skip"},
    "model": {"init": {"family": "qwen3", "seed": 0,
                       "overrides": {"hidden_size": 32, "intermediate_size": 64,
                                     "num_hidden_layers": 1, "num_attention_heads": 2,
                                     "num_key_value_heads": 1, "head_dim": 16,
                                     "tie_word_embeddings": True}},
              "dtype": "float32"},
    "train": {"max_steps": STEPS, "tokens_per_step": 256,
              "loader": {"packing": {"max_tokens_per_pack": 128, "buffer_samples": 8},
                         "rows_per_batch": 1, "shuffle_buffer_samples": 8, "seed": 0},
              "optimizer": {"lr": 0.003},
              "scheduler": {"kind": "constant", "warmup_steps": 0},
              "seed": 0, "checkpoint_every_steps": 1, "keep_checkpoints": 10},
    "eval": {"max_batches": 1, "generate": {"num_samples": 0}},
}


def _env(mp: pytest.MonkeyPatch) -> None:
    mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")    # MLflow 3 asks to opt in to file stores
    mp.setenv("WANDB_SILENT", "true")
    mp.setenv("WANDB_CONSOLE", "off")
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID",
                "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME"):
        mp.delenv(key, raising=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run, interrupted after step 3 was logged and continued from step 2."""
    from steps import train_sft
    tmp = tmp_path_factory.mktemp("trackers")
    for split, rows in (("train", 24), ("eval", 4)):
        lines = (ROOT / "assets" / "data" / "chat" / f"{split}.jsonl").read_text().splitlines()
        (tmp / f"{split}.jsonl").write_text("\n".join(lines[:rows]) + "\n")
    cfg = json.loads(json.dumps(CONFIG))
    cfg["run"]["dir"] = str(tmp / "run")
    cfg["run"]["trackers"] = [
        {"kind": "mlflow", "tracking_uri": f"file:{tmp / 'mlruns'}", "experiment": "tiny",
         "tags": {"team": "posttrain-tests"}},
        {"kind": "wandb", "project": "tiny", "mode": "offline", "dir": str(tmp / "wb"),
         "tags": {"team": "posttrain-tests"}}]
    cfg["data"]["train"] = [{"name": "chat", "path": str(tmp / "train.jsonl")}]
    cfg["data"]["eval"] = [{"name": "chat", "path": str(tmp / "eval.jsonl")}]
    with pytest.MonkeyPatch.context() as mp:
        _env(mp)
        first = train_sft.run(build(SFTConfig, cfg), show_progress=False)
        last = Path(first["run_dir"]) / "checkpoints" / f"step-{STEPS:08d}"
        shutil.rmtree(last)                              # died after logging step 3
        second = train_sft.run(build(SFTConfig, cfg), show_progress=False)
        table = [{"task": "chat", "metric": "loss", "model": 1.25, "baseline": 1.5,
                  "delta": -0.25}]                   # a flow's evaluate step's suite table
        evaluated = log_evaluation(build(SFTConfig, cfg).run.trackers, first["run_dir"],
                                   suite_metrics(table))
    records = [json.loads(x) for x in Path(second["metrics_path"]).read_text().splitlines()]
    return {"tmp": tmp, "first": first, "second": second, "records": records,
            "evaluated": evaluated}


def _expected(records: list[dict]) -> dict[tuple[int, str], float]:
    """(step, key) -> the number metrics.jsonl has (a later record of a step wins)."""
    return {(r["step"], k): v for r in records for k, v in r.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


@pytest.mark.slow
def test_resume_continues_the_same_tracker_runs(run):
    first, second = run["first"], run["second"]
    assert (first["started_at_step"], second["started_at_step"], second["steps"]) == (0, 2, 3)
    assert first["trackers"]["mlflow"]["run_id"] == second["trackers"]["mlflow"]["run_id"]
    assert first["trackers"]["wandb"]["run_id"] == second["trackers"]["wandb"]["run_id"]
    assert sorted(r["step"] for r in run["records"]) == [1, 2, 3, 3]    # 3: train, eval
    assert run["evaluated"] == {k: v["run_id"] for k, v in first["trackers"].items()}


@pytest.mark.slow
def test_mlflow_has_every_metric_the_config_and_the_lineage(run):
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"file:{run['tmp'] / 'mlruns'}")
    (exp,) = [e for e in client.search_experiments() if e.name == "tiny"]
    (found,) = client.search_runs([exp.experiment_id])
    assert found.info.run_id == run["second"]["trackers"]["mlflow"]["run_id"]
    assert found.info.status == "FINISHED"
    expected = _expected(run["records"])
    history = {k: [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, k)]
               for k in {k for _, k in expected}}
    for (step, key), value in expected.items():
        logged = [v for s, v in history[key] if s == step]
        assert logged[-1] == value, (step, key, logged, value)
    # step 3 was logged by the attempt that died and again by the one that continued; the
    # loss is the same (resume is bit-identical), steps 1-2 were not logged twice
    assert [s for s, _ in history["loss"]] == [1, 2, 3, 3]
    assert history["loss"][2][1] == history["loss"][3][1]
    assert [v for s, v in history["eval_loss"] if s == 3][-1] == expected[(3, "eval_loss")]
    for key, value in (("suite/chat/loss", 1.25), ("suite_baseline/chat/loss", 1.5),
                       ("suite_delta/chat/loss", -0.25)):
        assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, key)
                ] == [(3, value)]
    params = found.data.params
    assert params == flatten(run["second"]["config"])
    assert params["train.optimizer.lr"] == "0.003" and params["model.dtype"] == "float32"
    tags = found.data.tags
    manifest = json.loads((Path(run["second"]["prepared_dir"]) / "manifest.json").read_text())
    assert tags["posttrain.recipe"] == "sft"
    assert tags["posttrain.config_hash"] == config_hash(run["second"]["config"])
    assert tags["posttrain.dataset_hash"] == manifest["content_hash"]
    assert tags["posttrain.base_model"] == "random init (qwen3)"
    assert tags["posttrain.resumed_at_step"] == "2"
    assert tags["team"] == "posttrain-tests" and tags["mlflow.runName"] == "run"
    assert "posttrain.code" in tags


def _wandb_records(run_dir: Path) -> list[dict]:
    """The records of an offline run's transaction log, read by W&B's own reader."""
    out = subprocess.run([str(Path(sys.executable).with_name("wandb")), "leet", "inspect",
                          "--json", str(run_dir)], capture_output=True, text=True, timeout=60,
                         check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


@pytest.mark.slow
def test_wandb_offline_has_every_metric_the_config_and_the_lineage(run):
    run_id = run["second"]["trackers"]["wandb"]["run_id"]
    # one directory per attempt (and the evaluation's; in time order, a second one in the
    # same second gets "-1" appended), all of the one run id: `wandb sync` joins them
    sessions = sorted((run["tmp"] / "wb" / "wandb").glob("offline-run-*"))
    logs = [_wandb_records(d) for d in sessions]
    assert [r["run"]["run_id"] for records in logs for r in records
            if r["type"] == "run"] == [run_id] * 3
    got: dict[tuple[int, str], float] = {}
    steps = []
    for records in logs:
        rows = [r["history"]["item"] for r in records if r["type"] == "history"]
        steps.append([row["_step"] for row in rows])
        for row in rows:
            got.update({(row["_step"], k): v for k, v in row.items() if not k.startswith("_")})
    # the continued attempt logs steps 1-2 again from metrics.jsonl (a killed attempt's last
    # W&B records can be lost), then step 3; the evaluation logs at step 3
    assert steps == [[1, 2, 3], [1, 2, 3], [3]]
    expected = _expected(run["records"])
    assert {k: got[k] for k in expected} == expected
    assert (got[(3, "suite/chat/loss")], got[(3, "suite_delta/chat/loss")]) == (1.25, -0.25)
    (start,) = [r["run"] for r in logs[0] if r["type"] == "run"]
    config = run["second"]["config"]
    lineage = start["config"]["update"]["posttrain"]
    assert start["config"]["update"]["train"]["optimizer"]["lr"] == 0.003
    assert lineage["posttrain.config_hash"] == config_hash(config)
    assert start["tags"][:3] == ["recipe:sft", f"config:{config_hash(config)[:SHORT]}",
                                 f"dataset:{lineage['posttrain.dataset_hash'][:SHORT]}"]
    assert "team:posttrain-tests" in start["tags"] and start["project"] == "tiny"


# ---------------------------------------------------------------------------- no training
def test_config_errors_name_the_key():
    base = {**CONFIG, "data": {**CONFIG["data"], "train": [{"path": "train.jsonl"}]}}
    for trackers, message in (
            ([{"kind": "mlflow", "project": "p"}],
             "run.trackers[0]: project: applies to kind wandb, not mlflow"),
            ([{"kind": "wandb", "tracking_uri": "file:x"}],
             "run.trackers[0]: tracking_uri: applies to kind mlflow"),
            ([{"kind": "neptune"}], "run.trackers[0].kind"),
            ([{"kind": "wandb", "mode": "onlin"}], "run.trackers[0].mode"),
            ([{"kind": "wandb"}, {"kind": "wandb"}], "2 trackers of kind wandb"),
            ([{"kind": "mlflow", "experiment_name": "x"}], "did you mean 'experiment'")):
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            build(SFTConfig, {**base, "run": {"trackers": trackers}}, where="config")


def test_a_missing_package_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)         # import wandb -> ImportError
    with pytest.raises(TrackerError, match=r"run.trackers\[0\]: .*pip install wandb"):
        open_trackers((TrackerConfig(kind="wandb", mode="offline"),), state_dir=str(tmp_path),
                      run_dir=str(tmp_path), start_step=0, config={}, lineage={})


def test_a_tracker_that_cannot_start_stops_the_run(tmp_path, monkeypatch):
    import socket
    with socket.socket() as s:                              # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cfg = TrackerConfig(kind="mlflow", tracking_uri=f"http://127.0.0.1:{port}")
    with pytest.raises(TrackerError, match=r"run.trackers\[0\] \(mlflow\): could not start a "
                                           rf"run at http://127.0.0.1:{port}"):
        open_trackers((cfg,), state_dir=str(tmp_path), run_dir=str(tmp_path), start_step=0,
                      config={}, lineage={})
    # continuing from a checkpoint into a run the store does not have: say which and what to do
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    (tmp_path / "trackers.json").write_text(json.dumps({"mlflow": {"run_id": "0" * 32}}))
    with pytest.raises(TrackerError, match="continues from step 5.*delete trackers.json"):
        open_trackers((TrackerConfig(kind="mlflow", tracking_uri=f"file:{tmp_path / 'ml'}"),),
                      state_dir=str(tmp_path), run_dir=str(tmp_path), start_step=5,
                      config={}, lineage={})


def test_logging_errors_are_warnings_until_the_tracker_is_dropped(tmp_path, monkeypatch,
                                                                   caplog):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tmp_path / "ml"
    trackers = open_trackers((TrackerConfig(kind="mlflow", tracking_uri=f"file:{store}"),),
                             state_dir=str(tmp_path), run_dir=str(tmp_path), start_step=0,
                             config={"a": {"b": 1}}, lineage={"posttrain.recipe": "sft"})
    trackers.write({"step": 1, "loss": 2.0})
    shutil.rmtree(store)                                    # the store is gone mid-run
    with caplog.at_level(logging.WARNING, logger="posttrain.train.trackers"):
        for step in range(2, 2 + MAX_FAILURES + 1):
            trackers.write({"step": step, "loss": 1.0})     # never raises
    warnings = [r.getMessage() for r in caplog.records if "logging step" in r.getMessage()]
    assert len(warnings) == MAX_FAILURES
    assert "no more logging to mlflow" in warnings[-1] and trackers.trackers == []
    trackers.close()
    assert json.loads((tmp_path / "trackers.json").read_text())["step"] == 2 + MAX_FAILURES
