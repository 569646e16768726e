"""Peak memory of a colocated GRPO run with the rollout engine's memory released or kept; one
JSON line.

    python bench/colocated_memory.py [--hidden 512] [--layers 8] [--steps 2]
                                     [--prompts 8] [--samples 8] [--new-tokens 64]

Variants, each a fresh subprocess running `steps.train_grpo.run` inline (one trainer rank with
a colocated native engine, fp32, a random Qwen3 of the given size, the bundled arithmetic
prompts, evaluation on 8 prompts):

* ``keep``: `rollout.release_memory: false`: the engine keeps its copy of the weights through
  the update;
* ``release``: `rollout.release_memory: true`: the engine frees them after generating and
  takes them back for the (full) weight sync.

The native engine's KV cache lives only inside a generate call, so what the release takes out
of the update phase is the engine's weights; the step's peak is the update's (trainer weights,
gradients, Adam state, activations) plus whatever the engine still holds. On CPU the extra
memory is the run's peak resident set minus the resident set before the run starts (it
includes building the model); on CUDA the allocator's peak.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from _memory import Measured, run_child

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("keep", "release")


def _overrides(args: argparse.Namespace, run_dir: str, release: bool) -> dict:
    heads = max(1, args.hidden // 64)
    return {
        "run.dir": run_dir, "train.max_steps": args.steps,
        "train.prompts_per_step": args.prompts, "train.samples_per_prompt": args.samples,
        "train.mini_batches": 1, "train.checkpoint_every_steps": 1000,
        "sampling.max_new_tokens": args.new_tokens, "eval.max_prompts": 8,
        "rollout.release_memory": release,
        "model": {"init": {"family": "qwen3", "seed": 0, "overrides": {
            "hidden_size": args.hidden, "intermediate_size": 3 * args.hidden,
            "num_hidden_layers": args.layers, "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2), "head_dim": 64,
            "max_position_embeddings": 1024, "tie_word_embeddings": False}},
            "dtype": "float32"},
    }


def child(args: argparse.Namespace) -> dict:
    import logging
    logging.disable(logging.WARNING)
    from steps import train_grpo
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp, Measured(device) as m:
        result = train_grpo.run(ROOT / "configs/grpo/tiny.yaml",
                                overrides=_overrides(args, tmp, args.variant == "release"),
                                show_progress=False)
    return {"variant": args.variant, "peak_extra_mib": round(m.peak_extra_bytes / 2**20, 1),
            "seconds": round(m.seconds, 1), "params": result["model"]["params"],
            "device": device}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()
    if args.variant:
        torch.set_num_threads(1)
        print(json.dumps(child(args)))
        return
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "variant"]
    rows = {v: run_child(__file__, v, argv) for v in VARIANTS}
    keep, release = rows["keep"]["peak_extra_mib"], rows["release"]["peak_extra_mib"]
    print(json.dumps({"bench": "colocated_memory", **{k: v for k, v in vars(args).items()
                                                      if k != "variant"},
                      "params": rows["keep"]["params"], "device": rows["keep"]["device"],
                      "peak_extra_mib": {"keep": keep, "release": release},
                      "saved_mib": round(keep - release, 1),
                      "seconds": {v: rows[v]["seconds"] for v in VARIANTS}}))


if __name__ == "__main__":
    main()
