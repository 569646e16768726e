"""The GRPO loss root over packed micro-batches against plain per-sequence reference formulas.

On-policy (one update per batch, no KL): the gradient of the summed micro-batch losses equals
the gradient of  -(1/Z) sum_b A_b sum_t w_bt log pi(y_bt)  computed one sequence at a time,
with w the truncated engine->trainer importance weight (1 without it) and Z the aggregation's
normalizer. This checks packing, the sequence layout and the global counts together.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.config.grpo import AlgorithmConfig
from posttrain.rl.batch import pack_micro_batches
from posttrain.train.grpo_loss_root import GRPOLoss

from ..ops.test_cross_entropy import count_projections
from ..rl.test_batch import masked_samples, random_samples
from ..rl.test_native_engine import tiny_model

TEMPERATURE = 0.8


def per_sequence_logp(model, sample) -> torch.Tensor:
    tokens = torch.tensor([sample.prompt_ids + sample.completion_ids])
    hidden = model(tokens)[0]
    logits = model.head(hidden).float() / TEMPERATURE
    logp = torch.log_softmax(logits, dim=-1)
    p = len(sample.prompt_ids)
    targets = torch.tensor(sample.completion_ids)
    return logp[p - 1:p - 1 + len(targets)].gather(1, targets[:, None]).squeeze(1)


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "constant"])
@pytest.mark.parametrize("is_cap", [None, 1.5])
@pytest.mark.parametrize("masked", [False, True])
def test_on_policy_gradient_equals_reference(aggregation, is_cap, masked):
    """`masked`: multi-turn samples whose environment tokens are masked out; the reference
    then sums over the trained tokens only, their count the normalizer of token_mean, each
    sequence's trained tokens that of seq_mean_token_mean."""
    model = tiny_model("qwen3").train()
    samples = masked_samples(10, seed=5) if masked else random_samples(10, seed=5)
    algo = AlgorithmConfig(aggregation=aggregation, is_cap=is_cap,
                           use_engine_logprobs=is_cap is not None, log_entropy=True)
    root = GRPOLoss(model, algo, temperature=TEMPERATURE, constant_norm=16.0)
    batches = pack_micro_batches(samples, max_tokens=40, num_ranks=3)
    assert len(batches) > 1 and not batches[-1]["live"]
    total = 0.0
    for b in batches:
        loss, stats = root(*(b[k] for k in GRPOLoss.input_keys))
        loss.backward()
        total += float(loss.detach())
    got = grads(model)

    # the surrogate's value is -(1/Z) sum A w (ratio 1); its gradient is that of the
    # REINFORCE form below, whose value differs
    ref_loss, ref_value = torch.zeros(()), 0.0
    tokens = sum(sum(s.loss_mask or [1] * len(s.completion_ids)) for s in samples)
    for s in samples:
        keep = torch.tensor(s.loss_mask or [1] * len(s.completion_ids), dtype=torch.bool)
        logp = per_sequence_logp(model, s)[keep]
        w = torch.ones_like(logp)
        if is_cap is not None:
            w = (logp.detach() - torch.tensor(s.engine_logprobs)[keep]).exp().clamp(max=is_cap)
        z = {"token_mean": tokens, "seq_mean_token_mean": len(logp) * len(samples),
             "constant": 16.0 * len(samples)}[aggregation]
        ref_loss = ref_loss - (s.advantage * w * logp).sum() / z
        ref_value -= float((s.advantage * w).sum()) / z
    ref_loss.backward()
    want = grads(model)
    assert total == pytest.approx(ref_value, abs=1e-5)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_dummy_micro_batch_contributes_nothing_but_runs_backward():
    model = tiny_model("qwen3").train()
    (b,) = pack_micro_batches(random_samples(2), max_tokens=64)
    root = GRPOLoss(model, AlgorithmConfig(), temperature=1.0, constant_norm=None)
    loss, stats = root(*({**b, "live": False}[k] for k in GRPOLoss.input_keys))
    loss.backward()
    assert float(loss.detach()) == 0.0 and all(float(v) == 0.0 for v in stats.values())
    g = grads(model)
    assert g and all(torch.all(v == 0) for v in g.values())   # the graph reached every weight


def test_kl_term_against_k3_formula():
    model = tiny_model("qwen3").train()
    samples = random_samples(4, seed=9)
    (b,) = pack_micro_batches(samples, max_tokens=256)
    root = GRPOLoss(model, AlgorithmConfig(kl_coef=0.5, reference="copy", is_cap=None,
                                           use_engine_logprobs=False),
                    temperature=TEMPERATURE, constant_norm=None)
    with torch.no_grad():
        logp = root(*(b[k] for k in GRPOLoss.input_keys), score_only=True)
    ref = logp - 0.3 * b["mask"]          # a reference 0.3 nats below the policy
    loss, stats = root(*({**b, "ref_logp": ref}[k] for k in GRPOLoss.input_keys))
    n = int(b["mask"].sum())
    k3 = torch.exp(torch.tensor(-0.3)) + 0.3 - 1
    assert float(stats["kl"]) / n == pytest.approx(float(k3), rel=1e-5)
    pg = -(b["advantages"][:, None] * b["mask"]).sum() / n       # ratio 1 on policy
    assert float(loss) == pytest.approx(float(pg + 0.5 * k3), abs=1e-5)



@pytest.mark.parametrize("is_cap", [None, 1.5])
def test_first_mini_batch_needs_no_old_policy_pass(is_cap):
    """`GRPO.train_rollouts` scores old-policy log-probs only for the mini-batches after the
    first: before the first optimizer step the policy is the old one, so the loss root's own
    log-probs, detached, must give the loss and gradients that a separate scoring pass gives."""
    model = tiny_model("qwen3").train()
    algo = AlgorithmConfig(is_cap=is_cap, use_engine_logprobs=is_cap is not None)
    root = GRPOLoss(model, algo, temperature=TEMPERATURE, constant_norm=16.0)
    batches = [b for b in pack_micro_batches(random_samples(10, seed=7), max_tokens=40,
                                             num_ranks=1) if b["live"]]
    keys = GRPOLoss.input_keys
    assert len(batches) > 1
    results = []
    for scored in (False, True):
        total = 0.0
        for b in batches:
            args = {k: b.get(k) for k in keys}
            if scored:
                with torch.no_grad():
                    args["old_logp"] = root(*(b[k] for k in keys), score_only=True)
            loss, _ = root(*(args[k] for k in keys))
            loss.backward()
            total += float(loss.detach())
        results.append((total, grads(model)))
    (own, own_grads), (scored, scored_grads) = results
    assert own == pytest.approx(scored, abs=1e-6)
    for name in own_grads:
        torch.testing.assert_close(own_grads[name], scored_grads[name], atol=1e-6, rtol=1e-5,
                                   msg=name)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "constant"])
def test_head_gradients_formed_in_forward_equal_the_recomputing_path(aggregation, monkeypatch):
    """Off policy (old log-probs up to 0.5 nats from the policy's, so both clips act), with the
    k3 term against a reference and the truncated IS weight (the engine's log-probs up to 0.6
    nats from the old ones), on multi-turn masks and several
    chunks per micro-batch: the root that forms the head's gradients in the forward (the
    default) gives the loss, the stats and every gradient of the root that projects each chunk
    again in backward (`fuse_head=False`), and projects each chunk once where that one
    projects it twice."""
    model = tiny_model("qwen3").train()
    algo = AlgorithmConfig(aggregation=aggregation, kl_coef=0.3, reference="copy", is_cap=1.5,
                           clip_low=0.1, clip_high=0.15)
    batches = pack_micro_batches(masked_samples(10, seed=3), max_tokens=40, num_ranks=2)
    keys = GRPOLoss.input_keys
    results = {}
    for fuse in (True, False):
        root = GRPOLoss(model, algo, temperature=TEMPERATURE, constant_norm=16.0, chunk_tokens=4,
                        fuse_head=fuse)
        gen = torch.Generator().manual_seed(11)
        losses, stats, projected = [], [], 0
        for b in batches:
            with torch.no_grad():
                logp = root(*(b[k] for k in keys), score_only=True)
            m = b["mask"]

            def near(x, nats):
                return x + nats * (2 * torch.rand(m.shape, generator=gen) - 1) * m

            old = near(logp, 0.5)
            args = {**b, "old_logp": old, "engine_logp": near(old, 0.6), "ref_logp": logp - 0.3 * m}
            rows = count_projections(monkeypatch)
            loss, st = root(*(args[k] for k in keys))
            loss.backward()
            monkeypatch.undo()
            projected += sum(rows)
            losses.append(float(loss.detach()))
            stats.append({k: float(v) for k, v in st.items()})
        results[fuse] = losses, stats, projected, grads(model)
    (f_loss, f_stats, f_proj, f_grads), (r_loss, r_stats, r_proj, r_grads) = (results[True],
                                                                           results[False])
    trained = sum(int(b["mask"].sum()) for b in batches)
    assert (f_proj, r_proj) == (trained, 2 * trained)
    assert f_loss == pytest.approx(r_loss, abs=1e-6)
    assert f_stats == r_stats          # the metrics come from the same log-probs
    clipped = sum(s["clip_fraction_low"] + s["clip_fraction_high"] for s in f_stats)
    assert clipped > 0 and any(s["is_truncated_fraction"] > 0 for s in f_stats)
    assert set(f_grads) == set(r_grads)
    for name in r_grads:
        torch.testing.assert_close(f_grads[name], r_grads[name], atol=1e-6, rtol=1e-5, msg=name)

