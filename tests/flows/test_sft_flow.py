"""The SFT flow through Metaflow's Runner API: end to end, config validation, code package,
and the multi-node @metaflow_ray path against an S3 server (moto)."""

from __future__ import annotations

import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from .conftest import REPO, SFT_FLOW, get_card, ray_processes_under

SFT_CONFIGS = sorted((REPO / "configs" / "sft").glob("*.yaml"))
# A few optimizer steps of the tiny model, and a short evaluation.
QUICK = {"train.max_steps": 4, "train.checkpoint_every_steps": 2, "eval.max_batches": 4,
         "eval.generate": {"num_samples": 2, "max_new_tokens": 8}}


def _runner(sandbox, config: Path, **top_level):
    from metaflow import Runner
    return Runner(str(SFT_FLOW), cwd=str(REPO), env=sandbox.env, show_output=False,
                  config=[("config", str(config))], pylint=False, **top_level)


def _check_sft_run(run, *, steps: int):
    """What every successful SFT run must leave behind, read through the Metaflow client."""
    assert run.successful, run
    prepare, train, evaluate = run["prepare"].task, run["join"].task, run["evaluate"].task
    assert len(prepare.data.content_hash) == 64
    assert prepare.data.manifest_summary["totals"]["rows_written"] > 0
    assert prepare.data.shard_uris and all(u.startswith(prepare.data.prepared_uri)
                                           for u in prepare.data.shard_uris)
    assert train.data.train_result["steps"] == steps
    assert train.data.checkpoint_uri.startswith(run["start"].task.data.storage_root)
    # the SFT suite: held-out loss per eval source, against the starting checkpoint
    table = {(row["task"], row["metric"]): row for row in evaluate.data.eval_table}
    first = evaluate.data.eval_table[0]["task"]
    loss = table[first, "loss"]
    assert loss["model"] == evaluate.data.eval_loss > 0 and evaluate.data.eval_perplexity > 1
    assert loss["delta"] == pytest.approx(loss["model"] - loss["baseline"], abs=1e-9)
    assert loss["delta"] < 0                                      # training lowered it
    assert len(evaluate.data.samples) == 2                        # eval.generate.num_samples
    assert all(s["model_output"] is not None for s in evaluate.data.samples)
    assert evaluate.data.eval_provenance["content_hash"] == prepare.data.content_hash
    return train.data.hf_uri


def test_config_files_pass_the_schema():
    """Every bundled SFT config validates with the parser the flow uses at launch."""
    sys.path.insert(0, str(REPO / "flows"))
    from _posttrain_flow import parse_config
    parse = parse_config("posttrain.train.sft.SFTConfig")
    assert {p.name for p in SFT_CONFIGS} >= {
        "tiny.yaml", "qwen3_0p6b_full_1gpu.yaml", "qwen3_0p6b_lora_1gpu.yaml",
        "qwen3_8b_full_2nodes.yaml"}
    for path in SFT_CONFIGS:
        resolved = parse(path.read_text())
        assert resolved["run"]["num_nodes"] >= 1, path
    two = parse((REPO / "configs/sft/qwen3_8b_full_2nodes.yaml").read_text())
    assert two["run"]["num_nodes"] == 2 and two["run"]["resources_per_worker"] == {"GPU": 1}


@pytest.mark.parametrize("run, message", [
    ({"num_nodes": 0}, "run.num_nodes must be at least 1"),
    ({"num_nodes": 3, "num_workers": 2}, "run.num_nodes=3 is more than run.num_workers=2"),
    ({"num_nodes": 2, "num_workers": 1, "launcher": "inline"}, "needs run.launcher: ray"),
])
def test_impossible_node_counts_fail_in_the_parser(run, message):
    from metaflow.exception import MetaflowException
    sys.path.insert(0, str(REPO / "flows"))
    from _posttrain_flow import parse_config
    data = yaml.safe_load((REPO / "configs/sft/tiny.yaml").read_text())
    data["run"].update(run)
    with pytest.raises(MetaflowException, match=message):
        parse_config("posttrain.train.sft.SFTConfig")(yaml.safe_dump(data))


def test_unknown_config_key_fails_at_launch_naming_it(sandbox):
    config = sandbox.config(**{"train.optimizer.lrr": 0.1})
    proc = subprocess.run(
        [sys.executable, str(SFT_FLOW), "--no-pylint", "--config", "config", str(config), "run"],
        cwd=REPO, env={**_base_env(), **sandbox.env}, capture_output=True, text=True,
        timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "train.optimizer.lrr: unknown key" in out and "did you mean 'lr'" in out
    assert "Workflow starting" not in out            # no step ran, no run was created
    assert not (sandbox.root / "runs").exists()


def test_code_package_ships_lib_steps_configs(sandbox, tmp_path):
    """`package list` names them and the saved package holds them at repo-relative paths."""
    env = {**_base_env(), **sandbox.env}
    listed = subprocess.run([sys.executable, str(SFT_FLOW), "package", "list"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    for rel in ("lib/posttrain/train/sft.py", "lib/posttrain/config/loader.py",
                "steps/train_sft.py", "steps/prepare.py", "steps/evaluate.py",
                "configs/sft/tiny.yaml", "assets/tokenizer/tokenizer.json"):
        assert str(REPO / rel) in listed.stdout + listed.stderr, rel
    saved = subprocess.run([sys.executable, str(SFT_FLOW), "package", "save",
                            str(tmp_path / "pkg.tgz")], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert saved.returncode == 0, saved.stderr
    with tarfile.open(tmp_path / "pkg.tgz") as tar:
        names = set(tar.getnames())
    assert {"sft_flow.py", "_posttrain_flow.py", "lib/posttrain/train/sft.py",
            "steps/train_sft.py", "configs/sft/tiny.yaml",
            "configs/sft/qwen3_8b_full_2nodes.yaml"} <= names
    assert not any(".egg-info" in n or "__pycache__" in n for n in names)


@pytest.mark.slow
def test_sft_flow_end_to_end_local_survives_a_killed_train_attempt(sandbox, monkeypatch):
    """start -> prepare -> train (one node, local Ray) -> join -> evaluate -> end, on the local
    datastore. The first train attempt is killed (SIGKILL) once its step-2 checkpoint exists;
    @retry's second attempt continues from that checkpoint instead of starting over, and into
    the same MLflow and W&B runs (`run.trackers`, checked in `_check_trackers`)."""
    from transformers import AutoModelForCausalLM
    sandbox.env.update(MLFLOW_ALLOW_FILE_STORE="true", WANDB_SILENT="true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")           # to read it back here
    trackers = [{"kind": "mlflow", "tracking_uri": f"file:{sandbox.root / 'mlruns'}"},
                {"kind": "wandb", "mode": "offline", "dir": str(sandbox.root / "wb")}]
    config = sandbox.config(plan=True, **{**QUICK, "run.trackers": trackers})
    killer = threading.Thread(target=_kill_train_after_checkpoint,
                              args=(sandbox.root / "runs", 2), daemon=True)
    killer.start()
    with _runner(sandbox, config) as runner:
        result = runner.run()
        run = result.run
        hf_uri = _check_sft_run(run, steps=4)
        killer.join(timeout=5)
        assert killed, "the train attempt was never killed"
        train = run["train"].task
        assert train.current_attempt == 1
        assert train.data.train_result["started_at_step"] >= 2        # resumed, not restarted
        ckpt = Path(run["join"].task.data.checkpoint_uri)
        _check_trackers(sandbox, run, ckpt.parent / "metrics.jsonl")
    assert (ckpt / "step-00000004").is_dir()
    charts = {c["spec"]["title"]: c["spec"]["data"]["values"]
              for c in get_card(sandbox, SFT_FLOW, f"{run.id}/train", "training") if c["type"] == "vegaChart"}
    assert set(charts) == {"train loss", "real tokens/s (padding excluded)",
                           "MFU (model FLOPs / peak)"}
    assert [v["step"] for v in charts["train loss"]] == [1, 2, 3, 4]  # both attempts
    tables = [c for c in get_card(sandbox, SFT_FLOW, f"{run.id}/evaluate", "evaluation")
              if c["type"] == "table"]
    assert len(tables) == 3                     # the comparison, each eval source's records
    # what `make run` prints after the flow: the run's results, read back by pathspec
    shown = subprocess.run([sys.executable, "tools/show_run.py", run.pathspec], cwd=REPO,
                           env={**_base_env(), **sandbox.env}, capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert f"== {run.pathspec} finished ==" in shown.stdout and "chat" in shown.stdout
    model = AutoModelForCausalLM.from_pretrained(hf_uri)
    assert model.config.num_hidden_layers == 4
    assert not ray_processes_under(sandbox.ray_tmpdir)


def _check_trackers(sandbox, run, metrics_path: Path) -> None:
    """One MLflow run and one W&B run id over both train attempts and the evaluate step,
    tagged with the Metaflow run; every step of metrics.jsonl in both, and the suite's table."""
    import json

    from mlflow.tracking import MlflowClient
    evaluate, start = run["evaluate"].task, run["train"].task.data.train_result["started_at_step"]
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    client = MlflowClient(tracking_uri=f"file:{sandbox.root / 'mlruns'}")
    (found,) = client.search_runs(["0"])
    tags = found.data.tags
    assert (tags["metaflow.pathspec"], tags["metaflow.step"]) == (run.pathspec, "train")
    assert f"config:{tags['posttrain.config_hash'][:12]}" in run.tags     # the end step's
    assert f"dataset:{tags['posttrain.dataset_hash'][:12]}" in run.tags
    assert tags["posttrain.resumed_at_step"] == str(start)
    loss = {m.step: m.value for m in client.get_metric_history(found.info.run_id, "loss")}
    assert loss == {r["step"]: r["loss"] for r in records if "loss" in r}
    first = evaluate.data.eval_table[0]
    key = f"suite/{first['task']}/{first['metric']}"
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, key)] \
        == [(4, first["model"])]
    # W&B: the killed attempt's file may hold nothing (it writes every 15 s); the retry logs
    # metrics.jsonl up to its checkpoint again, so every step is there
    steps, ids = set(), set()
    for d in sorted((sandbox.root / "wb" / "wandb").glob("offline-run-*")):
        out = subprocess.run([str(Path(sys.executable).with_name("wandb")), "leet", "inspect",
                              "--json", str(d)], capture_output=True, text=True, timeout=60)
        for r in (json.loads(line) for line in out.stdout.splitlines() if line.strip()):
            ids |= {r["run"]["run_id"]} if r["type"] == "run" else set()
            steps |= {r["history"]["item"]["_step"]} if r["type"] == "history" else set()
    assert len(ids) == 1 and steps == {1, 2, 3, 4}


killed: list[int] = []


def _kill_train_after_checkpoint(runs: Path, step: int, timeout_s: float = 240.0) -> None:
    """SIGKILL the first attempt of the run's train task once checkpoint `step` is complete."""
    import psutil
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not killed:
        done = [p for p in runs.glob(f"SFTFlow/*/train/checkpoints/step-{step:08d}")
                if (p / "manifest.json").is_file()]
        if done:
            run_id = done[0].parts[-4]
            for proc in psutil.process_iter(["pid", "cmdline"]):
                cmd = proc.info["cmdline"] or []
                if "step" in cmd and "train" in cmd and run_id in cmd and "--retry-count" in cmd \
                        and cmd[cmd.index("--retry-count") + 1] == "0":
                    proc.send_signal(signal.SIGKILL)
                    killed.append(proc.pid)
            return
        time.sleep(0.2)


@pytest.mark.slow
def test_sft_flow_two_nodes_metaflow_ray_on_s3(sandbox, s3):
    """num_nodes: 2 -> @metaflow_ray over two local "nodes", S3 datastore on moto; no Ray
    process of the run is left behind."""
    prefix = f"s3://{s3.bucket}/{sandbox.root.name}"
    env = {**sandbox.env,
           "METAFLOW_DEFAULT_DATASTORE": "s3",
           "METAFLOW_S3_ENDPOINT_URL": s3.endpoint,
           "METAFLOW_DATASTORE_SYSROOT_S3": f"{prefix}/metaflow",
           "METAFLOW_DATATOOLS_S3ROOT": f"{prefix}/data",
           "METAFLOW_CARD_S3ROOT": f"{prefix}/cards",
           "AWS_ENDPOINT_URL": s3.endpoint,
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    sandbox.env.update(env)
    config = sandbox.config(plan=True, **{**QUICK, "train.max_steps": 2, "run.num_nodes": 2})
    with _runner(sandbox, config, datastore="s3") as runner:
        result = runner.run()
        run = result.run
        hf_uri = _check_sft_run(run, steps=2)
        assert len(list(run["train"])) == 2                  # control + one worker node
        assert hf_uri.startswith(f"{prefix}/data/posttrain/SFTFlow/")
        ckpt = run["join"].task.data.checkpoint_uri
    fs = s3_filesystem(s3)
    assert fs.exists(f"{hf_uri}/config.json")
    assert any("step-00000002" in p for p in fs.ls(ckpt, detail=False))
    assert fs.exists(f"{run['prepare'].task.data.prepared_uri}/manifest.json")
    assert not ray_processes_under(sandbox.ray_tmpdir)


def s3_filesystem(s3):
    import s3fs
    return s3fs.S3FileSystem(**s3.storage_options)


def _base_env() -> dict[str, str]:
    import os
    return dict(os.environ)
