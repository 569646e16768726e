"""Packing benchmark: how much of each row is real tokens, and how fast the packer runs.

Data: a synthetic chat set with skewed lengths (lognormal, median ~256, clipped to
[8, max_tokens_per_pack]), random token ids and a prompt/answer loss mask, made with a fixed
seed, so every run measures the same work. In one run it reports:

* effective-token fraction (non-pad / all tokens) of packed rows, of padded batches (same
  number of samples per batch as a typical packed row, each padded to the batch's longest),
  and of rows padded to max length; and the packed / padded ratios;
* packer throughput on one core (the process is pinned to one CPU): the synchronous `Packer`,
  and `AsyncPacker` end to end (background thread + consuming loop on the same core);
  best of ``--repeats``;
* TRL's BFD packing (`trl.pack_dataset(..., strategy="bfd")`) on the same token ids, if `trl`
  and `datasets` import; otherwise a note. TRL sorts the whole dataset at once (not streaming,
  unbounded memory) and emits only input_ids + seq_lengths, so it is an upper bound on fill and
  does less work per row than `Packer` (which also builds labels and position ids).

Run: ``python bench/packing.py [--samples 50000] [--max-tokens-per-pack 2048] [--repeats 3]``.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import numpy as np

from posttrain.data.packing import AsyncPacker, Packer, PackingConfig, Sample, pad_rows
from posttrain.data.stream import ListStream


def make_samples(num_samples: int, max_len: int, seed: int = 0) -> list[Sample]:
    """Skewed-length chat samples: the first 20-60% of each is prompt (loss_mask 0)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(256), 1.0, num_samples), 8, max_len).astype(np.int64)
    tokens = rng.integers(1, 150_000, int(lengths.sum()), dtype=np.int32)
    prompt_frac = rng.uniform(0.2, 0.6, num_samples)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    samples = []
    for i, n in enumerate(lengths.tolist()):
        mask = np.zeros(n, dtype=np.uint8)
        mask[int(n * prompt_frac[i]):] = 1
        samples.append(Sample(tokens[offsets[i]:offsets[i + 1]], mask, sample_id=i))
    return samples


def best_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run_sync(samples: list[Sample], cfg: PackingConfig) -> Packer:
    packer = Packer(ListStream(samples), cfg)
    for _ in packer:
        pass
    return packer


def run_async(samples: list[Sample], cfg: PackingConfig) -> None:
    with AsyncPacker(ListStream(samples), cfg) as packer:
        for _ in packer:
            pass


def padded_fraction(samples: list[Sample], cfg: PackingConfig, rows_per_batch: int) -> float:
    real = total = 0
    for row in pad_rows(samples, cfg, rows_per_batch):
        total += row.input_ids.shape[0]
        real += row.input_ids.shape[0] - row.num_pad
    return real / total


def trl_bfd(samples: list[Sample], max_len: int, repeats: int) -> dict[str, object]:
    """TRL's BFD packing on the same token ids, timed around `pack_dataset` only."""
    try:
        import datasets
        import trl
        from datasets import Dataset
        from trl import pack_dataset
    except ImportError as e:
        return {"trl_note": f"trl not importable ({e}); skipped. STACK-NOTES peer figure: "
                            f"10-13 M tokens/s"}
    datasets.disable_progress_bars()
    dataset = Dataset.from_dict({"input_ids": [s.input_ids.tolist() for s in samples]})
    tokens = sum(len(s.input_ids) for s in samples)
    seconds = best_time(lambda: pack_dataset(dataset, max_len, strategy="bfd"), repeats)
    rows = len(pack_dataset(dataset, max_len, strategy="bfd"))
    return {"trl_version": trl.__version__, "trl_bfd_tokens_per_s": round(tokens / seconds),
            "trl_bfd_rows": rows,
            "trl_bfd_effective_fraction": round(tokens / (rows * max_len), 4),
            "trl_note": "pack_dataset(strategy='bfd'): whole-dataset BFD over an Arrow table "
                        "(not streaming); input_ids and seq_lengths only, labels and position "
                        "ids are left to its collator"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=50_000)
    parser.add_argument("--max-tokens-per-pack", type=int, default=2048)
    parser.add_argument("--buffer-samples", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    cfg = PackingConfig(max_tokens_per_pack=args.max_tokens_per_pack,
                        buffer_samples=args.buffer_samples)
    samples = make_samples(args.samples, cfg.max_tokens_per_pack)
    lengths = np.array([len(s.input_ids) for s in samples])
    tokens = int(lengths.sum())

    stats = run_sync(samples, cfg).stats
    sync_s = best_time(lambda: run_sync(samples, cfg), args.repeats)
    async_s = best_time(lambda: run_async(samples, cfg), args.repeats)

    rows = stats["rows_out"]
    packed = stats["real_tokens_out"] / (rows * cfg.max_tokens_per_pack)
    docs_per_row = stats["samples_packed"] / rows
    rows_per_batch = max(1, round(docs_per_row))
    padded_batch = padded_fraction(samples, cfg, rows_per_batch)
    padded_max = tokens / (len(samples) * cfg.max_tokens_per_pack)
    result = {
        "bench": "packing",
        "samples": len(samples),
        "tokens": tokens,
        "length_p50": int(np.median(lengths)),
        "length_mean": round(float(lengths.mean()), 1),
        "length_p99": int(np.percentile(lengths, 99)),
        "max_tokens_per_pack": cfg.max_tokens_per_pack,
        "buffer_samples": cfg.buffer_samples,
        "rows_packed": rows,
        "docs_per_row": round(docs_per_row, 2),
        "effective_fraction_packed": round(packed, 4),
        "effective_fraction_padded_batch_longest": round(padded_batch, 4),
        "effective_fraction_padded_max_length": round(padded_max, 4),
        "padded_rows_per_batch": rows_per_batch,
        "packed_over_padded_batch_longest": round(packed / padded_batch, 2),
        "packed_over_padded_max_length": round(packed / padded_max, 2),
        "packer_tokens_per_s_sync": round(tokens / sync_s),
        "packer_rows_per_s_sync": round(rows / sync_s),
        "packer_tokens_per_s_async_end_to_end": round(tokens / async_s),
        "pinned_cpu": cpu,
        "repeats": args.repeats,
    }
    result.update(trl_bfd(samples, cfg.max_tokens_per_pack, args.repeats))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
