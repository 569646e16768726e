"""Evaluate an RL-trained checkpoint against its starting point on held-out prompts.

Both Hugging Face checkpoints answer every held-out prompt (`eval.samples_per_prompt`
completions at `eval.temperature`, greedy by default) with the configured rollout
engine kind (vLLM on a GPU, the native generator on CPU) and are scored with the recipe's reward
functions: mean reward, each function's mean, accuracy (the configured 0/1 reward), response
lengths. The table puts them side by side with the difference.

    python -m steps.evaluate_grpo --config configs/grpo/tiny.yaml \\
        --trained runs/grpo_tiny/hf --baseline runs/sft_arithmetic/hf
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from posttrain.config.recipes import load_recipe
from posttrain.data.prepared import local_view
from posttrain.eval.rl import reward_eval
from posttrain.rl import factory
from posttrain.rl.engine import Rollout, stop_token_ids
from posttrain.rl.prompts import read_prompt_rows
from posttrain.rl.rewards import combine
from posttrain.train.grpo import GRPOConfig


def load_engine(cfg: GRPOConfig, hf_dir: str) -> Any:
    """A rollout engine serving the weights of `hf_dir` (`posttrain.rl.factory.load_engine`)."""
    return factory.load_engine(cfg.rollout, hf_dir, dtype=cfg.model.dtype, seed=cfg.train.engine.seed)


def run(cfg: GRPOConfig, trained_dir: str, baseline_dir: str, prepared_dir: str
        ) -> dict[str, Any]:
    from transformers import AutoTokenizer

    local = local_view(prepared_dir)
    tokenizer = AutoTokenizer.from_pretrained(f"{local}/tokenizer")
    rows = read_prompt_rows(prepared_dir, "eval")[:cfg.eval.max_prompts]
    reward = combine(cfg.rewards.functions)
    ev = cfg.eval
    sampling = cfg.sampling.sampling(stop_token_ids(tokenizer, cfg.sampling.stop_tokens),
                                     seed=ev.seed, temperature=ev.temperature)
    results: dict[str, Any] = {}
    for name, hf_dir in (("baseline", baseline_dir), ("trained", trained_dir)):
        engine = load_engine(cfg, hf_dir)

        def generate(prompts: list[list[int]], engine=engine) -> list[list[Rollout]]:
            return engine.generate(prompts, sampling, ev.samples_per_prompt)

        metrics, records = reward_eval(generate, rows, tokenizer, reward,
                                       accuracy_reward=cfg.eval.accuracy_reward,
                                       num_records=cfg.eval.num_records)
        results[name] = {"hf_dir": hf_dir, "metrics": metrics, "records": records}
        del engine
    base, trained = results["baseline"]["metrics"], results["trained"]["metrics"]
    results["table"] = [{"metric": k.split("/", 1)[1], "baseline": round(base[k], 4),
                         "trained": round(trained[k], 4), "delta": round(trained[k] - base[k], 4)}
                        for k in trained if k in base]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--trained", required=True, help="HF checkpoint after RL")
    parser.add_argument("--baseline", required=True, help="the HF checkpoint it started from")
    parser.add_argument("--prepared", help="prepared prompts (default <run.dir>/prepared)")
    args = parser.parse_args(argv)
    cfg = load_recipe(args.config, GRPOConfig)
    result = run(cfg, args.trained, args.baseline, args.prepared or f"{cfg.run.dir}/prepared")
    for row in result["table"]:
        print(f"{row['metric']:<28}{row['baseline']:>10}{row['trained']:>10}{row['delta']:>+10}")
    print(json.dumps({r["metric"]: r for r in result["table"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
