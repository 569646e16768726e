"""Weight sync benchmark: trainer -> separate rollout engine, before and after issue 15.

Two FSDP2 trainer ranks (`posttrain.train.grpo.GRPOWorker`, Ray actors, gloo) and one separate
native rollout engine (`RolloutWorker`), driven by the GRPO controller's `SeparateRollouts`,
on a local Ray cluster of 3 CPUs:

- after: `SeparateRollouts.sync` as it is now: every rank gathers the sharded weights one tensor
  at a time, rank 0 packs them into `rollout.sync_bucket_mb` buckets in the engine's dtype and
  broadcasts each over the gloo sync group (`posttrain.rl.weight_sync`); then the sync check
  (`sync/max_abs_logprob_diff` on a probe sequence).
- before: the path it replaced, replayed here (the library no longer has it): every rank takes
  part in a full-state-dict gather (each holds the whole model), rank 0 returns it to the
  driver through the object store, the driver `ray.put`s it again, the engine gets it.
- LoRA (rank 16 on q, k, v, o, gate, up, down): the first sync (bases + adapters) and the
  adapter-only syncs after it. The before path sent the merged model each time, the bytes of
  "before" above.

Models: the tiny GRPO model (configs/grpo/tiny.yaml's, the committed arithmetic SFT checkpoint;
fp32 trainer and engine) and a random Qwen3-0.6B-shaped model (hidden 1024, 28 layers, 16 heads,
8 kv heads, head_dim 128, intermediate 3072, vocabulary 151,936, tied; a bf16 checkpoint run
with `model.dtype: bfloat16`): the engine holds bf16 weights, the trainer's parameters are fp32
(as the engine builds them, holding the checkpoint's bf16 values), so the after path sends
bf16 and the before path sent fp32. The sync check then compares an fp32 trainer with a bf16
engine: its gap is arithmetic, and the same after either path. Per path: median seconds per
sync, bytes per sync (the payload each engine receives), the peak extra resident memory of
trainer rank 0 and of the engine process during a sync (sampled every 2 ms), and the sync
check after it; `startup_s` is the trainer group's and the engine actor's start (not a sync).
The before path at 0.6B runs once (it holds ~7 GB extra in two processes). About 6-7 minutes on
a 2-core machine, most of it starting four trainer groups and the 0.6B before path;
``--only tiny`` takes about 1.5 minutes.

Prints ONE JSON line and writes it to bench/results/weight_sync.json.
Run: ``python bench/weight_sync.py [--repeats 2] [--only tiny]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from posttrain.models.shapes import QWEN3_0P6B, write_random_checkpoint

ROOT = Path(__file__).resolve().parents[1]

TINY_HF = ROOT / "tests" / "fixtures" / "arithmetic_sft"
LORA = {"rank": 16, "alpha": 32.0, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}
PROBE = list(range(40, 72))


# --------------------------------------------------------------------------- inside the actors

def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _start_rss(actor: Any) -> None:
    """Sample this process's resident memory every 2 ms until `_stop_rss`."""
    import threading
    state = {"stop": False, "base": _rss(), "peak": 0}

    def sample() -> None:
        while not state["stop"]:
            state["peak"] = max(state["peak"], _rss())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    actor._bench_rss = (state, thread)


def _stop_rss(actor: Any) -> int:
    state, thread = actor._bench_rss
    state["stop"] = True
    thread.join()
    return max(state["peak"] - state["base"], 0)


def _old_engine_weights(actor: Any) -> dict[str, torch.Tensor]:
    """The replaced `GRPOWorker.engine_weights`: a full-state-dict gather on every rank (LoRA
    folded in); the CPU tensors on rank 0, {} elsewhere."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict)
    from torch.distributed.tensor import DTensor
    worker = actor.worker
    sd = get_model_state_dict(worker.engine.root, options=StateDictOptions(full_state_dict=True))
    state = {k[len("model."):]: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
             for k, v in sd.items() if k.startswith("model.")}
    lora = worker.cfg.model.lora
    if lora is not None:
        from posttrain.models.lora import fold_adapters
        state = fold_adapters(state, lora.alpha / lora.rank)
    return {k: v.cpu() for k, v in state.items()} if worker.rank == 0 else {}


def _old_update_weights(rollout_worker: Any, state: dict[str, torch.Tensor]) -> None:
    """The replaced `RolloutWorker.update_weights` (push_weights): every engine parameter."""
    engine = rollout_worker.engine
    engine.update_weights((k, state[k]) for k in engine.parameter_shapes)


# --------------------------------------------------------------------------- the driver

def write_qwen3_0p6b(out_dir: Path) -> Path:
    """A random Qwen3-0.6B-shaped checkpoint in bf16 (normal(0, 0.02) weights)."""
    return write_random_checkpoint(QWEN3_0P6B, out_dir)


def grpo_config(hf_dir: Path, dtype: str, lora: bool, run_dir: Path) -> dict:
    cfg = yaml.safe_load((ROOT / "configs/grpo/tiny.yaml").read_text())
    cfg["model"] = {"hf_dir": str(hf_dir), "dtype": dtype,
                    **({"lora": dict(LORA)} if lora else {})}
    cfg["run"] = {"dir": str(run_dir), "launcher": "ray", "num_workers": 2}
    cfg["rollout"] = {"kind": "native", "placement": "separate", "num_engines": 1,
                      "resources_per_engine": {"num_cpus": 1}}
    cfg["export"] = {"format": "merged" if lora else "full"}
    return cfg


def measure(ray: Any, group: Any, rollouts: Any, sync: Any) -> dict[str, float]:
    """Seconds, bytes and peak extra memory (trainer rank 0, engine) of one `sync()`."""
    rank0, engine = group.actors[0], rollouts.engines[0]
    ray.get([rank0.__ray_call__.remote(_start_rss), engine.__ray_call__.remote(_start_rss)])
    t0 = time.perf_counter()
    nbytes = sync()
    seconds = time.perf_counter() - t0
    peaks = ray.get([rank0.__ray_call__.remote(_stop_rss), engine.__ray_call__.remote(_stop_rss)])
    return {"seconds": seconds, "bytes": int(nbytes), "rank0_peak_extra_bytes": peaks[0],
            "engine_peak_extra_bytes": peaks[1]}


def old_sync(ray: Any, group: Any, rollouts: Any) -> int:
    """The replaced `SeparateRollouts.sync`: rank 0's full weights through the object store."""
    weights = ray.get([a.__ray_call__.remote(_old_engine_weights) for a in group.actors])[0]
    ref = ray.put(weights)
    ray.get([a.__ray_call__.remote(_old_update_weights, ref) for a in rollouts.engines])
    return sum(t.numel() * t.element_size() for t in weights.values())


def probe_diff(rollouts: Any) -> float:
    """The GRPO sync check: max |engine - trainer| log-prob over a fixed sequence."""
    trainer, engines = rollouts.probe(PROBE, 8, 1.0)
    return max(abs(a - b) for e in engines for a, b in zip(e, trainer))


def summary(runs: list[dict[str, float]]) -> dict[str, float]:
    return {"seconds": statistics.median(r["seconds"] for r in runs),
            "bytes": runs[-1]["bytes"],
            "rank0_peak_extra_bytes": max(r["rank0_peak_extra_bytes"] for r in runs),
            "engine_peak_extra_bytes": max(r["engine_peak_extra_bytes"] for r in runs),
            "runs": len(runs)}


def bench_model(ray: Any, hf_dir: Path, dtype: str, lora: bool, work: Path,
                repeats: int, before_repeats: int) -> dict[str, Any]:
    from posttrain.config.loader import build
    from posttrain.distributed.worker_group import WorkerGroup
    from posttrain.train.grpo import GRPOConfig, GRPOWorker
    from steps.train_grpo import SeparateRollouts
    run_dir = work / f"run_{hf_dir.name}_{'lora' if lora else 'full'}"
    prepared = work / "prepared"
    cfg = grpo_config(hf_dir, dtype, lora, run_dir)
    t0 = time.perf_counter()
    group = WorkerGroup(GRPOWorker, 2, resources_per_worker={"CPU": 1},
                        env={"OMP_NUM_THREADS": "1"},
                        init_args=(cfg, str(hf_dir), str(prepared), str(run_dir)))
    rollouts = None
    try:
        rollouts = SeparateRollouts(build(GRPOConfig, cfg, where="bench"), group, str(hf_dir))
        out: dict[str, Any] = {"params": group.call("describe")[0]["params"],
                               "startup_s": round(time.perf_counter() - t0, 1)}
        after = [measure(ray, group, rollouts, rollouts.sync) for _ in range(repeats + lora)]
        after_diff = probe_diff(rollouts)
        if lora:
            out.update({"after_first": after[0], "after_adapters": summary(after[1:]),
                        "sync/max_abs_logprob_diff": after_diff})
            return out
        before = [measure(ray, group, rollouts, lambda: old_sync(ray, group, rollouts))
                  for _ in range(before_repeats)]
        before_diff = probe_diff(rollouts)
        out.update({"before": {**summary(before), "sync/max_abs_logprob_diff": before_diff},
                    "after": {**summary(after), "sync/max_abs_logprob_diff": after_diff}})
        return out
    finally:
        if rollouts is not None:
            rollouts.close()
        group.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="syncs timed per path")
    parser.add_argument("--only", choices=("tiny", "qwen3_0p6b"))
    parser.add_argument("--out", default=str(ROOT / "bench/results/weight_sync.json"))
    opts = parser.parse_args()
    import ray
    work = Path(tempfile.mkdtemp(prefix="wsync", dir="/tmp"))
    (work / "prepared").mkdir()
    (work / "prepared/manifest.json").write_text(json.dumps({"tokenizer": {}}))
    ray.init(num_cpus=3, include_dashboard=False, _temp_dir=str(work / "ray"),
             log_to_driver=False, configure_logging=False)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"bench": "weight_sync", "trainer_ranks": 2, "engines": 1,
                              "backend": "gloo", "device": "cpu", "cases": {}}
    try:
        models = {"tiny": (TINY_HF, "float32"), "qwen3_0p6b": (None, "bfloat16")}
        for name, (hf_dir, dtype) in models.items():
            if opts.only and name != opts.only:
                continue
            if hf_dir is None:
                # in a child process, whose memory is returned when it ends
                hf_dir = work / name
                writer = multiprocessing.get_context("spawn").Process(
                    target=write_qwen3_0p6b, args=(hf_dir,))
                writer.start()
                writer.join()
                assert writer.exitcode == 0, "writing the random Qwen3-0.6B-shaped model failed"
            before = opts.repeats if name == "tiny" else 1
            case = bench_model(ray, hf_dir, dtype, False, work, opts.repeats, before)
            case["lora"] = bench_model(ray, hf_dir, dtype, True, work, opts.repeats, 0)
            case["dtype"] = dtype
            result["cases"][name] = case
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    result["total_s"] = round(time.perf_counter() - t0, 1)
    line = json.dumps(result)
    print(line)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
