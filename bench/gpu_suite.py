"""The prepared GPU benchmark: bf16 SFT and native rollout throughput, one JSON line per case.

Cases (random weights from `ModelArgs`, nothing downloaded; `--cases` picks some):

* ``sft_qwen3_0.6b``, ``sft_qwen3_1.7b``: the Qwen3-0.6B / -1.7B shapes (28 layers, 16 query and
  8 KV heads of 128, vocabulary 151,936, tied embeddings; hidden 1024 / 2048, MLP 3072 / 6144).
* ``sft_qwen3_moe``: Qwen3-30B-A3B's layer shape (hidden 2048, 32 query / 4 KV heads of 128,
  128 experts of width 768, top-8) with `--moe-layers` of its 48 layers (default 4); all
  experts are kept, so routing is as sparse as in the full model.
* ``sft_qwen3_5_0.8b``: the Qwen3.5-0.8B shape (24 layers, three gated-DeltaNet layers to one
  gated full-attention layer; hidden 1024, MLP 3584, 8 query / 2 KV heads of 256 with a quarter
  of each turned by RoPE, vocabulary 248,320, as slime's qwen3.5-0.8B model args give it); its
  DeltaNet layers take transformers' default heads (16 key and 16 value heads of 128: the
  released checkpoint's exact linear-attention heads are not in this repository). Beside
  Qwen3's case it shows what the chunked delta rule costs per token.
* ``rollout_qwen3_0.6b``, ``rollout_qwen3_5_0.8b``: `NativeEngine.generate` (KV cache or the
  DeltaNet's recurrent state, batched sampling) on those shapes in bf16: generated tokens/s.
* ``long_qwen3_0.6b``: one packed row of `--long-packs` tokens (32k, then 64k) per step at
  cp=1 on one GPU, the SFT case otherwise: tokens/s and peak memory per length, and the
  longest row that fits (an out-of-memory error ends the list): the single-GPU limit that
  context parallelism (`parallel.cp`) lifts.
* ``ep2_qwen3_moe``: the MoE case on two ranks with its experts split over them
  (`parallel.ep=2`, all-to-all dispatch); needs two devices (one GPU: a skipped line). On a
  CPU, two gloo processes.

Each SFT case is one `posttrain.train.engine.Engine` as the recipes build it: the random model
is written as an HF checkpoint (bf16) and loaded the sharded way (FSDP2 over the one GPU, bf16
compute, fp32 master weights and AdamW), full activation checkpointing, the chunked loss, and
the attention backend the library picks for the device (FlexAttention, compiled, on CUDA; the
per-document split on CPU). Rows are packed to `--pack` tokens (8192) from lognormal-length
synthetic documents (`posttrain.data.packing`), one row per micro-batch, `--rows-per-step` per
step. After `--warmup` steps (FlexAttention compiles there), `--steps` timed steps, each ended
by a device synchronize: real (non-padding) tokens/s, MFU = model FLOPs of those tokens
(`posttrain.train.recipe.policy_flops`: packed attention, LM head over the loss tokens) over
the device's dense bf16 peak (`posttrain.train.metrics.device_peak_flops`: 989 TFLOP/s on an
H200), and the peak allocated memory. A case that fails prints a line with its error and the
suite goes on; a case that would start past `--budget-s` prints a skipped line.

Run on the GPU machine (no Ray, Metaflow or vLLM needed; nothing here imports them), as
`bench/run_gpu_suite.sh` does:

    PYTHONPATH=lib python bench/gpu_suite.py --out $OUT/gpu_suite.jsonl

and on a CPU, the same code paths on tiny shapes in seconds (fp32; tests/bench/test_gpu_suite.py):

    PYTHONPATH=lib python bench/gpu_suite.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

QWEN3 = dict(family="qwen3", vocab_size=151_936, num_layers=28, num_heads=16, num_kv_heads=8,
             head_dim=128, tie_word_embeddings=True, qk_norm=True, rope_theta=1_000_000.0,
             max_position_embeddings=40_960)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_0.6b": {**QWEN3, "hidden_size": 1024, "intermediate_size": 3072},
    "qwen3_1.7b": {**QWEN3, "hidden_size": 2048, "intermediate_size": 6144},
    # Qwen3-30B-A3B's layers; num_layers is --moe-layers of its 48
    "qwen3_moe": {**QWEN3, "family": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                  "num_heads": 32, "num_kv_heads": 4, "tie_word_embeddings": False,
                  "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": True, "router_aux_loss_coef": 0.001},
}
QWEN3_5_LAYERS = 24
SHAPES["qwen3_5_0.8b"] = dict(
    family="qwen3_5", vocab_size=248_320, num_layers=QWEN3_5_LAYERS, hidden_size=1024,
    intermediate_size=3584, num_heads=8, num_kv_heads=2, head_dim=256,
    tie_word_embeddings=True, qk_norm=True, norm_offset=True, rope_theta=10_000_000.0,
    partial_rotary_factor=0.25, attn_output_gate=True, max_position_embeddings=262_144,
    layer_types=("linear_attention",) * 3 + ("full_attention",),    # repeated per 4 layers
    linear_attention=dict(num_k_heads=16, num_v_heads=16, head_k_dim=128, head_v_dim=128))
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
TINY_LINEAR = dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8)

# in this order: the cheap ones first, the largest checkpoint (the MoE's) last
CASES = ("sft_qwen3_0.6b", "sft_qwen3_5_0.8b", "rollout_qwen3_0.6b", "rollout_qwen3_5_0.8b",
         "long_qwen3_0.6b", "sft_qwen3_1.7b", "sft_qwen3_moe", "ep2_qwen3_moe")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and steps (a CPU check)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {CASES}")
    p.add_argument("--out", default=None, help="also write the JSON lines to this file")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no case after this many seconds (the suite's time limit)")
    p.add_argument("--pack", type=int, default=8192, help="tokens per packed row")
    p.add_argument("--rows-per-step", type=int, default=8, help="packed rows per optimizer step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps after the warmup")
    p.add_argument("--moe-layers", type=int, default=4, help="of Qwen3-30B-A3B's 48 layers")
    p.add_argument("--compile", action="store_true",
                   help="also torch.compile every block (parallel.compile)")
    p.add_argument("--prompts", type=int, default=64, help="rollout: prompts per generate call")
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--long-packs", default="32768,65536",
                   help="long-context case: row lengths, ascending")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="SFT cases: one more step under the torch profiler; its top operators "
                        "by device and host time go to FILE (appended) and a summary (device "
                        "busy fraction, kernels, host ops) into the case's line")
    p.add_argument("--slow-step-s", type=float, default=15.0,
                   help="a case whose last warmup step took longer times one step, not --steps")
    a = p.parse_args(argv)
    unknown = sorted(set(a.cases.split(",")) - set(CASES))
    if unknown:
        p.error(f"--cases {unknown} unknown; choose from {list(CASES)}")
    if a.tiny:
        a.pack, a.rows_per_step, a.warmup, a.steps, a.moe_layers = 128, 2, 1, 2, 2
        a.prompts, a.samples_per_prompt, a.max_new_tokens = 2, 2, 8
        a.long_packs = "256,512"
    return a


def model_args(shape: str, a: argparse.Namespace):
    from posttrain.models.args import DeltaNetArgs, ModelArgs
    fields = dict(SHAPES[shape])
    if shape == "qwen3_moe":
        fields["num_layers"] = a.moe_layers
    if a.tiny:
        fields.update(TINY, **(TINY_MOE if fields["family"] == "qwen3_moe" else {}))
    if "linear_attention" in fields:
        pattern = fields["layer_types"]
        fields["layer_types"] = tuple(pattern[i % len(pattern)] if i < fields["num_layers"] - 1
                                      else "full_attention" for i in range(fields["num_layers"]))
        fields["linear_attention"] = DeltaNetArgs(**(TINY_LINEAR if a.tiny
                                                     else fields["linear_attention"]))
    return ModelArgs(**fields)


def _sync(device) -> None:
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------- SFT

def _packed_rows(vocab: int, pack: int, rows: int, seed: int = 0) -> list[dict]:
    """`rows` collated micro-batches of one packed row each, from documents of lognormal
    length (median pack / 20: about 400 tokens in rows of 8192, skewed, some as long as a row)."""
    import numpy as np

    from posttrain.data.packing import Packer, PackingConfig, Sample, collate
    from posttrain.data.stream import ListStream
    rng = np.random.default_rng(seed)
    median = pack / 20
    lengths = rng.lognormal(np.log(median), 1.0, int(3 * rows * pack / median) + 64)
    lengths = np.clip(lengths, max(4, pack // 512), pack).astype(int)
    samples = [Sample(rng.integers(0, vocab, n).astype(np.int32), np.ones(n, np.uint8))
               for n in lengths]
    packer = iter(Packer(ListStream(samples), PackingConfig(max_tokens_per_pack=pack)))
    return [collate([next(packer)]) for _ in range(rows)]


def sft_case(shape: str, a: argparse.Namespace, device, work: str, *,
             parallel: dict | None = None) -> dict[str, Any]:
    """One SFT engine's timed steps; with `parallel` (a multi-rank layout, in a process group
    of that many ranks) each data-parallel rank takes its share of every step's rows and
    tokens/s is the job's (this rank's x the world)."""
    import torch
    import torch.distributed as dist

    from posttrain.distributed.parallelize import ParallelConfig
    from posttrain.models.hf_io import save_hf
    from posttrain.models.moe import grouped_mm_available
    from posttrain.models.transformer import build_model
    from posttrain.ops.attention import build_mask
    from posttrain.train.engine import Engine, EngineConfig, ModelConfig
    from posttrain.train.metrics import batch_counts, device_peak_flops, step_metrics
    from posttrain.train.optim import OptimizerConfig
    from posttrain.train.recipe import policy_flops

    t0 = time.perf_counter()
    args = model_args(shape, a)
    bf16 = device.type == "cuda"
    hf_dir = os.path.join(work, shape)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        base = build_model(args, device=device, seed=0,
                           dtype=torch.bfloat16 if bf16 else torch.float32)
        save_hf(base, hf_dir)
        del base
    if world > 1:
        dist.barrier()
    if args.num_experts:
        # probe torch._grouped_mm before the first step: its one-time probe inside an
        # activation-checkpointed block adds saved tensors the recomputation lacks
        # (CheckpointError at the first backward)
        grouped_mm_available(device, torch.bfloat16 if bf16 else torch.float32)
    steps = a.warmup + a.steps
    cfg = EngineConfig(max_steps=steps + 1,                 # + the profiled one
                       optimizer=OptimizerConfig(lr=1e-5),
                       checkpoint_every_steps=10**9,
                       parallel=ParallelConfig(mixed_precision="bf16" if bf16 else "fp32",
                                               activation_checkpointing="full",
                                               compile=a.compile, **(parallel or {})))
    engine = Engine(ModelConfig(hf_dir=hf_dir), cfg, hf_dir, os.path.join(work, f"{shape}.run"))
    batches = _packed_rows(args.vocab_size, a.pack, steps * a.rows_per_step)
    setup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)       # training's peak, not the build's
    peak, peak_source = device_peak_flops(device)
    # what the model's attention runs per row (a row of one document takes plain causal SDPA)
    backends = sorted({build_mask(b["document_lengths"], 1, a.pack, device,
                                  tensors_only=a.compile).backend for b in batches})
    timed: list[dict] = []
    seconds, flops, metrics, timed_steps, to_time = 0.0, 0.0, {}, 0, a.steps

    def one_step(step: int) -> tuple[list[dict], float]:
        nonlocal metrics
        rows = batches[step * a.rows_per_step:(step + 1) * a.rows_per_step]
        micro = rows[engine.dp.rank::engine.dp.size]
        _sync(device)
        t1 = time.perf_counter()
        metrics = engine.train_step(micro, sum(int(b["num_loss_tokens"]) for b in rows))
        _sync(device)
        return micro, time.perf_counter() - t1

    for step in range(steps):
        if step >= a.warmup and timed_steps >= to_time:
            break
        micro, step_s = one_step(step)
        if step == a.warmup - 1 and step_s > a.slow_step_s:
            to_time = 1                                 # a slow case times one step
        if step >= a.warmup:
            seconds += step_s
            flops += sum(policy_flops(engine.model, b) for b in micro)
            timed += micro
            timed_steps += 1
    final_loss = float(metrics["loss"])
    profiled = (_profile_step(lambda: one_step(steps - 1), device, a.profile, shape)
                if a.profile and world == 1 else {})
    out = step_metrics(batch_counts(timed), seconds=seconds, data_wait_s=0.0, flops=flops,
                       peak_flops=peak, device=device)
    layout = {"world": world, **(parallel or {})} if world > 1 else {}
    moe = {}
    if args.num_experts:
        moe = {"num_experts": args.num_experts, "experts_per_token": args.num_experts_per_tok,
               "moe_intermediate_size": args.moe_intermediate_size,
               "shape_note": "tiny" if a.tiny else (
                   f"Qwen3-30B-A3B layer shape, {args.num_layers} of its 48 layers, all "
                   f"{args.num_experts} experts")}
    return {"kind": "sft", "shape": shape, "family": args.family, "layers": args.num_layers,
            "hidden_size": args.hidden_size, "vocab_size": args.vocab_size, **moe,
            "params": engine.num_params, "dtype": "bf16" if bf16 else "fp32",
            "attention_backends": backends, "activation_checkpointing": "full",
            "compile_blocks": a.compile, "loss_chunk_tokens": engine.model_cfg.loss_chunk_tokens,
            "pack_tokens": a.pack, "rows_per_step": a.rows_per_step, "warmup_steps": a.warmup,
            "timed_steps": timed_steps, "setup_s": round(setup_s, 1),
            "step_s": round(seconds / max(timed_steps, 1), 3), **layout,
            "real_tokens_per_s": round(out["real_tokens_per_s"] * world, 1),
            "padding_fraction": round(out["padding_fraction"], 4),
            "model_flops_per_s": flops / seconds, "mfu": round(out["mfu"], 4),
            "peak_flops": peak, "peak_flops_source": peak_source,
            "peak_memory_gib": round(out["peak_memory_bytes"] / 2**30, 2),
            "final_loss": round(final_loss, 4), **profiled}


def _profile_step(step: Callable[[], Any], device, path: str, title: str) -> dict[str, Any]:
    """One more training step under the torch profiler (the last batch again, after the timed
    ones): the top operators by device and by host time appended to `path`, and a summary:
    the step's wall time, the device's busy time (its kernels' durations summed) and its fraction of
    the wall, kernels launched, and host-side ATen ops. A busy fraction well under one means
    the device waits on the host (launch-bound or synchronising)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        _, wall_s = step()
    on_device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    device_us = sum(e.device_time_total for e in on_device)
    kernels = len(on_device)
    events = prof.key_averages()
    aten_ops = sum(e.count for e in events if e.key.startswith("aten::"))
    sort_device = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with open(path, "a") as f:
        f.write(f"=== {title}: step {wall_s:.3f} s under the profiler, device busy "
                f"{device_us / 1e6:.3f} s, {kernels} kernels, {aten_ops} ATen ops\n")
        f.write(events.table(sort_by=sort_device, row_limit=30, max_name_column_width=60))
        f.write("\n--- by host time\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=20,
                             max_name_column_width=60))
        f.write("\n")
    return {"profile": {"step_s": round(wall_s, 3), "device_busy_s": round(device_us / 1e6, 3),
                        "device_busy_fraction": round(device_us / 1e6 / wall_s, 3),
                        "kernels": kernels, "aten_ops": aten_ops}}


def long_case(shape: str, a: argparse.Namespace, device, work: str) -> dict[str, Any]:
    """The SFT case at one row of each `--long-packs` length per step (cp=1), until one does
    not fit; the longest that did is the single-device limit."""
    import torch
    lengths, fitted = [], None
    for pack in (int(x) for x in a.long_packs.split(",")):
        one = argparse.Namespace(**{**vars(a), "pack": pack, "rows_per_step": 1,
                                    "warmup": 1, "steps": 1})
        try:
            r = sft_case(shape, one, device, work)
        except torch.OutOfMemoryError as e:
            lengths.append({"pack_tokens": pack, "out_of_memory": str(e)[:300]})
            break
        finally:
            shutil.rmtree(os.path.join(work, shape), ignore_errors=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        lengths.append({k: r[k] for k in ("pack_tokens", "step_s", "real_tokens_per_s", "mfu",
                                          "peak_memory_gib", "attention_backends", "profile")
                        if k in r})
        fitted = pack
    return {"kind": "long_context", "shape": shape, "cp": 1, "lengths": lengths,
            "longest_fitting_row": fitted}


def ep_case(shape: str, a: argparse.Namespace, device, work: str,
            world: int = 2) -> dict[str, Any]:
    """The SFT case on `world` processes with the experts split over them (ep = world)."""
    import torch
    import torch.multiprocessing as mp
    if device.type == "cuda" and torch.cuda.device_count() < world:
        return {"skipped": f"expert parallelism over {world} ranks needs {world} devices; "
                           f"this machine has {torch.cuda.device_count()}"}
    from posttrain.distributed.env import free_port
    out = os.path.join(work, "ep_rank0.json")
    mp.spawn(_ep_rank, args=(world, free_port(), shape, a, device.type, work, out),
             nprocs=world, join=True)
    with open(out) as f:
        return json.load(f)


def _ep_rank(rank: int, world: int, port: int, shape: str, a: argparse.Namespace,
             device_type: str, work: str, out: str) -> None:
    import torch

    from posttrain.distributed.env import close_process_group, init_process_group
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    init_process_group()
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    record = sft_case(shape, a, device, work, parallel={"dp_shard": world, "ep": world})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(record, f)
    close_process_group()
    os._exit(0)       # skip finalization, where gloo objects held by FSDP modules may abort


# ------------------------------------------------------------------------------ rollout

def rollout_case(shape: str, a: argparse.Namespace, device, work: str) -> dict[str, Any]:
    import torch

    from posttrain.models.transformer import build_model
    from posttrain.rl.engine import SamplingConfig
    from posttrain.rl.native import NativeEngine

    args = model_args(shape, a)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args, device=device, dtype=dtype, seed=0).eval()
    n = a.samples_per_prompt
    engine = NativeEngine(model, max_batch_sequences=a.prompts * n)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab_size, (int(length),), generator=gen).tolist()
               for length in torch.randint(16 if a.tiny else 64, 32 if a.tiny else 256,
                                           (a.prompts,), generator=gen)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=a.max_new_tokens, seed=0)
    engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=4), n)   # warm up
    _sync(device)
    t0 = time.perf_counter()
    rollouts = engine.generate(prompts, sampling, n)
    _sync(device)
    seconds = time.perf_counter() - t0
    generated = sum(len(r.completion_ids) for group in rollouts for r in group)
    from posttrain.train.metrics import peak_memory_bytes
    return {"kind": "rollout", "shape": shape, "engine": "native", "layers": args.num_layers,
            "hidden_size": args.hidden_size, "dtype": str(dtype).removeprefix("torch."),
            "prompts": a.prompts, "samples_per_prompt": n, "max_new_tokens": a.max_new_tokens,
            "prompt_tokens": sum(len(p) for p in prompts), "generated_tokens": generated,
            "seconds": round(seconds, 3), "generated_tokens_per_s": round(generated / seconds, 1),
            "peak_memory_gib": round(peak_memory_bytes(device) / 2**30, 2)}


# --------------------------------------------------------------------------------- suite

def _run_case(name: str, run: Callable[[], dict[str, Any]], device) -> dict[str, Any]:
    """One case's JSON record; an exception becomes an `error` field."""
    import torch
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    try:
        record = run()
    except Exception as e:                      # noqa: BLE001 - one case must not stop the rest
        record = {"error": f"{type(e).__name__}: {e}"[:2000],
                  "traceback": traceback.format_exc()[-3000:]}
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"case": name, **record, "case_s": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""           # before torch initialises CUDA
    import torch
    t_start = time.perf_counter()
    common = {"bench": "gpu_suite", "tiny": a.tiny, "torch": torch.__version__}
    lines: list[str] = []

    def emit(record: dict[str, Any]) -> None:
        line = json.dumps({**common, **record})
        print(line, flush=True)
        lines.append(line)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")

    if a.out:
        open(a.out, "w").close()
    if a.device == "cuda" and not torch.cuda.is_available():
        emit({"case": "all", "skipped": "no CUDA device; run with --device cpu --tiny"})
        return 0
    from posttrain.distributed.env import init_process_group
    init_process_group()
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" \
        else torch.device("cpu")
    common["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    work = tempfile.mkdtemp(prefix="gpu_suite_")
    try:
        for name in a.cases.split(","):
            elapsed = time.perf_counter() - t_start
            if elapsed > a.budget_s:
                emit({"case": name, "skipped": f"time budget: {elapsed:.0f} s of "
                                               f"{a.budget_s:.0f} s spent"})
                continue
            kind, _, shape = name.partition("_")
            case = {"sft": sft_case, "rollout": rollout_case, "long": long_case,
                    "ep2": ep_case}[kind]
            emit(_run_case(name, lambda: case(shape, a, device, work), device))
            shutil.rmtree(os.path.join(work, shape), ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
