"""DPO throughput benchmark: packed vs padded pairs, same model, same pairs, one invocation.

Runs the whole DPO path on the bundled preference set (`assets/data/preference/train.jsonl`,
1,000 pairs; prompt shared, chosen and rejected each ~30-60 tokens): prepare (chat template,
loss masks on the responses) -> `posttrain.train.recipe.RecipeWorker` running `DPO` (what the inline launcher runs:
the engine, FSDP2 over a process group of one, the preference loader, the chunked log-probs)
on a random Qwen3-shaped model. Each mode runs in its own fresh process (so each peak memory is
its own), reads the pairs in file order (no shuffle, one pass), computes the reference
log-probs (not timed), takes one warm-up step (not timed), then trains until the pass ends:

* packed: chosen and rejected of a pair are two documents of one unit, best-fit packed with
  other pairs into ``--rows`` rows of ``--pack`` tokens per micro-batch;
* padded: ``--pairs-per-batch`` pairs per micro-batch, each response in its own row, the batch
  padded to its longest row (the usual DPO collator).

Peak memory: on CUDA the allocator's peak over the timed steps; on CPU the process's peak RSS.

Prints ONE JSON line: per mode pairs trained, seconds, pairs/s, real tokens/s, effective-token
fraction and peak memory; and the packed/padded pairs/s ratio.

Run: ``python bench/dpo_throughput.py [--hidden 256 --layers 4] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def config(run_dir: Path, mode: str, args: argparse.Namespace) -> dict:
    rows = args.rows if mode == "packed" else args.pairs_per_batch
    heads = max(args.hidden // 64, 1)
    pairs = str(ROOT / "assets/data/preference/train.jsonl")
    return {
        "run": {"dir": str(run_dir), "num_workers": 1, "launcher": "inline"},
        "tokenizer": {"path": str(ROOT / "assets" / "tokenizer")},
        "data": {"format": "preference",
                 "train": [{"name": "pairs", "path": pairs}],
                 "max_tokens_per_sample": args.pack // 2},
        "model": {"init": {"family": "qwen3", "seed": 0, "overrides": {
            "hidden_size": args.hidden, "intermediate_size": 3 * args.hidden,
            "num_hidden_layers": args.layers, "num_attention_heads": heads,
            "num_key_value_heads": max(heads // 2, 1), "head_dim": 64,
            "tie_word_embeddings": True}}, "dtype": args.dtype},
        "train": {"max_steps": 100_000, "tokens_per_step": rows * args.pack,
                  "loader": {"format": "preference", "mode": mode, "rows_per_batch": rows,
                             "packing": {"max_tokens_per_pack": args.pack,
                                         "buffer_samples": 256}},
                  "optimizer": {"lr": 1e-4}, "checkpoint_every_steps": 1_000_000},
        "eval": {"max_batches": 1},
    }


def train_mode(cfg: dict, prepared: str, hf_dir: str, threads: int, out: mp.Queue) -> None:
    """Child process: reference pass, warm-up step, then timed steps to the end of the pass."""
    import torch
    torch.set_num_threads(threads)
    from posttrain.train.dpo import DPO
    from posttrain.train.recipe import RecipeWorker
    worker = RecipeWorker(DPO, cfg, hf_dir, prepared, cfg["run"]["dir"])
    worker.before_training()                                 # the reference pass
    worker.train_step()                                      # warm-up, not timed
    cuda = worker.engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    pairs = real = slots = steps = 0
    t0 = time.perf_counter()
    while (m := worker.train_step()) is not None:
        pairs += m["pairs"]
        real += m["real_tokens"]
        slots += round(m["real_tokens"] / (1.0 - m["padding_fraction"]))
        steps += 1
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    worker.close()
    out.put({"steps": steps, "pairs": pairs, "seconds": round(seconds, 3),
             "pairs_per_s": pairs / seconds, "real_tokens_per_s": real / seconds,
             "effective_token_fraction": real / max(slots, 1),
             "peak_memory_bytes": int(peak),
             "peak_memory_kind": "cuda max_memory_allocated" if cuda else "peak RSS",
             "device": str(worker.engine.device)})


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
    parser.add_argument("--pack", type=int, default=512, help="max_tokens_per_pack")
    parser.add_argument("--rows", type=int, default=4, help="packed rows per micro-batch")
    parser.add_argument("--pairs-per-batch", type=int, default=8,
                        help="padded pairs per micro-batch (2 rows each)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both modes")
    args = parser.parse_args()

    from posttrain.config.loader import build
    from posttrain.train.dpo import DPOConfig
    from steps.common import base_model_dir, ensure_prepared
    with tempfile.TemporaryDirectory(prefix="dpo_bench") as tmp_name:
        tmp = Path(tmp_name)
        cfgs = {m: config(tmp / m, m, args) for m in ("packed", "padded")}
        dpo = build(DPOConfig, cfgs["packed"])
        prepared = ensure_prepared(dpo, str(tmp / "prepared"), show_progress=False)
        hf_dir = base_model_dir(dpo, prepared, tmp)
        results = {m: run_child(cfgs[m], prepared, hf_dir, args.threads)
                   for m in ("packed", "padded")}
    print(json.dumps({
        "bench": "dpo_throughput",
        "model": f"qwen3 hidden {args.hidden}, {args.layers} layers, {args.dtype}, random init",
        "data": "assets/data/preference/train.jsonl, one pass in file order",
        "max_tokens_per_pack": args.pack, "packed_rows_per_micro_batch": args.rows,
        "padded_pairs_per_micro_batch": args.pairs_per_batch, "threads": args.threads,
        "reference": "precomputed (not timed)", **results,
        "packed_over_padded_pairs_per_s":
            results["packed"]["pairs_per_s"] / results["padded"]["pairs_per_s"]}))


if __name__ == "__main__":
    main()
