"""Helpers the recipe tests share: run a training step's CLI as a user would, kill it, compare.

`run_to_end` and `run_and_kill` start `python -m <module> --config ... --launcher inline` (or
`ray`: the CLI then starts a Ray cluster of its own, which dies with it) in a subprocess, logging
to `<run_dir>.log`, so that SIGKILL hits a real process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def tiny_recipe(data_format: str, max_tokens_per_sample: int, *, tied: bool = True) -> dict:
    """The run, tokenizer, data and model sections the recipe tests share: one inline worker,
    the bundled tokenizer, a 2-layer 64-wide random Qwen3 (fp32)."""
    return {
        "run": {"num_workers": 1, "launcher": "inline"},
        "tokenizer": {"path": str(ROOT / "assets" / "tokenizer")},
        "data": {"format": data_format, "max_tokens_per_sample": max_tokens_per_sample,
                 "on_bad_row": "skip"},
        "model": {"init": {"family": "qwen3", "seed": 0,
                           "overrides": {"hidden_size": 64, "intermediate_size": 128,
                                         "num_hidden_layers": 2, "num_attention_heads": 4,
                                         "num_key_value_heads": 2, "head_dim": 16,
                                         "tie_word_embeddings": tied}},
                  "dtype": "float32"},
    }


_RAY_TMPDIRS: list[str] = []     # the CLI runs' Ray directories, removed when the session ends


@pytest.fixture(scope="session", autouse=True)
def _remove_ray_tmpdirs():
    yield
    for d in _RAY_TMPDIRS:
        shutil.rmtree(d, ignore_errors=True)


def cli(module: str, config: Path, run_dir: Path, launcher: str = "inline") -> subprocess.Popen:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if launcher == "ray":           # a short path: Ray's socket names have a length limit
        env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ptk", dir="/tmp")
        _RAY_TMPDIRS.append(env["RAY_TMPDIR"])
    with open(run_dir.with_suffix(".log"), "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", module, "--config", str(config), "--run-dir", str(run_dir),
             "--launcher", launcher, "--no-progress"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)


def log_tail(run_dir: Path) -> str:
    return run_dir.with_suffix(".log").read_text()[-3000:]


def run_to_end(module: str, config: Path, run_dir: Path, launcher: str = "inline") -> None:
    proc = cli(module, config, run_dir, launcher)
    try:
        assert proc.wait(timeout=TIMEOUT_S) == 0, log_tail(run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()


def run_and_kill(module: str, config: Path, run_dir: Path, step: int,
                 launcher: str = "inline", delay_s: float = 0.0) -> None:
    """Start the CLI, SIGKILL it as soon as checkpoint `step` is committed (or `delay_s` later:
    into the next step; a checkpoint committed meanwhile is removed, below)."""
    proc = cli(module, config, run_dir, launcher)
    manifest = run_dir / "checkpoints" / f"step-{step:08d}" / "manifest.json"
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not manifest.is_file():
            assert proc.poll() is None, f"ended before step {step}:\n{log_tail(run_dir)}"
            assert time.monotonic() < deadline, f"no checkpoint {step} after {TIMEOUT_S} s"
            time.sleep(0.005)
        time.sleep(delay_s)
        # the process and everything it started (with `ray`, its Ray cluster: a trainer actor
        # would otherwise finish a checkpoint the driver had asked for): the machine died
        import psutil
        family = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGKILL)
        for child in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        psutil.wait_procs(family, timeout=30)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    # A later checkpoint committed before the signal landed is removed: what is left on disk is
    # then exactly what a kill right after `step` leaves (a later, uncommitted attempt stays).
    for d in (run_dir / "checkpoints").glob("step-????????"):
        if int(d.name[5:]) > step:
            shutil.rmtree(d)


def step_metrics(run_dir: Path) -> dict[int, dict]:
    """The training steps' rows of a run's metrics.jsonl, by step."""
    import json
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def safetensors(hf_dir: Path) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in sorted(hf_dir.glob("*.safetensors"))}
    assert files, f"no safetensors in {hf_dir}"
    return files


@contextlib.contextmanager
def ray_cluster(num_cpus: int):
    """A local Ray cluster of `num_cpus` CPUs, stopped after the block."""
    import ray
    tmp = tempfile.mkdtemp(prefix="ptr", dir="/tmp")        # short: Ray's socket paths
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
             configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster for the module's multi-worker runs (2 CPUs), stopped after it."""
    with ray_cluster(2):
        yield


def assert_weights_close(a_dir: Path, b_dir: Path, atol: float) -> None:
    """The safetensors of two HF checkpoints hold the same tensors within `atol`."""
    from safetensors.torch import load_file
    a = {k: v for f in sorted(a_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted(b_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"max |weight difference| {worst:.2e} > {atol:.0e}"
