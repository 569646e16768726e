"""SFT throughput benchmark: packed vs padded training on a skewed-length chat set.

The bundled chat data is nearly uniform in length (median ~60 tokens, nothing near a
1,024-token pack), so padding would waste little on it. This bench therefore writes a skewed
synthetic chat set with a fixed seed: 90% short exchanges (lognormal, median ~50 tokens) and a
10% long tail (uniform 256..1024 tokens), made of words from the bundled chat data, then runs
the whole SFT path on it: prepare (tokenize with the chat template, loss masks) ->
`posttrain.train.recipe.RecipeWorker` running `SFT` (what the inline launcher runs: the engine, FSDP2 over a
process group of one, the loader, the chunked loss) on a random Qwen3-shaped model
(hidden 256, 4 layers, like the TRL peer numbers in STACK-NOTES).

Both modes use the same micro-batch shape, ``--rows`` rows of at most ``--pack`` tokens, and
``--micro-batches`` micro-batches per optimizer step. Each mode runs in its own fresh process
(so each peak RSS is its own) with the same torch thread count:

* packed: best-fit packing of several samples into each row; one warm-up step, then
  ``--packed-steps`` timed steps;
* padded: one sample per row, the batch padded to its longest sample (the usual "pad to
  longest" collator); one warm-up step, then timed steps until at least as many REAL tokens as
  the packed run trained.

Threads default to 1: this machine's 2 cores are shared, and with 2 OpenMP threads a step's time
swung 1 s -> 24 s whenever another process took a core (spinning threads wait on each other);
with 1 thread repeated runs agree within ~20%.

Prints ONE JSON line: per mode the real tokens, seconds, real tokens/s, effective-token fraction
(non-pad / all tokens) and the worker's peak RSS; the packed/padded throughput ratio; and the
length distribution of the data. With ``--profile-steps N`` each mode then runs as many token
slots as N packed steps hold under the torch profiler and reports microseconds per token slot
(real or padding), split into the LM head with its loss, the attention kernels and the rest:
packing pays the effective-token ratio exactly when a packed slot costs what a padded one does.

Run: ``python bench/sft_throughput.py [--packed-steps 6] [--threads 1] [--profile-steps 3]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import re
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def write_skewed_chat(path: Path, num_samples: int, max_tokens: int, seed: int = 0) -> None:
    """Chat rows whose token lengths follow the skewed mixture in the module docstring."""
    from transformers import AutoTokenizer
    rng = np.random.default_rng(seed)
    text = (ROOT / "assets" / "data" / "chat" / "train.jsonl").read_text()
    words = sorted(set(re.findall(r"[A-Za-z]+", text)))
    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "tokenizer"))
    probe = " ".join(rng.choice(words, 2000))
    tokens_per_word = len(tok(probe)["input_ids"]) / 2000
    overhead = 24                               # chat-template tokens of a 2-turn exchange
    long = rng.random(num_samples) < 0.10
    lengths = np.where(long, rng.integers(256, max_tokens + 1, num_samples),
                       np.clip(rng.lognormal(np.log(50), 0.5, num_samples), 24, 255))
    with path.open("w") as f:
        for n in lengths.astype(int):
            body = max(int((n - overhead) / tokens_per_word), 4)
            n_user = max(2, int(body * rng.uniform(0.2, 0.5)))
            user = " ".join(rng.choice(words, n_user))
            answer = " ".join(rng.choice(words, body - n_user))
            f.write(json.dumps({"messages": [{"role": "user", "content": user + "?"},
                                             {"role": "assistant", "content": answer + "."}]})
                    + "\n")


def config(run_dir: Path, data: Path, mode: str, args: argparse.Namespace) -> dict:
    rows = args.rows
    return {
        "run": {"dir": str(run_dir), "num_workers": 1, "launcher": "inline"},
        "tokenizer": {"path": str(ROOT / "assets" / "tokenizer")},
        "data": {"format": "chat", "train": [{"name": "skewed", "path": str(data)}],
                 "max_tokens_per_sample": args.pack, "overlong": "truncate"},
        "model": {"init": {"family": "qwen3", "seed": 0, "overrides": {
            "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "tie_word_embeddings": True}}, "dtype": "float32"},
        "train": {"max_steps": 1000,
                  "tokens_per_step": args.micro_batches * rows * args.pack,
                  "loader": {"packing": {"max_tokens_per_pack": args.pack,
                                         "buffer_samples": 256},
                             "mode": mode, "rows_per_batch": rows,
                             "shuffle_buffer_samples": 512, "seed": 0},
                  "optimizer": {"lr": 1e-3}, "checkpoint_every_steps": 10_000},
    }


def train_mode(cfg: dict, prepared: str, hf_dir: str, target_real: int | None,
               steps: int, threads: int, profile_slots: int, out: mp.Queue) -> None:
    """Child process: warm-up step, then timed steps; reports tokens, time and peak RSS."""
    import torch
    torch.set_num_threads(threads)
    from posttrain.train.recipe import RecipeWorker
    from posttrain.train.sft import SFT
    worker = RecipeWorker(SFT, cfg, hf_dir, prepared, cfg["run"]["dir"])
    worker.train_step()                                      # warm-up, not timed
    real = slots = done = 0
    losses, rates = [], []
    t0 = time.perf_counter()
    while (done < steps) if target_real is None else (real < target_real):
        m = worker.train_step()
        assert m is not None, "the synthetic set ran out: raise --samples"
        real += m["real_tokens"]
        slots += round(m["real_tokens"] / (1.0 - m["padding_fraction"]))
        losses.append(m["loss"])
        rates.append(m["real_tokens_per_s"])
        done += 1
    seconds = time.perf_counter() - t0
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cost = slot_costs(worker, profile_slots) if profile_slots else None
    worker.close()
    out.put({"steps": done, "real_tokens": real, "token_slots": slots, "seconds": seconds,
             "real_tokens_per_s": real / seconds,
             "median_step_real_tokens_per_s": float(np.median(rates)),
             "effective_token_fraction": real / slots,
             "peak_rss_bytes": peak_rss,
             "first_loss": losses[0], "last_loss": losses[-1],
             **({"us_per_token_slot": cost} if cost else {})})


def slot_costs(worker, min_slots: int) -> dict:
    """Microseconds per token slot (real or padding) over more steps, until `min_slots` token
    slots, under the torch profiler, split into the LM head with its loss (the `chunked_cross_entropy` range: it
    forms the head's gradients too), the attention kernels (forward and backward), and the
    rest (the blocks' matmuls and elementwise work, the optimizer, data)."""
    from torch.profiler import ProfilerActivity, profile
    slots = steps = 0
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while slots < min_slots:
            m = worker.train_step()
            steps += 1
            assert m is not None, "the synthetic set ran out: raise --samples"
            slots += round(m["real_tokens"] / (1.0 - m["padding_fraction"]))
    wall_us = (time.perf_counter() - t0) * 1e6
    events = prof.key_averages()
    head = sum(e.cpu_time_total for e in events if e.key == "chunked_cross_entropy")
    attention = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key)
    return {"profiled_steps": steps, "profiled_slots": slots, "total": wall_us / slots, "lm_head_and_loss": head / slots,
            "attention": attention / slots, "rest": (wall_us - head - attention) / slots}


def run_child(*args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=train_mode, args=(*args, q))
    p.start()
    result = q.get()
    p.join()
    assert p.exitcode == 0
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--pack", type=int, default=1024, help="max_tokens_per_pack")
    parser.add_argument("--rows", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=1, help="per optimizer step")
    parser.add_argument("--packed-steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both modes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="then profile as many token slots as this many packed steps "
                             "hold, in each mode, and report microseconds per token slot: "
                             "LM head + loss, attention, rest")
    args = parser.parse_args()

    from steps.common import base_model_dir, ensure_prepared
    from posttrain.config.loader import build
    from posttrain.train.sft import SFTConfig
    with tempfile.TemporaryDirectory(prefix="sft_bench") as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "skewed.jsonl"
        write_skewed_chat(data, args.samples, args.pack, args.seed)
        cfgs = {m: config(tmp / m, data, m, args) for m in ("packed", "padded")}
        profile_slots = args.profile_steps * args.micro_batches * args.rows * args.pack
        sft = build(SFTConfig, cfgs["packed"])
        prepared = ensure_prepared(sft, str(tmp / "prepared"), show_progress=False)
        hf_dir = base_model_dir(sft, prepared, tmp)
        packed = run_child(cfgs["packed"], prepared, hf_dir, None, args.packed_steps,
                           args.threads, profile_slots)
        padded = run_child(cfgs["padded"], prepared, hf_dir, packed["real_tokens"], 0,
                           args.threads, profile_slots)
        lengths = data_lengths(prepared)
    print(json.dumps({
        "bench": "sft_throughput", "model": "qwen3 hidden 256, 4 layers, fp32, random init",
        "data": "synthetic skewed chat (seed %d): 90%% short, 10%% long tail to the pack length"
                % args.seed,
        "sample_tokens": lengths, "max_tokens_per_pack": args.pack,
        "rows_per_micro_batch": args.rows, "micro_batches_per_step": args.micro_batches,
        "threads": args.threads, "launcher": "inline (one process per mode)",
        "packed": packed, "padded": padded,
        "packed_over_padded_real_tokens_per_s":
            packed["real_tokens_per_s"] / padded["real_tokens_per_s"]}))


def data_lengths(prepared: str) -> dict:
    import pyarrow.parquet as pq
    manifest = json.loads((Path(prepared) / "manifest.json").read_text())
    n = np.concatenate([np.array([len(x) for x in pq.read_table(sh["uri"], columns=[
        "input_ids"]).column("input_ids").to_pylist()])
        for s in manifest["sources"] for sh in s["shards"]])
    return {"count": int(n.size), "mean": round(float(n.mean()), 1),
            "median": int(np.median(n)), "p90": int(np.percentile(n, 90)), "max": int(n.max())}


if __name__ == "__main__":
    main()
