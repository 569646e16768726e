"""GRPO step benchmark: where a step's time goes, and how fast rollouts are generated.

Runs the real controller (`steps.train_grpo.GRPOController`: one inline trainer rank, FSDP2 over
a process group of one, a colocated native rollout engine) on the tiny GRPO recipe
(configs/grpo/tiny.yaml: 16 prompts x 8 samples, up to 24 new tokens, exact-match + format
rewards) with a random Qwen3-shaped model of the tiny shape (hidden 128, 4 layers), so nothing
depends on an earlier SFT run. A random model rarely stops early, so every rollout runs to the
token budget: the generation time is that of full-length rollouts.

After one warm-up step it times ``--steps`` steps and reports the median seconds per phase
(generate, score, log-probs, update, weight sync) and rollout tokens/s.

Peer, measured in the same process on the same model, prompts and sampling settings: Hugging
Face `generate` (what TRL's GRPOTrainer uses when vLLM is off) with the same weights, sampling
the same number of completions per prompt with its KV cache, batched the same way.

Prints ONE JSON line. Run: ``python bench/grpo_step.py [--steps 5] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("generate", "score", "logprobs", "update", "sync")


def hf_generate_tokens_per_s(hf_dir: str, prompts: list[list[int]], n: int, max_new: int,
                             stop_ids: tuple[int, ...], repeats: int = 2) -> float:
    """Hugging Face `generate` throughput (generated tokens/s), sampling n per prompt."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, p in enumerate(prompts):                 # left padding, as for decoder generation
        ids[i, longest - len(p):] = torch.tensor(p)
        attention[i, longest - len(p):] = 1
    best = 0.0
    for r in range(repeats):
        torch.manual_seed(r)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=attention, do_sample=True,
                                 temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new,
                                 num_return_sequences=n, eos_token_id=list(stop_ids),
                                 pad_token_id=stop_ids[0])
        seconds = time.perf_counter() - t0
        new = out[:, longest:]
        # tokens up to and including the first stop token
        generated = 0
        for row in new.tolist():
            k = next((j + 1 for j, t in enumerate(row) if t in stop_ids), len(row))
            generated += k
        best = max(best, generated / seconds)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from posttrain.config.recipes import load_recipe
    from posttrain.config.loader import to_dict
    from posttrain.train.grpo import GRPOConfig, GRPOWorker
    from steps.common import _Inline, base_model_dir, ensure_prepared
    from steps.train_grpo import ColocatedRollouts, GRPOController
    from posttrain.rl.prompts import read_prompt_rows

    tmp = Path(tempfile.mkdtemp(prefix="grpo_bench"))
    init = {"family": "qwen3", "seed": 0,
            "overrides": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                          "tie_word_embeddings": True}}
    cfg = load_recipe(ROOT / "configs/grpo/tiny.yaml", GRPOConfig,
                      {"run.dir": str(tmp), "model.hf_dir": None, "model.init": init,
                       "train.max_steps": args.steps + 1})
    prepared = ensure_prepared(cfg, str(tmp / "prepared"), show_progress=False)
    hf_dir = base_model_dir(cfg, prepared, tmp)
    worker = GRPOWorker(to_dict(cfg), hf_dir, prepared, str(tmp))
    group = _Inline(worker)
    tokenizer = AutoTokenizer.from_pretrained(f"{prepared}/tokenizer")
    ctl = GRPOController(cfg, group, ColocatedRollouts(group), tokenizer,
                         read_prompt_rows(prepared, "train"), [], 1)
    worker.sync_rollout()
    ctl.step(0)                                      # warm-up
    records = [ctl.step(s) for s in range(1, args.steps + 1)]
    med = {p: statistics.median(r[f"time/{p}_s"] for r in records) for p in PHASES}
    step_s = statistics.median(r["time/step_s"] for r in records)
    ours = statistics.median(r["rollout_tokens_per_s"] for r in records)

    prompts = [r.prompt_ids for r in read_prompt_rows(prepared, "train")[:cfg.train.prompts_per_step]]
    peer = hf_generate_tokens_per_s(hf_dir, prompts, cfg.train.samples_per_prompt,
                                    cfg.sampling.max_new_tokens, ctl.stop_ids)
    print(json.dumps({
        "bench": "grpo_step", "model": "qwen3 hidden 128 x 4 layers (random init)",
        "threads": args.threads, "steps_timed": args.steps,
        "prompts_per_step": cfg.train.prompts_per_step,
        "samples_per_prompt": cfg.train.samples_per_prompt,
        "max_new_tokens": cfg.sampling.max_new_tokens,
        "median_step_s": round(step_s, 4),
        "median_phase_s": {p: round(v, 4) for p, v in med.items()},
        "phase_fraction": {p: round(v / step_s, 3) for p, v in med.items()},
        "rollout_tokens_per_step": records[-1]["rollout_tokens"],
        "rollout_tokens_per_s": round(ours, 1),
        "hf_generate_tokens_per_s": round(peer, 1),
        "rollout_speedup_vs_hf_generate": round(ours / peer, 2),
    }))


if __name__ == "__main__":
    main()
