"""GPU check: bf16 SFT of a Qwen3-0.6B-shaped model with packing; prints one JSON line.

Random weights (no download) in the exact Qwen3-0.6B shape (28 layers, hidden 1024, 16 query /
8 KV heads of 128, MLP 3072, vocabulary 151,936, tied embeddings), FSDP2 over one GPU with bf16
compute and fp32 master weights, activation checkpointing, document-masked attention on packed
rows of skewed synthetic documents, chunked cross-entropy. Reports real tokens/s and MFU
(model FLOPs of the real tokens over the GPU's dense bf16 peak).

    python bench/gpu_sft_mfu.py --steps 12 --tokens-per-step 65536 --pack 8192
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pack", type=int, default=8192)
    p.add_argument("--tokens-per-step", type=int, default=65536)
    p.add_argument("--ac", default="full", choices=["none", "full"])
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run a tiny shape on the CPU to check the script itself")
    a = p.parse_args()
    if not torch.cuda.is_available() and not a.cpu_smoke:
        print(json.dumps({"bench": "gpu_sft_mfu", "skipped": "no CUDA device"}))
        return

    from posttrain.data.packing import Packer, PackingConfig, Sample, collate
    from posttrain.data.stream import ListStream
    from posttrain.distributed.parallelize import ParallelConfig
    from posttrain.models.flops import flops_per_token
    from posttrain.train.engine import Engine, EngineConfig, ModelConfig, ModelInitConfig, \
        write_random_hf_model
    from posttrain.train.metrics import device_peak_flops
    from posttrain.train.optim import OptimizerConfig

    shape = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "tie_word_embeddings": True, "max_position_embeddings": 40960}
    vocab = 151_936
    if a.cpu_smoke:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        vocab = 1000
    init = ModelInitConfig(family="qwen3", overrides=shape, seed=0)
    tmp = tempfile.mkdtemp()
    hf_dir = write_random_hf_model(init, vocab, f"{tmp}/base")
    cfg = EngineConfig(max_steps=a.steps, optimizer=OptimizerConfig(lr=1e-5),
                       parallel=ParallelConfig(mixed_precision="fp32" if a.cpu_smoke else "bf16",
                                               activation_checkpointing=a.ac))
    from posttrain.distributed.env import init_process_group
    init_process_group()
    engine = Engine(ModelConfig(init=init), cfg, hf_dir, f"{tmp}/run")

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.0, 1.0, 20_000), 16, a.pack).astype(int)
    samples = [Sample(rng.integers(0, vocab - 1, n).astype(np.int32), np.ones(n, np.uint8))
               for n in lengths]
    rows = iter(Packer(ListStream(samples), PackingConfig(max_tokens_per_pack=a.pack)))
    micro = a.tokens_per_step // a.pack
    peak, source = device_peak_flops(engine.device)
    results = []
    for step in range(a.steps):
        batches = [collate([next(rows)]) for _ in range(micro)]
        _sync()
        t0 = time.perf_counter()
        engine.train_step(batches, sum(b["num_loss_tokens"] for b in batches))
        _sync()
        dt = time.perf_counter() - t0
        real = sum(b["num_real_tokens"] for b in batches)
        flops = 0.0
        for b in batches:
            for lens, pad in zip(b["document_lengths"], b["row_num_pad"]):
                docs = list(lens[:-1]) if pad else list(lens)
                flops += sum(docs) * flops_per_token(engine.args, sum(docs), training=True,
                                                     document_lengths=docs)
        if step >= a.warmup:
            results.append((real / dt, flops / dt / peak))
    tps = float(np.mean([r[0] for r in results]))
    mfu = float(np.mean([r[1] for r in results]))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    memory = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    print(json.dumps({"bench": "gpu_sft_mfu", "gpu": gpu,
                      "peak_flops_source": source, "params": engine.num_params,
                      "pack": a.pack, "tokens_per_step": a.tokens_per_step,
                      "activation_checkpointing": a.ac, "real_tokens_per_s": round(tps),
                      "mfu": round(mfu, 4),
                      "peak_memory_gib": round(memory / 2**30, 2)}))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
