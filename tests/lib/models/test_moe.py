"""Qwen3-MoE: logits, gradients and aux loss against transformers; checkpoint round trips (and
GPT-OSS's fused layout); the dispatch only computes the experts tokens were routed to; grouped
experts equal the loop (GPT-OSS's biases and clamp too)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from posttrain.models import ModelArgs, args_from_hf_config, build_model, load_hf, save_hf
from posttrain.models.hf_io import hf_named_tensors, weight_map
from posttrain.models.layers import FeedForward
from posttrain.models.moe import MoEBlock, router_logits
from posttrain.models.moe_balance import load_balancing_loss
from posttrain.models.verify import verify

# layers 1 and 3 MoE (decoder_sparse_step=2), plain top-k weights
SPARSE_STEP = {"decoder_sparse_step": 2, "mlp_only_layers": [], "norm_topk_prob": False}
# transformers gives every layer the window when use_sliding_window is set
SLIDING = {"use_sliding_window": True, "sliding_window": 8}


def _ids(seq_len: int = 24, vocab: int = 250, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("overrides", [{}, SPARSE_STEP, SLIDING],
                         ids=["mlp_only_layers", "sparse_step", "sliding_window"])
def test_verifier_passes_packed_and_unpacked(overrides) -> None:
    report = verify(("qwen3_moe", overrides), seq_len=32, batch=2, packed=True, atol=1e-4)
    assert report["passed"], report
    assert report["unpacked"]["max_abs_diff"] <= 1e-4
    assert report["packed"]["max_abs_diff"] <= 1e-4


@pytest.mark.parametrize("overrides,moe_layers", [({}, [0, 1, 3]), (SPARSE_STEP, [1, 3])],
                         ids=["mlp_only_layers", "sparse_step"])
def test_dense_and_moe_layers_follow_the_config(overrides, moe_layers, make_hf_dir) -> None:
    hf_dir, ref = make_hf_dir("qwen3_moe", **overrides)
    native = load_hf(hf_dir, dtype=torch.float32)
    assert [i for i, layer in enumerate(native.layers) if isinstance(layer.mlp, MoEBlock)] \
        == moe_layers
    for i, layer in enumerate(native.layers):
        if i not in moe_layers:
            assert isinstance(layer.mlp, FeedForward)
            assert layer.mlp.gate.out_features == ref.config.intermediate_size
    experts = native.layers[moe_layers[0]].mlp.experts
    assert {n for n, _ in experts.named_parameters()} == {"gate", "up", "down"}
    assert tuple(experts.gate.shape) == (8, 32, 64) and tuple(experts.down.shape) == (8, 64, 32)
    assert native.args.router_aux_loss_coef == ref.config.router_aux_loss_coef


@pytest.mark.parametrize("family,keys,config", [
    ("qwen3_moe", ["model.layers.1.mlp.experts.7.down_proj.weight",
                   "model.layers.1.mlp.gate.weight"], {"mlp_only_layers": [2]}),  # per expert
    ("gpt_oss", ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.self_attn.sinks"],
     {"num_local_experts": 4}),                                # fused, interleaved gate/up
])
def test_save_round_trips_the_expert_layout(family, keys, config, make_hf_dir, read_checkpoint,
                                            tmp_path) -> None:
    """Load + save writes the checkpoint's tensors back bit for bit (and so does the streamed
    export for an engine); transformers loads the export with the original logits."""
    hf_dir, ref = make_hf_dir(family)
    native = load_hf(hf_dir, dtype=torch.float32)
    out = save_hf(native, tmp_path / "export")
    original, exported = read_checkpoint(hf_dir), read_checkpoint(out)
    assert set(keys) <= original.keys()
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(exported[name], t), name
    streamed = dict(hf_named_tensors(native.args, native.state_dict().items()))
    assert streamed.keys() == original.keys()
    assert all(torch.equal(streamed[name], t) for name, t in original.items())
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == family and config.items() <= written.items()

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, ref(ids).logits, atol=0, rtol=0)
        assert (native.logits(native(ids))[..., :250] - ref(ids).logits).abs().max() <= 1e-4


def test_sharded_checkpoint_with_experts_split_across_files(make_hf_dir, tmp_path) -> None:
    hf_dir, _ = make_hf_dir("qwen3_moe")
    native = load_hf(hf_dir, dtype=torch.float32)
    out = save_hf(native, tmp_path / "sharded", max_shard_bytes=40_000)
    files = set(weight_map(out).values())
    expert_files = {weight_map(out)[f"model.layers.1.mlp.experts.{e}.up_proj.weight"]
                    for e in range(8)}
    assert len(files) > 3 and len(expert_files) > 1      # one layer's experts in several shards
    again = load_hf(out, dtype=torch.float32)
    for (name, a), (_, b) in zip(native.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    meta = load_hf(out, on_meta=True, param_filter=lambda n: "experts" in n)
    assert torch.equal(meta.layers[3].mlp.experts.down, native.layers[3].mlp.experts.down)
    assert meta.layers[3].mlp.router.weight.is_meta


BUILT = {
    "qwen3_moe": ModelArgs(family="qwen3_moe", vocab_size=100, hidden_size=32,
                           intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                           head_dim=16, qk_norm=True, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=16, mlp_only_layers=(0,),
                           router_aux_loss_coef=0.01),
    "gpt_oss": ModelArgs(family="gpt_oss", vocab_size=100, hidden_size=32, intermediate_size=16,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         rms_norm_eps=1e-5, rope_theta=150_000.0, attention_bias=True,
                         max_position_embeddings=8192,
                         rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "truncate": False,
                                       "original_max_position_embeddings": 1024},
                         sliding_window=4, layer_types=("sliding_attention", "full_attention"),
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         attention_sinks=True, router_bias=True, expert_bias=True,
                         moe_routing="topk_softmax", swiglu_limit=7.0,
                         router_aux_loss_coef=0.01),
}


@pytest.mark.parametrize("family", BUILT)
def test_built_model_saves_a_checkpoint_transformers_loads(family, tmp_path) -> None:
    """A model built from args alone: its config.json (the bridge's `config_from_args`) and
    tensors make the same model in transformers."""
    native = build_model(BUILT[family], seed=0).eval()
    with torch.no_grad():                   # biases and sinks start at 0: make them matter
        for name, p in native.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(std=0.5)
    out = save_hf(native, tmp_path / "scratch", dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    ids = _ids(16, vocab=100)
    with torch.no_grad():
        assert (native.logits(native(ids))[..., :100] - ref(ids).logits).abs().max() <= 1e-5


def test_aux_loss_and_gradients_match_transformers(make_hf_dir) -> None:
    hf_dir, ref = make_hf_dir("qwen3_moe", router_aux_loss_coef=0.02)
    native = load_hf(hf_dir, dtype=torch.float32)
    ids = _ids(20)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0                                            # padding left out of the loss

    out = ref(ids, output_router_logits=True)
    hidden = native(ids)
    logits = router_logits(native)
    assert len(logits) == len(out.router_logits) == 3
    for mine, theirs in zip(logits, out.router_logits):
        assert (mine - theirs).abs().max() <= 1e-5
    aux = load_balancing_loss(logits, top_k=2)
    assert abs(aux.item() - out.aux_loss.item()) <= 1e-6
    masked_hf = load_balancing_loss_func(out.router_logits, 8, 2, mask)
    assert abs(load_balancing_loss(logits, 2, token_mask=mask).item() - masked_hf.item()) <= 1e-6
    assert abs(native.moe_aux_loss().item() - 0.02 * out.aux_loss.item()) <= 1e-7

    # gradients of the logits and of the aux loss, through router and stacked experts
    w = torch.randn(2, 20, 250, generator=torch.Generator().manual_seed(3))
    ((out.logits * w).sum() + out.aux_loss).backward()
    ((native.logits(hidden)[..., :250] * w).sum() + load_balancing_loss(logits, 2)).backward()
    hf_layer, mine = ref.model.layers[1].mlp, native.layers[1].mlp
    inter = mine.experts.gate.shape[1]
    gate_up = hf_layer.experts.gate_up_proj.grad
    torch.testing.assert_close(mine.router.weight.grad, hf_layer.gate.weight.grad,
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mine.experts.gate.grad, gate_up[:, :inter], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mine.experts.up.grad, gate_up[:, inter:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mine.experts.down.grad, hf_layer.experts.down_proj.grad,
                               atol=1e-4, rtol=1e-4)


def test_dense_model_has_zero_aux_loss() -> None:
    args = ModelArgs(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    model = build_model(args, seed=0)
    model(_ids(8, vocab=64))
    assert float(model.moe_aux_loss()) == 0.0


def test_only_routed_experts_cost_flops() -> None:
    args = ModelArgs(family="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=16,
                     num_experts_per_tok=2, moe_intermediate_size=8)
    block = build_model(args, seed=0).layers[0].mlp
    with torch.no_grad():                     # the router sends every token to experts 3 and 5
        block.router.weight.zero_()
        block.router.weight[3] = 1.0
        block.router.weight[5] = 0.5
    x = torch.rand(2, 10, 32) + 0.1           # positive, so the order 3 > 5 > rest holds
    from posttrain.models.moe import grouped_mm_flops
    mapping = {torch.ops.aten._grouped_mm: grouped_mm_flops}   # the grouped experts' kernel
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        y = block(x)
    tokens, H, I, E = 20, 32, 8, 16
    router = 2 * tokens * H * E
    experts = 2 * tokens * 2 * 3 * H * I      # top-2, three matrices each
    assert counter.get_total_flops() == router + experts
    y.sum().backward()
    touched = block.experts.gate.grad.abs().sum(dim=(1, 2)) > 0
    assert touched.nonzero().flatten().tolist() == [3, 5]


# GPT-OSS: expert biases (gathered per row on the grouped path) and a clamp that bites
GPT_OSS_CLAMPED = {"swiglu_limit": 1.0, "num_hidden_layers": 2, "sliding_window": 3,
                   "layer_types": ["sliding_attention", "full_attention"]}


@pytest.mark.parametrize("family,overrides", [("qwen3_moe", {}), ("gpt_oss", GPT_OSS_CLAMPED)])
def test_grouped_experts_equal_the_loop(family, overrides, make_hf_dir, monkeypatch) -> None:
    """The grouped-matmul experts (one `torch._grouped_mm` per projection) against the loop
    over experts: logits and every gradient within 1e-5 on a packed batch (fp32, CPU)."""
    from posttrain.models.moe import Experts, grouped_mm_available
    if not grouped_mm_available(torch.device("cpu"), torch.float32):
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    hf_dir, _ = make_hf_dir(family, **overrides)
    ids = _ids(seq_len=32)
    results = {}
    for impl in ("loop", "grouped"):
        monkeypatch.setattr(Experts, "impl", impl)
        model = load_hf(hf_dir, dtype=torch.float32)
        logits = model.logits(model(ids, document_lengths=[[20, 12], [32]]))
        logits = logits[..., :model.args.vocab_size]      # past it: padding rows, -inf
        logits.float().square().mean().backward()
        results[impl] = logits.detach(), {n: p.grad for n, p in model.named_parameters()}
    (loop_logits, loop_grads), (grouped_logits, grouped_grads) = results["loop"], \
        results["grouped"]
    assert (loop_logits - grouped_logits).abs().max() <= 1e-5
    for name, g in loop_grads.items():
        assert (g - grouped_grads[name]).abs().max() <= 1e-5, name


def test_first_moe_forward_inside_a_checkpointed_block_trains(monkeypatch) -> None:
    """The one-time grouped-matmul probe runs in the first MoE forward; under full activation
    checkpointing its tensors must not be counted as the block's (recomputation would find
    fewer and the first backward fail), and the gradients are those without checkpointing."""
    from posttrain.distributed import apply_activation_checkpointing
    from posttrain.models import moe
    from posttrain.models.verify import tiny_hf_config

    monkeypatch.setattr(moe, "_GROUPED_OK", {})          # the probe has not run yet
    args = args_from_hf_config(tiny_hf_config("qwen3_moe").to_dict())
    ref, model = build_model(args, seed=0), build_model(args, seed=0)
    apply_activation_checkpointing(model, "full")
    ids = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for m in (model, ref):
        m(ids).square().mean().backward()
    assert moe._GROUPED_OK
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_sequence_balance_loss_is_the_papers_formula() -> None:
    """DeepSeek-V3 eqs. 17-20 per document of a packed row (padding left out), averaged over
    documents and layers, against plain loops in float64."""
    from posttrain.models.moe_balance import sequence_balance_loss
    gen = torch.Generator().manual_seed(0)
    E, K, lengths = 8, 2, [[5, 7, 4], [16]]
    mask = torch.ones(2, 16)
    mask[0, 14:] = 0                              # the last document partly padding
    logits = [torch.randn(32, E, generator=gen) for _ in range(2)]
    experts = [torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(32)])
               for _ in range(2)]
    got = sequence_balance_loss(logits, experts, lengths, mask)
    per_layer = []
    for lg, ex in zip(logits, experts):
        s = torch.sigmoid(lg.double())
        s = s / s.sum(-1, keepdim=True)
        docs, start = [], 0
        for b, row in enumerate(lengths):
            for n in row:
                tokens = [b * 16 + t for t in range(start % 16, start % 16 + n)
                          if mask[b, t] > 0]
                start += n
                T = len(tokens)
                f = [E / (K * T) * sum(float(i in ex[t].tolist()) for t in tokens)
                     for i in range(E)]
                P = [sum(float(s[t, i]) for t in tokens) / T for i in range(E)]
                docs.append(sum(fi * pi for fi, pi in zip(f, P)))
        per_layer.append(sum(docs) / len(docs))
    assert got.item() == pytest.approx(sum(per_layer) / 2, rel=1e-6)


def test_update_score_bias_is_the_papers_rule() -> None:
    """b_i += gamma * sign(mean_j load_j - load_i) per layer (experts at the mean stay put)."""
    from posttrain.models import args_from_hf_config, build_model
    from posttrain.models.moe_balance import expert_loads, score_bias_blocks, update_score_bias
    from posttrain.models.verify import tiny_hf_config
    model = build_model(args_from_hf_config(tiny_hf_config("deepseek_v3").to_dict()),
                        seed=0)
    blocks = score_bias_blocks(model)
    assert [id(b) for b in blocks] == [id(model.layers[i].mlp) for i in (1, 2, 3)]
    loads = torch.tensor([[4, 4, 4, 4, 0, 8, 2, 6]] * 3, dtype=torch.float64)
    update_score_bias(model, loads, 0.01)
    for b in blocks:
        torch.testing.assert_close(b.e_score_correction_bias,
                                   torch.tensor([0, 0, 0, 0, 0.01, -0.01, 0.01, -0.01]))
    model(torch.randint(0, 250, (2, 6)))
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0
    counted = expert_loads(model, mask)
    assert counted.shape == (3, 8) and (counted.sum(1) == 10 * 2).all()
