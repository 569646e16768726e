"""VLLMEngine against NativeEngine on one tiny random Qwen3, in a python that has vLLM.

Run by `test_vllm_engine.py` as `python tests/lib/rl/vllm_check.py OUT_DIR` in the vLLM venv
(`make vllm-env`); prints one JSON line of measurements for the test to assert on:

* generate(): n samples per prompt, finish reasons and stop tokens, and its log-probs against
  the native model's teacher-forced log-probs on the same weights (greedy, temperature, and
  top-p, where the engine rescores);
* logprobs() at temperature 1 and 0.7 against the native model;
* update_weights() with perturbed weights: the engine's log-probs then match the native model
  with the new weights, differ from before, and generation (whose prompts sit in the prefix
  cache) uses the new weights too;
* the GRPO weight sync into vLLM: a trainer process (`WeightSender`, in a process of its own)
  broadcasts newly perturbed weights bucket by bucket over a gloo sync group, and this engine
  receives them (`WeightReceiver`: staged in host memory, then one in-place reload);
* generated tokens/s for 16 prompts x 4 samples x 32 tokens.
"""

from __future__ import annotations

import os

# In-process engine: ~5 s to start instead of ~25 s. vLLM then binds this process to all cores
# but one and forbids torch.set_num_threads, so OMP_NUM_THREADS must match that count: with
# more threads than bound cores, 2 threads on 1 core ran 35x slower (400 vs 14k tokens/s).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) - 1)))

import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from posttrain.models import load_hf  # noqa: E402
from posttrain.models.verify import random_hf_model, tiny_hf_config  # noqa: E402
from posttrain.rl.engine import Rollout, SamplingConfig  # noqa: E402
from posttrain.rl.native import NativeEngine  # noqa: E402
from posttrain.rl.vllm_engine import VLLMEngine  # noqa: E402
from posttrain.rl.weight_sync import WeightReceiver, WeightSender  # noqa: E402

VOCAB = 250
STOPS = tuple(range(0, 250, 10))          # 25 ids: most samples stop within 16 tokens


def make_checkpoint(out: Path) -> Path:
    # a larger init than the default 0.02, so that distributions are peaked, not near uniform
    # head_dim 64: the CPU attention kernels have no head_dim 16 (the tiny default)
    config = tiny_hf_config("qwen3", initializer_range=0.15, hidden_size=128, head_dim=64)
    model = random_hf_model(config, seed=0)
    model.save_pretrained(out)
    return out


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b], "different lengths"
    return max((abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)), default=0.0)


def native_scores(native: NativeEngine, rollouts: list[Rollout],
                  temperature: float) -> list[list[float]]:
    return native.logprobs([r.prompt_ids + r.completion_ids for r in rollouts],
                           [len(r.prompt_ids) for r in rollouts], temperature=temperature)


def check_shapes(out: list[list[Rollout]], prompts: list[list[int]], n: int,
                 sampling: SamplingConfig) -> dict[str, int]:
    assert len(out) == len(prompts) and all(len(samples) == n for samples in out)
    stops = set(sampling.stop_token_ids)
    counts = {"stop": 0, "length": 0}
    for prompt, samples in zip(prompts, out):
        for r in samples:
            assert r.prompt_ids == prompt
            assert 1 <= len(r.completion_ids) <= sampling.max_new_tokens
            assert len(r.logprobs) == len(r.completion_ids)
            assert not stops & set(r.completion_ids[:-1]), "a stop token inside a completion"
            if r.finish_reason == "stop":
                assert r.completion_ids[-1] in stops, "stop without its stop token kept"
            else:
                assert r.finish_reason == "length"
                assert len(r.completion_ids) == sampling.max_new_tokens
            counts[r.finish_reason] += 1
    return counts


def _trainer(hf_dir: str, weights: str, shapes: dict, dtype: torch.dtype, queue) -> None:
    """A trainer rank of one: the model with the weights in `weights`, sent over a sync group
    in 4 KB buckets (many per sync)."""
    torch.set_num_threads(1)
    model = load_hf(hf_dir, dtype=torch.float32)
    new = torch.load(weights, weights_only=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(new[name])
    sender = WeightSender(model, rank=0, device="cpu")
    plan = sender.make_plan(shapes, dtype, bucket_bytes=4096)
    queue.put((plan, sender.serve(1, "127.0.0.1")))
    sender.join()
    queue.put(sender.send(full=True))
    sender.close()


def sync_over_group(engine: VLLMEngine, hf_dir: Path, new: dict[str, torch.Tensor],
                    out_dir: Path) -> int:
    """`new` into the engine through the sync group, from a trainer process; the bytes."""
    import multiprocessing as mp
    weights = out_dir / "trainer_weights.pt"
    torch.save(new, weights)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(str(hf_dir), str(weights),
                                                 engine.parameter_shapes, engine.dtype, queue))
    trainer.start()
    try:
        plan, address = queue.get(timeout=120)
        receiver = WeightReceiver(engine, plan)
        receiver.join(address, 1, timeout_s=120)
        received = receiver.receive(full=True)
        sent = queue.get(timeout=120)
        assert sent == received, (sent, received)
        receiver.group.close()
        return received
    finally:
        trainer.join(timeout=60)


def main(out_dir: Path) -> dict:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (int(L),), generator=gen).tolist()
               for L in (3, 7, 1, 12, 5)]
    hf_dir = make_checkpoint(out_dir / "qwen3-hf")
    native = NativeEngine(load_hf(hf_dir, dtype=torch.float32))
    t0 = time.perf_counter()
    engine = VLLMEngine(hf_dir, dtype="float32", enforce_eager=True,
                        kv_cache_memory_bytes=1 << 30, max_model_len=256, seed=0)
    result: dict = {"engine_start_s": time.perf_counter() - t0}

    # ---- generate: shapes, stop tokens, log-probs against the native model
    for name, sampling in {
        "temp": SamplingConfig(temperature=0.8, max_new_tokens=16, stop_token_ids=STOPS, seed=1),
        "greedy": SamplingConfig(temperature=0.0, max_new_tokens=16, stop_token_ids=STOPS),
        "top_p": SamplingConfig(temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=16,
                                stop_token_ids=STOPS, seed=2),
    }.items():
        out = engine.generate(prompts, sampling, n=4)
        result[f"finish_{name}"] = check_shapes(out, prompts, 4, sampling)
        flat = [r for samples in out for r in samples]
        result[f"gen_logprob_diff_{name}"] = max_diff(
            [r.logprobs for r in flat], native_scores(native, flat, sampling.logprob_temperature))
        result[f"gen_logprob_min_{name}"] = min(x for r in flat for x in r.logprobs)
        if name == "temp":
            again = engine.generate(prompts, sampling, n=4)
            result["same_seed_same_rollouts"] = (
                [[r.completion_ids for r in s] for s in again]
                == [[r.completion_ids for r in s] for s in out])
            result["samples_differ"] = len({tuple(r.completion_ids) for r in out[3]}) > 1
            rollouts = flat

    # ---- logprobs: teacher forcing at two temperatures
    seqs = [r.prompt_ids + r.completion_ids for r in rollouts]
    plens = [len(r.prompt_ids) for r in rollouts]
    for t in (1.0, 0.7):
        result[f"score_diff_t{t}"] = max_diff(engine.logprobs(seqs, plens, temperature=t),
                                              native.logprobs(seqs, plens, temperature=t))

    # ---- update_weights: perturbed weights reach the engine
    before = engine.logprobs(seqs, plens)
    new = {name: p.detach() + 0.05 * torch.randn(p.shape, generator=gen)
           for name, p in native.model.named_parameters()}
    t0 = time.perf_counter()
    engine.update_weights(new.items())
    result["sync_s"] = time.perf_counter() - t0
    result["sync_params"] = sum(t.numel() for t in new.values())
    native.update_weights(new.items())
    after = engine.logprobs(seqs, plens)
    result["update_diff_vs_native"] = max_diff(after, native.logprobs(seqs, plens))
    result["update_change"] = max_diff(after, before)
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=16, stop_token_ids=STOPS, seed=3)
    flat = [r for s in engine.generate(prompts, sampling, n=2) for r in s]
    result["update_gen_diff_vs_native"] = max_diff([r.logprobs for r in flat],
                                                   native_scores(native, flat, 0.8))

    # ---- the GRPO weight sync: a trainer process -> sync group -> vLLM's in-place reload
    newer = {name: p.detach() + 0.05 * torch.randn(p.shape, generator=gen)
             for name, p in native.model.named_parameters()}
    t0 = time.perf_counter()
    result["group_sync_bytes"] = sync_over_group(engine, hf_dir, newer, out_dir)
    result["group_sync_s"] = time.perf_counter() - t0
    result["group_sync_expected_bytes"] = sum(
        math.prod(shape) for shape in engine.parameter_shapes.values()) * 4
    native.update_weights(newer.items())
    synced = engine.logprobs(seqs, plens)
    result["group_sync_diff_vs_native"] = max_diff(synced, native.logprobs(seqs, plens))
    result["group_sync_change"] = max_diff(synced, after)

    # ---- throughput
    bench_prompts = [torch.randint(0, VOCAB, (16,), generator=gen).tolist() for _ in range(16)]
    bench = SamplingConfig(temperature=1.0, max_new_tokens=32, seed=4)
    engine.generate(bench_prompts[:2], bench, n=1)                  # warm-up
    t0 = time.perf_counter()
    out = engine.generate(bench_prompts, bench, n=4)
    tokens = sum(len(r.completion_ids) for s in out for r in s)
    result["bench_tokens"] = tokens
    result["bench_tokens_per_s"] = tokens / (time.perf_counter() - t0)
    return result


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(main(out)), flush=True)
