"""MoE routing replay (`posttrain.models.routing_replay`): the native engine records each
token's experts, the trainer's forward replays them.

- The tiny Qwen3-MoE with near-tied routing on purpose (two experts' router rows equal up to
  +delta), sampled by the native engine with recording; the trainer's copy flips the ties
  (-delta). The trainer's log-probs of the sampled tokens (GRPO's loss root over one packed
  micro-batch) agree with the engine's within 1e-5 with replay, and differ by > 1e-2 without;
  the flipped selections are counted (> 0), so the test cannot pass vacuously.
- Replaying the trainer's own routing changes no bit (every routing kind: Qwen3-MoE's softmax
  top-k, GPT-OSS's top-k softmax, DeepSeek-V3's grouped sigmoid with its bias, Gemma 4's scaled
  router).
- A replayed block's output is sum_j w_j expert_{e_j}(x) with the weights written here from
  the paper formulas, on random tensors (<= 1e-6), and the router still gets a gradient.
- The engine's record is exactly the experts a full forward chooses at every position it ran
  (left-padded prompts, n samples, rows stopping early), -1 on the last token; multi-turn
  episodes merge their turns' records; the JSON of the rollouts made ahead round-trips them.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from posttrain.models.routing_replay import (moe_blocks, recorded_routing,
                                             routing_replay_counts, set_routing_replay)
from posttrain.rl.batch import Sample, pack_micro_batches
from posttrain.rl.engine import SamplingConfig
from posttrain.rl.native import NativeEngine
from posttrain.train.grpo import AlgorithmConfig, GRPOLoss

from .test_native_engine import tiny_model

PROMPTS = [[5, 17, 3, 42, 8, 11, 60], [7, 1], [1, 2, 3, 4]]
# router rows 0 and 1 of every MoE block differ by DELTA along a random unit vector: their
# logits differ by ~DELTA, far below the others' gaps; measured: flipping the sign flips 53-56 of
# 184 selections, and replay then leaves 2e-6 between engine and trainer (1e-4 leaves 6e-5)
DELTA = 3e-6


def _near_tied(model: torch.nn.Module, sign: float) -> None:
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for block in moe_blocks(model):
            w = block.router.weight
            u = torch.randn(w.shape[1], generator=gen)
            w[1] = w[0] + sign * DELTA * u / u.norm()


def _root(model: torch.nn.Module) -> GRPOLoss:
    return GRPOLoss(model, AlgorithmConfig(routing_replay=True), temperature=1.0,
                    constant_norm=None).eval()


@torch.no_grad()
def _trainer_logprobs(root: GRPOLoss, batch: dict) -> torch.Tensor:
    return root(*(batch[k] for k in GRPOLoss.input_keys), score_only=True)


@pytest.fixture(scope="module")
def sampled():
    """(engine model, its rollouts with routing, one packed micro-batch of them)."""
    model = tiny_model("qwen3_moe")
    _near_tied(model, +1.0)
    engine = NativeEngine(model)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12, seed=3, record_routing=True)
    rollouts = [r for g in engine.generate(PROMPTS, sampling, n=2) for r in g]
    samples = [Sample(r.prompt_ids, r.completion_ids, r.logprobs, 0.0, routing=r.routing)
               for r in rollouts]
    # row_multiple: a padding document of 2 tokens closes the row
    batch = pack_micro_batches(samples, max_tokens=256, row_multiple=4)[0]
    return model, rollouts, batch


def test_replay_matches_the_engine_where_the_trainer_would_route_otherwise(sampled):
    engine_model, rollouts, batch = sampled
    trainer = copy.deepcopy(engine_model)
    _near_tied(trainer, -1.0)                 # the same model, its near-ties flipped
    root = _root(trainer)
    mask, engine_logp = batch["mask"], batch["engine_logp"]

    replayed = _trainer_logprobs(root, batch)
    replayed_counts = routing_replay_counts(trainer).tolist()
    own = _trainer_logprobs(root, {**batch, "routing": None})
    with_replay = (replayed - engine_logp).abs()[mask].max().item()
    without = (own - engine_logp).abs()[mask].max().item()
    assert with_replay <= 1e-5, with_replay
    assert without > 1e-2, without
    # every position the engine ran, in both MoE layers; a share flipped by the perturbation
    ran = sum(len(r.prompt_ids) + len(r.completion_ids) - 1 for r in rollouts)
    assert replayed_counts[0] == 2 * ran
    assert 0 < replayed_counts[1] < replayed_counts[0], replayed_counts
    # the own-routing pass cleared the replay (no counts), and a probe without a record
    assert routing_replay_counts(trainer).tolist() == [0, 0]
    # the padding document of the row routes itself (-1)
    fill = batch["document_lengths"][0][-1]
    assert fill == 2 and bool((batch["routing"][0, -fill:] == -1).all())


def test_replaying_the_trainers_own_routing_changes_no_bit(sampled):
    _, _, batch = sampled
    trainer = tiny_model("qwen3_moe")
    root = _root(trainer)
    own = _trainer_logprobs(root, {**batch, "routing": None})
    record = recorded_routing(moe_blocks(trainer))
    replayed = _trainer_logprobs(root, {**batch, "routing": record[None]})
    assert torch.equal(own, replayed)
    assert routing_replay_counts(trainer)[1] == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "gemma4"])
def test_own_routing_replayed_is_bit_equal_for_every_router(family):
    model = tiny_model(family)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        own = model.logits(model(ids))
        record = recorded_routing(moe_blocks(model)).view(2, 9, -1, model.args.num_experts_per_tok)
        set_routing_replay(model, record)
        replayed = model.logits(model(ids))
        set_routing_replay(model, None)
    assert torch.equal(own, replayed)


def _reference_weights(block, logits: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """The weights of chosen experts from the router logits, written from the papers."""
    if block.routing == "softmax_topk":                      # Qwen3-MoE
        p = torch.softmax(logits.double(), -1).gather(1, expert)
        return p / p.sum(-1, keepdim=True) if block.norm_topk_prob else p
    if block.routing == "topk_softmax":                      # GPT-OSS
        return torch.softmax(logits.double().gather(1, expert), -1)
    s = torch.sigmoid(logits.double()).gather(1, expert)     # DeepSeek-V3 (bias: choice only)
    s = s / s.sum(-1, keepdim=True) if block.norm_topk_prob else s
    return s * block.routed_scaling_factor


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_replayed_block_is_the_formula_on_random_tensors(family):
    model = tiny_model(family).train()
    block = moe_blocks(model)[0]
    gen = torch.Generator().manual_seed(2)
    N, E, k = 11, block.experts.num_experts, block.top_k
    x = torch.randn(N, model.args.hidden_size, generator=gen)
    expert = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    replay = expert.clone()
    replay[3] = -1                                           # this token routes itself
    block.replay_NK = replay.to(torch.int16)
    y = block(x)
    logits = block.router(x).double()
    own = block.route(x)[1]
    chosen = torch.where(replay[:, :1] >= 0, expert, own)
    w = _reference_weights(block, logits, chosen)
    ex = block.experts
    ref = torch.zeros(N, x.shape[1], dtype=torch.float64)
    for n in range(N):
        for j in range(k):
            e = int(chosen[n, j])
            g = x[n].double() @ ex.gate[e].double().T
            u = x[n].double() @ ex.up[e].double().T
            if ex.gate_bias is not None:
                g, u = g + ex.gate_bias[e].double(), u + ex.up_bias[e].double()
            h = (ex._glu(g, u) @ ex.down[e].double().T
                 + (ex.down_bias[e].double() if ex.down_bias is not None else 0.0))
            ref[n] += w[n, j] * h
    if block.shared is not None:
        ref += block.shared(x).double()
    assert (y.double() - ref).abs().max().item() <= 1e-6
    # the selection is replayed, the weights stay differentiable: the router learns
    y.square().sum().backward()
    assert block.router.weight.grad.abs().max() > 0
    block.replay_NK = None


def test_engine_records_the_experts_of_every_position_it_ran():
    model = tiny_model("qwen3_moe")
    engine = NativeEngine(model, max_batch_sequences=4)       # two chunks of prompts
    stops = (3, 11, 42)                                       # some rows end early
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=9, seed=5, stop_token_ids=stops,
                              record_routing=True)
    out = engine.generate(PROMPTS, sampling, n=2)
    lengths = {len(r.completion_ids) for g in out for r in g}
    assert len(lengths) > 1, lengths
    for group in out:
        for r in group:
            seq = r.prompt_ids + r.completion_ids
            with torch.no_grad():
                model(torch.tensor([seq]))
            full = recorded_routing(moe_blocks(model))        # [T, L, k]
            assert r.routing.dtype == torch.int16 and r.routing.shape == full.shape
            assert torch.equal(r.routing[:-1], full[:-1])
            assert bool((r.routing[-1] == -1).all())          # sampled, never run
    plain = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=3, seed=5), n=1)
    assert all(r.routing is None for g in plain for r in g)
    dense = NativeEngine(tiny_model("qwen3"))
    with pytest.raises(ValueError, match="routing_replay"):
        dense.generate(PROMPTS, sampling, n=1)


def test_multi_turn_records_merge_and_the_rollouts_ahead_round_trip():
    from posttrain.rl.dynamic import GroupBatch
    from posttrain.rl.episodes import Episode, _merge_routing
    from posttrain.rl.pipeline import batch_from_json, batch_to_json
    from posttrain.rl.prompts import PromptRow
    from posttrain.rl.rewards import RewardOutput
    # turn 1 ran positions 0..3 (4 sampled, not run); turn 2 ran 0..6 (another routing of 0..3)
    first = torch.tensor([[[0, 1]], [[2, 3]], [[1, 2]], [[0, 3]], [[-1, -1]]], dtype=torch.int16)
    second = torch.tensor([[[1, 0]]] * 7 + [[[-1, -1]]], dtype=torch.int16)
    merged = _merge_routing(first, second)
    assert torch.equal(merged[:4], first[:4])                 # read first by turn 1's tokens
    assert torch.equal(merged[4:], second[4:])
    episode = Episode([1, 2, 3], [4, 5, 6, 7, 8], [-0.5] * 5, "stop", loss_mask=[1] * 5,
                      routing=merged)
    batch = GroupBatch([PromptRow([1, 2, 3], [], {})], [[episode]],
                       RewardOutput([1.0], {}, {}), {})
    back = batch_from_json(json.loads(json.dumps(batch_to_json(batch))))
    routing = back.groups[0][0].routing
    assert routing.dtype == torch.int16 and torch.equal(routing, merged)
    assert episode.routing is merged                        # serialising leaves it alone


def test_the_packed_record_is_checked():
    bad = Sample([1, 2], [3], [-1.0], 0.0, routing=torch.zeros(2, 2, 2, dtype=torch.int16))
    with pytest.raises(ValueError, match="routing record"):
        pack_micro_batches([bad], max_tokens=8)
    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="expert ids"):
        set_routing_replay(model, torch.full((1, 3, 2, 2), 9, dtype=torch.int16))
