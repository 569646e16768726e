"""bench/gpu_suite.py in its CPU mode (`--device cpu --tiny`): every case runs and prints one
JSON line with its fields, and nothing imports what the GPU machine lacks (Ray, Metaflow,
vLLM, PEFT). The GPU numbers themselves come from running it there (bench/run_gpu_suite.sh);
no test depends on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# run the script with these packages made unimportable, as on the GPU machine
_BLOCKED_RUN = """
import runpy, sys
BLOCKED = ("ray", "metaflow", "vllm", "peft")
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not on the GPU machine")
sys.meta_path.insert(0, Blocker())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

SFT_FIELDS = {"real_tokens_per_s", "mfu", "peak_memory_gib", "peak_flops", "params",
              "attention_backends", "pack_tokens", "rows_per_step", "timed_steps",
              "final_loss"}


@pytest.mark.slow
def test_tiny_cpu_mode_prints_one_json_line_per_case(tmp_path) -> None:
    out = tmp_path / "suite.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "lib"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED_RUN, str(ROOT / "bench" / "gpu_suite.py"),
         "--device", "cpu", "--tiny", "--out", str(out), "--profile", str(tmp_path / "prof.txt")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert printed == written
    by_case = {r["case"]: r for r in printed}
    assert list(by_case) == ["sft_qwen3_0.6b", "sft_qwen3_5_0.8b", "rollout_qwen3_0.6b",
                             "rollout_qwen3_5_0.8b", "long_qwen3_0.6b", "sft_qwen3_1.7b",
                             "sft_qwen3_moe", "ep2_qwen3_moe"]
    for record in printed:
        assert "error" not in record, record
        assert record["bench"] == "gpu_suite" and record["tiny"] and record["device"] == "cpu"
    for name in ("sft_qwen3_0.6b", "sft_qwen3_5_0.8b", "sft_qwen3_1.7b", "sft_qwen3_moe",
                 "ep2_qwen3_moe"):
        record = by_case[name]
        assert SFT_FIELDS <= set(record), SFT_FIELDS - set(record)
        assert record["real_tokens_per_s"] > 0 and 0 < record["mfu"] < 1
        assert record["attention_backends"] and record["dtype"] == "fp32"
    # each one-rank SFT case profiled one more step: its operators in the file, a summary here
    profiled = [r for r in printed if r["kind"] == "sft" and "world" not in r]
    assert len(profiled) == 4 and all(r["profile"]["aten_ops"] > 100 for r in profiled)
    # ... and the long case's two lengths
    assert (tmp_path / "prof.txt").read_text().count("=== ") == 6
    assert "split" in {b for r in printed if r["kind"] == "sft" for b in r["attention_backends"]}
    assert by_case["sft_qwen3_moe"]["num_experts"] == 4
    # two gloo ranks with the experts split over them train the same first steps as one
    ep = by_case["ep2_qwen3_moe"]
    assert (ep["world"], ep["ep"]) == (2, 2)
    assert ep["final_loss"] == pytest.approx(by_case["sft_qwen3_moe"]["final_loss"], abs=1e-3)
    long = by_case["long_qwen3_0.6b"]
    assert [r["pack_tokens"] for r in long["lengths"]] == [256, 512]
    assert long["longest_fitting_row"] == 512 and all(r["real_tokens_per_s"] > 0
                                                      for r in long["lengths"])
    assert by_case["sft_qwen3_5_0.8b"]["family"] == "qwen3_5"
    for name in ("rollout_qwen3_0.6b", "rollout_qwen3_5_0.8b"):
        rollout = by_case[name]
        assert rollout["generated_tokens"] == 2 * 2 * 8 and rollout["generated_tokens_per_s"] > 0


def test_a_failing_case_is_reported_and_the_rest_runs(tmp_path) -> None:
    """One case's exception becomes its line's `error`; the suite still exits 0."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_suite
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import torch

    def broken() -> dict:
        raise RuntimeError("out of memory (pretend)")

    record = gpu_suite._run_case("sft_x", broken, torch.device("cpu"))
    assert record["case"] == "sft_x" and record["error"].startswith("RuntimeError: out of memory")
    assert "Traceback" in record["traceback"] and "case_s" in record
    json.dumps(record)
