"""NativeEngine: KV-cache decoding against full recomputation, log-probs against teacher forcing,
stop / length handling, seeding, padded vocabularies, weight updates, and a throughput report."""

from __future__ import annotations

import time

import pytest
import torch

from posttrain.models.args import DeltaNetArgs, Gemma4Args, MLAArgs, ModelArgs
from posttrain.models.transformer import Transformer, build_model
from posttrain.rl.engine import Rollout, RolloutEngine, SamplingConfig
from posttrain.rl.native import NativeEngine

PROMPTS = [[5, 17, 3, 42, 8, 11, 60], [7], [1, 2, 3, 4], [99, 0, 31, 31, 5, 9, 12, 13, 14, 2, 3]]


def tiny_args(family: str, **overrides) -> ModelArgs:
    common = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16)
    per_family = {
        "qwen3": dict(qk_norm=True, rope_theta=1e6),
        "qwen3_moe": dict(qk_norm=True, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, mlp_only_layers=(0,)),
        "llama": dict(tie_word_embeddings=True, attention_bias=True,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}),
        # window 4 < every sequence here; two sliding layers with their own rope base, one full
        "gemma3": dict(qk_norm=True, hidden_act="gelu_pytorch_tanh", sliding_window=4,
                       layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                       rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=20.0,
                       embed_scale=True, norm_offset=True, sandwich_norm=True,
                       final_logit_softcapping=5.0, tie_word_embeddings=True),
        # sinks, alternating window / full layers, yarn rope, biased experts, clamped SwiGLU
        "gpt_oss": dict(attention_bias=True, attention_sinks=True, sliding_window=4,
                        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                        rope_theta=150_000.0,
                        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False,
                                      "original_max_position_embeddings": 64},
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        router_bias=True, expert_bias=True, moe_routing="topk_softmax",
                        swiglu_limit=7.0),
        # two gated-DeltaNet layers around a gated full-attention layer with partial RoPE;
        # chunks of 4 tokens, so prompts and completions span several
        "qwen3_5": dict(qk_norm=True, norm_offset=True, layer_types=(
                            "linear_attention", "full_attention", "linear_attention"),
                        partial_rotary_factor=0.25, attn_output_gate=True,
                        linear_attention=DeltaNetArgs(num_k_heads=2, num_v_heads=4, head_k_dim=8,
                                                      head_v_dim=8, chunk_size=4)),
        "qwen3_5_moe": dict(qk_norm=True, norm_offset=True, layer_types=(
                                "linear_attention", "linear_attention", "full_attention"),
                            partial_rotary_factor=0.25, attn_output_gate=True,
                            linear_attention=DeltaNetArgs(num_k_heads=2, num_v_heads=2,
                                                          head_k_dim=8, head_v_dim=16,
                                                          chunk_size=4),
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48, shared_expert_gate=True),
        # window 4; full layers 1 and 3 with one kv head of 32 (values = keys' projection) and
        # proportional RoPE; layers 2 and 3 reuse the keys and values of layers 0 and 1 (from
        # their caches when decoding); per-layer inputs; the MoE block beside the dense MLP
        "gemma4": dict(qk_norm=True, hidden_act="gelu_pytorch_tanh", sliding_window=4,
                       num_layers=4, layer_types=("sliding_attention", "full_attention") * 2,
                       rope_theta=1e6, rope_local_theta=1e4,
                       rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25},
                       query_pre_attn_scalar=1.0, embed_scale=True, norm_scale_fp32=True,
                       sandwich_norm=True, final_logit_softcapping=5.0, tie_word_embeddings=True,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       router_input_scale=True, router_expert_scale=True,
                       gemma4=Gemma4Args(global_head_dim=32, num_global_kv_heads=1,
                                         attention_k_eq_v=True, per_layer_input_size=8,
                                         per_layer_vocab_size=100, num_kv_shared_layers=2,
                                         double_wide_mlp=True)),
        # latent attention (query latent, values narrower than keys, interleaved RoPE, YaRN
        # with mscale), a dense first layer, then grouped sigmoid routing with a shared expert
        "deepseek_v3": dict(num_kv_heads=4, head_dim=8, rope_scaling={
                                "rope_type": "yarn", "factor": 4.0, "mscale": 0.707,
                                "mscale_all_dim": 1.0, "original_max_position_embeddings": 16},
                            latent_attention=MLAArgs(kv_lora_rank=16, q_lora_rank=24,
                                                     qk_nope_head_dim=16, qk_rope_head_dim=8,
                                                     v_head_dim=12),
                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            mlp_only_layers=(0,), shared_expert_intermediate_size=32,
                            moe_routing="sigmoid_group_topk", moe_num_groups=4,
                            moe_topk_groups=2, routed_scaling_factor=2.5),
    }
    return ModelArgs(family=family, **{**common, **per_family[family], **overrides})


def tiny_model(family: str, seed: int = 0, **overrides) -> Transformer:
    model = build_model(tiny_args(family, **overrides), seed=seed)
    # larger than the default init so that logits are peaked (no near-ties in argmax), and
    # perturbed norms so a wrong norm path would show
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):      # slow decay: the recurrent state carries far
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.3, generator=gen).log())
            elif "norm" in name or "scal" in name:   # norms; Gemma 4's router / layer scales
                p.add_(0.3 * noise)
            else:
                p.mul_(4.0)
        for name, b in model.named_buffers():      # DeepSeek-V3's score-correction bias
            b.add_(0.3 * torch.randn(b.shape, generator=gen))
        model.embed.weight[model.args.vocab_size:].zero_()
    return model.eval()


def ids(out: list[list[Rollout]]) -> list[list[list[int]]]:
    return [[r.completion_ids for r in samples] for samples in out]


@torch.no_grad()
def recompute_greedy(model: Transformer, prompt: list[int], max_new: int) -> list[int]:
    """Reference: one sequence, full forward over the whole prefix at every step, argmax."""
    ids = list(prompt)
    for _ in range(max_new):
        logits = model.logits(model(torch.tensor([ids])))[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def naive_logprobs(model: Transformer, seq: list[int], prompt_len: int,
                   temperature: float) -> list[float]:
    """Reference: full padded-vocab logits of one sequence, log_softmax at `temperature`."""
    logits = model.logits(model(torch.tensor([seq])))[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[t - 1, seq[t]]) for t in range(prompt_len, len(seq))]


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3", "qwen3_moe", "gpt_oss",
                                    "qwen3_5", "qwen3_5_moe", "gemma4", "deepseek_v3"])
def test_greedy_with_cache_equals_full_recompute(family: str) -> None:
    model = tiny_model(family)
    engine = NativeEngine(model)
    out = engine.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=12), n=2)
    for prompt, samples in zip(PROMPTS, out):
        expected = recompute_greedy(model, prompt, 12)
        for rollout in samples:
            assert rollout.prompt_ids == prompt
            assert rollout.completion_ids == expected
            assert rollout.finish_reason == "length"
    # chunking the batch does not change greedy results
    small = NativeEngine(model, max_batch_sequences=3)
    out_small = small.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=12), n=2)
    assert ids(out_small) == ids(out)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen3_5", "gemma4", "deepseek_v3"])
@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_rollout_logprobs_equal_teacher_forced(family: str, temperature: float,
                                               top_k: int) -> None:
    model = tiny_model(family)
    engine = NativeEngine(model)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, max_new_tokens=10, seed=3)
    out = engine.generate(PROMPTS, sampling, n=2)
    rollouts = [r for samples in out for r in samples]
    seqs = [r.prompt_ids + r.completion_ids for r in rollouts]
    lens = [len(r.prompt_ids) for r in rollouts]
    forced = engine.logprobs(seqs, lens, temperature=temperature)
    for r, seq, plen, lp in zip(rollouts, seqs, lens, forced):
        assert len(r.logprobs) == len(r.completion_ids) == len(lp)
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(lp),
                                   atol=1e-5, rtol=0)
        naive = naive_logprobs(model, seq, plen, temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(naive),
                                   atol=1e-5, rtol=0)


def test_greedy_logprobs_are_at_temperature_one() -> None:
    model = tiny_model("qwen3")
    engine = NativeEngine(model)
    r = engine.generate([PROMPTS[0]], SamplingConfig(temperature=0.0, max_new_tokens=6))[0][0]
    naive = naive_logprobs(model, r.prompt_ids + r.completion_ids, len(r.prompt_ids), 1.0)
    torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(naive), atol=1e-5, rtol=0)


def test_stop_tokens_and_max_new_tokens() -> None:
    engine = NativeEngine(tiny_model("llama"))
    free = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=16, seed=1), n=3)
    stop = free[0][0].completion_ids[2]
    sampling = SamplingConfig(max_new_tokens=16, seed=1, stop_token_ids=(stop, 98))
    out = engine.generate(PROMPTS, sampling, n=3)
    assert out[0][0].completion_ids == free[0][0].completion_ids[:3]
    assert out[0][0].finish_reason == "stop"
    for samples in out:
        for r in samples:
            assert 1 <= len(r.completion_ids) <= 16
            inner = r.completion_ids[:-1]
            assert stop not in inner and 98 not in inner
            if r.finish_reason == "stop":
                assert r.completion_ids[-1] in (stop, 98)
            else:
                assert len(r.completion_ids) == 16 and r.completion_ids[-1] not in (stop, 98)
    one = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=1), n=2)
    assert all(len(r.completion_ids) == 1 for s in one for r in s)


def test_samples_differ_and_are_reproducible() -> None:
    engine = NativeEngine(tiny_model("qwen3"))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12, seed=7)
    a = engine.generate(PROMPTS, sampling, n=4)
    b = engine.generate(PROMPTS, sampling, n=4)
    c = engine.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=12, seed=8), n=4)
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)
    for samples in ids(a):
        assert len({tuple(s) for s in samples}) > 1


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    engine = NativeEngine(tiny_model("gemma3"))
    greedy = engine.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=8), n=2)
    top_k = engine.generate(PROMPTS, SamplingConfig(top_k=1, max_new_tokens=8, seed=5), n=2)
    top_p = engine.generate(PROMPTS, SamplingConfig(top_p=1e-6, max_new_tokens=8, seed=5), n=2)
    assert ids(top_k) == ids(greedy) == ids(top_p)


def test_padded_vocab_ids_never_sampled() -> None:
    model = tiny_model("qwen3")
    with torch.no_grad():   # padding rows that would win every draw if they were not masked
        model.head.weight[model.args.vocab_size:] = 10 * model.head.weight[:28].abs()
    engine = NativeEngine(model)
    out = engine.generate(PROMPTS, SamplingConfig(temperature=3.0, max_new_tokens=20), n=4)
    assert max(t for s in out for r in s for t in r.completion_ids) < model.args.vocab_size


def test_update_weights_matches_a_model_with_those_weights() -> None:
    engine = NativeEngine(tiny_model("gemma3", seed=0), copy_model=True)
    assert isinstance(engine, RolloutEngine)
    other = tiny_model("gemma3", seed=1)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    before = engine.generate(PROMPTS, greedy)
    engine.update_weights(other.state_dict().items())
    after = engine.generate(PROMPTS, greedy)
    ref = NativeEngine(other).generate(PROMPTS, greedy)
    assert ids(after) == ids(ref) != ids(before)
    for s_after, s_ref in zip(after, ref):
        assert s_after[0].logprobs == s_ref[0].logprobs
    # one tensor per call, as a weight sync writes them, after the engine gave its memory
    # back: the writes land in the tensors the model computes with
    engine.release_memory()
    engine.resume_memory()
    for name, tensor in tiny_model("gemma3", seed=0).state_dict().items():
        engine.update_weights([(name, tensor)])
    assert ids(engine.generate(PROMPTS, greedy)) == ids(before)
    with pytest.raises(ValueError, match="tied"):
        engine.update_weights([("head.weight", other.embed.weight)])
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("norm.weight", torch.zeros(3))])


def test_bad_inputs_fail_with_a_message() -> None:
    engine = NativeEngine(tiny_model("llama"))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingConfig())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[100]], SamplingConfig())
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([[1]], SamplingConfig(max_new_tokens=5000))
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="prompt_lens"):
        engine.logprobs([[1, 2]], [0])


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])      # gemma3: soft-cap, tied head
def test_allowed_token_ranges_restrict_and_renormalise(family: str) -> None:
    """Only allowed ids are drawn (a stop id among them ends a sample), and the rollout's and
    the teacher-forced log-probs are log softmax over the allowed ids' logits."""
    model = tiny_model(family)
    ranges = ((10, 40), (90, 95))
    allowed = [i for lo, hi in ranges for i in range(lo, hi)]
    engine = NativeEngine(model)
    sampling = SamplingConfig(temperature=1.5, max_new_tokens=10, seed=2, stop_token_ids=(92,),
                              allowed_token_ranges=ranges)
    rollouts = [r for s in engine.generate(PROMPTS, sampling, n=4) for r in s]
    assert {t for r in rollouts for t in r.completion_ids} <= set(allowed)
    assert all(r.finish_reason == "length" or r.completion_ids[-1] == 92 for r in rollouts)
    seqs = [r.prompt_ids + r.completion_ids for r in rollouts]
    lens = [len(r.prompt_ids) for r in rollouts]
    forced = engine.logprobs(seqs, lens, temperature=1.5, allowed_token_ranges=ranges)
    for r, seq, plen, lp in zip(rollouts, seqs, lens, forced):
        with torch.no_grad():
            z = model.logits(model(torch.tensor([seq])))[0].float() / 1.5
        naive = [float(z[t - 1, seq[t]] - torch.logsumexp(z[t - 1, allowed], 0))
                 for t in range(plen, len(seq))]
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(naive), atol=1e-5,
                                   rtol=0)
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(naive), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="not among the allowed ids"):
        SamplingConfig(stop_token_ids=(2,), allowed_token_ranges=ranges)
    with pytest.raises(ValueError, match="<= 100"):
        engine.generate(PROMPTS, SamplingConfig(allowed_token_ranges=((10, 101),)))


# --------------------------------------------------------------------------- throughput


@torch.no_grad()
def generate_without_cache(model: Transformer, prompts: list[list[int]], n: int, max_new: int,
                           generator: torch.Generator) -> int:
    """Batched sampling that recomputes the whole (right-padded) prefix every step."""
    from posttrain.ops.vocab import sample_next_token

    seqs = [list(p) for p in prompts for _ in range(n)]
    for _ in range(max_new):
        longest = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (longest - len(s)) for s in seqs])
        hidden = model(ids)
        last = hidden[torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])]
        tokens = sample_next_token(model.logits(last), 1.0, generator=generator,
                                   real_vocab_size=model.args.vocab_size)
        for s, t in zip(seqs, tokens.tolist()):
            s.append(t)
    return len(seqs) * max_new


@pytest.mark.slow
def test_throughput_report() -> None:
    """16 prompts x 4 samples x 32 new tokens, hidden 128, 4 layers: tokens/s with and without
    the KV cache (printed; run with -s). Only the token count is asserted: timings on a shared
    CPU are not a test. Best of 3 for the cached engine, one run of the (slow) recompute."""
    torch.manual_seed(0)
    args = tiny_args("qwen3", hidden_size=128, intermediate_size=256, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=1000)
    model = build_model(args, seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 64, (16,), generator=gen)]
    engine = NativeEngine(model)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=32, seed=0)
    engine.generate(prompts[:2], SamplingConfig(max_new_tokens=2))   # warm-up
    cached_s = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        out = engine.generate(prompts, sampling, n=4)
        cached_s = min(cached_s, time.perf_counter() - t0)
    generated = sum(len(r.completion_ids) for s in out for r in s)
    assert generated == 16 * 4 * 32
    t0 = time.perf_counter()
    generated_nc = generate_without_cache(model, prompts, 4, 32, torch.Generator().manual_seed(0))
    full_s = time.perf_counter() - t0
    print(f"\n[native engine] threads={torch.get_num_threads()} "
          f"KV cache: {generated / cached_s:,.0f} tok/s ({cached_s:.2f} s); "
          f"full recompute: {generated_nc / full_s:,.0f} tok/s ({full_s:.2f} s); "
          f"speed-up {full_s / cached_s:.1f}x")


def test_deepseek_v3_caches_the_latent_and_decodes_with_adapters() -> None:
    """MLA's decode state is the latent (kv_lora_rank + qk_rope_head_dim per token, not per
    head), and its absorbed kv_b reads an adapted kv_b's update."""
    from posttrain.models.kv_cache import KVCache
    from posttrain.models.lora import LoraConfig, apply_lora
    from posttrain.models.mla import MLAState
    model = tiny_model("deepseek_v3")
    cache = KVCache.allocate(model, torch.zeros(2, dtype=torch.long), 10)
    assert all(isinstance(s, MLAState) and s.latent.shape == (2, 10, 16 + 8)
               for s in cache.layers)
    apply_lora(model, LoraConfig(rank=4, alpha=8, targets=("kv_b", "q_b"), init_seed=0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    out = NativeEngine(model).generate(PROMPTS[:2], SamplingConfig(temperature=0.0,
                                                                   max_new_tokens=8))
    for prompt, (rollout,) in zip(PROMPTS, out):
        assert rollout.completion_ids == recompute_greedy(model, prompt, 8)
