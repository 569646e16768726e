"""The posttrain side of `bench/vs_trl.py`: one recipe in this process, one JSON line out.

Each function builds the recipe's config over the shared inputs (`bench/_peer_data.py`), runs the
same work the TRL side runs, and returns its numbers. Peak RSS is this process's own
(`ru_maxrss`), read at the end of the timed work; the caller runs every measurement in a fresh
process so the figure is the recipe's alone.
"""

from __future__ import annotations

import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _base(work: Path, run: str, fmt: str, data: str, max_tokens: int) -> dict[str, Any]:
    return {"run": {"dir": str(work / "runs" / run), "num_workers": 1, "launcher": "inline"},
            "tokenizer": {"path": str(work / "tok")},
            "data": {"format": fmt, "train": [{"name": fmt, "path": str(data)}],
                     "max_tokens_per_sample": max_tokens, "overlong": "truncate"},
            "model": {"hf_dir": str(work / "model"), "dtype": "float32"}}


def sft_config(work: Path, pack: int = 2048, rows: int = 4, compile: bool = False
               ) -> dict[str, Any]:
    cfg = _base(work, "sft", "chat", work / "data" / "chat.jsonl", pack)
    cfg["train"] = {"max_steps": 10_000, "tokens_per_step": rows * pack,
                    "parallel": {"compile": compile},
                    "loader": {"packing": {"max_tokens_per_pack": pack, "buffer_samples": 256},
                               "mode": "packed", "rows_per_batch": rows,
                               "shuffle_buffer_samples": 1024, "seed": 0},
                    "optimizer": {"lr": 1e-3}, "checkpoint_every_steps": 1_000_000}
    return cfg


def prepare(work: Path, tokenizer: str, out: Path) -> dict[str, Any]:
    """Chat rendering + tokenization + loss masks + Parquet shards of chat.jsonl, into an
    emptied `out` (a prepared directory left by an earlier run would be reused, not redone)."""
    import shutil
    shutil.rmtree(out, ignore_errors=True)
    from posttrain.config.loader import build
    from posttrain.train.sft import SFTConfig
    from steps.common import ensure_prepared
    cfg = sft_config(work)
    cfg["tokenizer"]["path"] = tokenizer
    sft = build(SFTConfig, cfg)
    import steps.prepare  # noqa: F401  imports are not timed (nor are TRL's)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401
    from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
    # what loading the tokenizer costs (prepare loads it inside its timed run; TRL is handed a
    # loaded one): measured on its own first, reported beside the total
    t0 = time.perf_counter()
    ChatTokenizer(TokenizerConfig(path=tokenizer))._backend
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ensure_prepared(sft, str(out), show_progress=False)
    seconds = time.perf_counter() - t0
    import json
    manifest = json.loads((out / "manifest.json").read_text())
    src = manifest["sources"][0]
    return {"seconds": seconds, "tokenizer_load_seconds": load_s,
            "seconds_without_tokenizer_load": seconds - load_s,
            "rows": src["rows_written"], "tokens": src["num_tokens"],
            "peak_rss_bytes": peak_rss()}


def sft(work: Path, prepared: str, steps: int, warmup: int = 1, compile: bool = False
        ) -> dict[str, Any]:
    from posttrain.config.loader import build
    from posttrain.plan import host_budget
    from posttrain.train.recipe import RecipeWorker
    from posttrain.train.sft import SFT
    cfg = sft_config(work, compile=compile)
    # the budget the driver hands its workers (`steps.common.run_recipe`)
    worker = RecipeWorker(SFT, cfg, str(work / "model"), prepared, cfg["run"]["dir"], None,
                          host_budget(build(SFT.config_cls, cfg)))
    for _ in range(warmup):
        worker.train_step()
    real = loss_tokens = 0
    seconds, flops, losses = 0.0, 0.0, []
    for _ in range(steps):
        t0 = time.perf_counter()
        m = worker.train_step()
        seconds += time.perf_counter() - t0
        real += m["real_tokens"]
        loss_tokens += m.get("loss_tokens", 0)
        flops += m["step_flops"]
        losses.append(m["loss"])
    rss = peak_rss()
    args = worker.engine.args
    worker.close()
    gemm = best_gemm_rate(args, cfg["train"]["tokens_per_step"])
    return {"steps": steps, "real_tokens": real, "loss_tokens": loss_tokens, "seconds": seconds,
            "real_tokens_per_s": real / seconds, "losses": losses, "peak_rss_bytes": rss,
            "flops": flops, "flops_per_s": flops / seconds, "gemm_flops_per_s": gemm,
            "mode": "packed 4 x 2048, document-masked attention, chunked loss"
                    + (", parallel.compile" if compile else "")}


def best_gemm_rate(args: Any, tokens: int, repeats: int = 5) -> float:
    """The fastest FLOP rate `torch.mm` reaches here over the model's own fp32 matmul shapes
    (a step's tokens through each projection, its input and weight gradients, and a 1,024-token
    chunk of the LM head): the best of `repeats` timings per shape, the best shape. A step that
    needs F matmul FLOPs cannot take less than F over this rate, whatever else it does."""
    H, I, V = args.hidden_size, args.intermediate_size, args.padded_vocab_size
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    shapes = [(m, k, n) for out in (q, kv, I) for m, k, n in
              ((tokens, H, out), (tokens, out, H), (out, tokens, H))] + [(1024, H, V)]
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = max(best, 2.0 * m * k * n / (time.perf_counter() - t0))
    return best


def dpo_config(work: Path, pack: int = 2048, rows: int = 1) -> dict[str, Any]:
    cfg = _base(work, "dpo", "preference", work / "data" / "preference.jsonl", 1024)
    cfg["train"] = {"max_steps": 10_000, "tokens_per_step": 2 * rows * pack,
                    "loader": {"format": "preference",
                               "packing": {"max_tokens_per_pack": pack, "buffer_samples": 64},
                               "rows_per_batch": rows, "shuffle_buffer_samples": 256, "seed": 0},
                    "optimizer": {"lr": 1e-4}, "checkpoint_every_steps": 1_000_000}
    cfg["loss"] = {"beta": 0.1, "loss_type": "sigmoid"}
    cfg["reference"] = {"kind": "precomputed"}
    return cfg


def dpo(work: Path, prepared: str, steps: int, warmup: int = 1) -> dict[str, Any]:
    """Pairs/s with the reference pass counted: the precomputed pass over all pairs costs
    ref_s / total_pairs per pair, charged for every pair trained in the timed steps."""
    from posttrain.train.dpo import DPO
    from posttrain.train.recipe import RecipeWorker
    from posttrain.config.loader import build
    from posttrain.train.dpo import DPOConfig
    from steps.common import ensure_prepared
    from posttrain.plan import host_budget
    cfg = dpo_config(work)
    dcfg = build(DPOConfig, cfg)
    ensure_prepared(dcfg, prepared, show_progress=False)
    worker = RecipeWorker(DPO, cfg, str(work / "model"), prepared, cfg["run"]["dir"], None,
                          host_budget(dcfg))
    t0 = time.perf_counter()
    worker.before_training()
    ref_s = time.perf_counter() - t0
    total_pairs = sum(1 for _ in (work / "data" / "preference.jsonl").open())
    for _ in range(warmup):
        worker.train_step()
    pairs, seconds = 0, 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        m = worker.train_step()
        if m is None:
            break
        seconds += time.perf_counter() - t0
        pairs += m["pairs"]
    rss = peak_rss()
    worker.close()
    charged = seconds + ref_s * pairs / total_pairs
    return {"pairs": pairs, "train_seconds": seconds, "reference_seconds_all_pairs": ref_s,
            "seconds": charged, "pairs_per_s": pairs / charged, "peak_rss_bytes": rss}


def grpo(work: Path, prepared_root: Path, prompts: int, completions: int, max_new: int,
         steps: int, compile: bool = False) -> dict[str, Any]:
    """GRPO steps with the colocated native engine: one optimizer step per batch of rollouts,
    no reference model, no KL; random model, so every completion runs to `max_new`."""
    from transformers import AutoTokenizer

    from posttrain.config.loader import build, to_dict
    from posttrain.plan import host_budget
    from posttrain.rl.prompts import read_prompt_rows
    from posttrain.train.grpo import GRPOConfig, GRPOWorker
    from steps.common import _Inline, ensure_prepared
    from steps.train_grpo import ColocatedRollouts, GRPOController
    cfg = _base(work, f"grpo_{prompts}x{completions}x{max_new}", "prompt",
                work / "data" / "prompts.jsonl", 256)
    n = prompts * completions
    cfg["train"] = {"max_steps": steps + 2, "prompts_per_step": prompts,
                    "samples_per_prompt": completions, "mini_batches": 1,
                    "max_tokens_per_micro_batch": max(4096, n * (max_new + 64)),
                    "optimizer": {"lr": 1e-5}, "checkpoint_every_steps": 1_000_000,
                    "parallel": {"compile": compile}}
    cfg["algorithm"] = {"kl_coef": 0.0, "reference": "none"}
    cfg["sampling"] = {"temperature": 1.0, "max_new_tokens": max_new,
                       "stop_tokens": ["<|im_end|>"]}
    cfg["rewards"] = {"functions": [{"name": "length_penalty", "weight": 1.0,
                                     "params": {"target_length": 64}}]}
    cfg["rollout"] = {"kind": "native", "placement": "colocated"}
    gcfg = build(GRPOConfig, cfg)
    prepared = ensure_prepared(gcfg, str(prepared_root), show_progress=False)
    worker = GRPOWorker(to_dict(gcfg), str(work / "model"), prepared, cfg["run"]["dir"], None,
                        host_budget(gcfg))
    group = _Inline(worker)
    tok = AutoTokenizer.from_pretrained(f"{prepared}/tokenizer")
    ctl = GRPOController(gcfg, group, ColocatedRollouts(group), tok,
                         read_prompt_rows(prepared, "train"), [], 1)
    worker.sync_rollout()
    warmup = 2 if compile else 1      # compiled: the second step's lengths go dynamic
    for s in range(warmup):
        ctl.step(s)
    records = [ctl.step(s) for s in range(warmup, warmup + steps)]
    rss = peak_rss()
    med = {k: statistics.median(r[k] for r in records) for k in
           ("time/step_s", "time/generate_s", "time/update_s", "time/logprobs_s",
            "rollout_tokens")}
    update_tokens = statistics.median(r["real_tokens"] for r in records)   # prompt + completion
    return {"seconds_per_step": med["time/step_s"], "generate_s": med["time/generate_s"],
            "update_s": med["time/update_s"] + med["time/logprobs_s"],
            "generated_tokens": med["rollout_tokens"], "update_tokens": update_tokens,
            "sync_s": statistics.median(r["time/sync_s"] for r in records),
            "generation_tokens_per_s": med["rollout_tokens"] / med["time/generate_s"],
            "update_tokens_per_s": update_tokens / (med["time/update_s"]
                                                    + med["time/logprobs_s"]),
            "steps": steps, "peak_rss_bytes": rss}


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
