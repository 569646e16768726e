"""Weight sync (posttrain.rl.weight_sync): the bucket plan, the in-process copy into a
colocated engine, and the bucketed broadcast from 2 FSDP2 trainer ranks to an engine process
over a gloo group of their own: bit-identical weights, the engine's dtype, LoRA adapters only."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from posttrain.models.args import MLAArgs, ModelArgs
from posttrain.models.lora import LoraConfig, apply_lora, fold_adapters, is_adapter_name
from posttrain.models.trainable_tokens import apply_trainable_tokens, token_rows
from posttrain.models.transformer import build_model
from posttrain.rl.native import NativeEngine
from posttrain.rl.weight_sync import (SyncEntry, SyncPlan, WeightReceiver, WeightSender,
                                      plan_sync)

ARGS = ModelArgs(family="qwen3", vocab_size=100, hidden_size=32, intermediate_size=64,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                 tie_word_embeddings=True)
MOE_ARGS = ModelArgs(family="qwen3_moe", vocab_size=100, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
DEEPSEEK_ARGS = ModelArgs(family="deepseek_v3", vocab_size=100, hidden_size=32,
                          intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                          head_dim=8, latent_attention=MLAArgs(16, 8, 8, 8, q_lora_rank=16),
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          mlp_only_layers=(0,), moe_routing="sigmoid_group_topk",
                          moe_num_groups=2, moe_topk_groups=1)
LORA = LoraConfig(rank=4, alpha=8.0)
SCALING = LORA.alpha / LORA.rank


def trainer_model(args: ModelArgs = ARGS, lora: LoraConfig | None = None,
                  step: int = 0) -> torch.nn.Module:
    """The trainer's full model after `step` updates: seeded weights, and with LoRA adapters
    whose A and B (B nonzero) depend on the step, as after training."""
    model = build_model(args, seed=0)
    if lora is not None:
        apply_lora(model, lora)
        set_adapters(model, step)
    return model


def adapter_values(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(tuple(p.shape), generator=gen) * 0.1
            for n, p in model.named_parameters() if is_adapter_name(n)}


@torch.no_grad()
def set_adapters(model: torch.nn.Module, step: int) -> None:
    """Give every adapter its values of `step` (sharded parameters keep their shard)."""
    from posttrain.distributed.materialize import copy_full_into
    params = dict(model.named_parameters())
    for name, value in adapter_values(model, step).items():
        copy_full_into(params[name], value)


def engine(args: ModelArgs = ARGS, dtype: torch.dtype = torch.float32) -> NativeEngine:
    """An engine whose weights differ from every trainer weight until synced."""
    return NativeEngine(build_model(args, seed=1, dtype=dtype).eval())


def engine_state(e: NativeEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in e.model.named_parameters()}


def expected(model: torch.nn.Module, dtype: torch.dtype, lora: bool) -> dict[str, torch.Tensor]:
    state = {n: p.detach() for n, p in model.named_parameters()}
    if lora:
        state = fold_adapters({n: t if is_adapter_name(n) else t.to(dtype)
                               for n, t in state.items()}, SCALING)
    return {n: t.to(dtype) for n, t in state.items()}


def assert_equal_states(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


# ---------------------------------------------------------------------------- the plan


def entry(name: str, n: int, dtype=torch.float32) -> SyncEntry:
    return SyncEntry(name, (n,), dtype)


def test_buckets_hold_many_small_tensors_and_a_large_one_alone():
    plan = SyncPlan(weights=(entry("a", 10), entry("b", 10), entry("big", 100),
                             entry("c", 5), entry("d", 20), entry("e", 1)),
                    bucket_bytes=100)
    names = [[e.name for e in b] for b in plan.buckets(full=True)]
    assert names == [["a", "b"], ["big"], ["c", "d"], ["e"]]
    assert all(sum(e.nbytes for e in b) <= 100 for b in plan.buckets(True) if len(b) > 1)
    assert plan.nbytes(True) == 146 * 4


def test_a_dtype_change_starts_a_bucket_and_lora_later_syncs_send_adapters_only():
    plan = SyncPlan(weights=(entry("w", 4, torch.bfloat16),),
                    adapters=(entry("w_A", 2), entry("w_B", 2)), lora_scaling=2.0,
                    bucket_bytes=1 << 20)
    assert [[e.name for e in b] for b in plan.buckets(True)] == [["w"], ["w_A", "w_B"]]
    assert [[e.name for e in b] for b in plan.buckets(False)] == [["w_A", "w_B"]]
    assert (plan.nbytes(True), plan.nbytes(False)) == (4 * 2 + 4 * 4, 4 * 4)


def test_plan_refuses_an_engine_the_trainer_cannot_fill():
    from posttrain.errors import ConfigError
    params = {n: p for n, p in trainer_model().named_parameters()}
    shapes = engine().parameter_shapes
    with pytest.raises(ConfigError, match="no tensors"):
        plan_sync(params, {**shapes, "extra.weight": (3,)}, torch.float32)
    with pytest.raises(ConfigError, match="shapes differ"):
        plan_sync(params, {**shapes, "norm.weight": (3,)}, torch.float32)


# ---------------------------------------------------------------------------- colocated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_process_copy_gives_the_trainer_weights_in_the_engine_dtype(dtype):
    model, e = trainer_model(), engine(dtype=dtype)
    sender = WeightSender(model, rank=0, device="cpu")
    plan = sender.make_plan(e.parameter_shapes, e.dtype)
    written = sender.copy_to(WeightReceiver(e, plan), full=True)
    assert_equal_states(engine_state(e), expected(model, dtype, lora=False))
    assert written == sum(p.numel() for p in e.model.parameters()) * dtype.itemsize


def test_router_bias_buffer_travels_in_fp32_to_a_bf16_engine():
    """DeepSeek-V3's score-correction bias is a buffer (bias balancing moves it, no optimizer
    does): it is synced, and with the router weight it travels and stays in fp32, as the model
    keeps them (`Transformer.fp32_names`)."""
    args = DEEPSEEK_ARGS
    model, e = build_model(args, seed=0), engine(args, dtype=torch.bfloat16)
    with torch.no_grad():
        for _, b in model.named_buffers():
            b.normal_(generator=torch.Generator().manual_seed(5))
    sender = WeightSender(model, rank=0, device="cpu")
    plan = sender.make_plan(e.parameter_shapes, e.dtype)
    fp32 = {x.name for x in plan.weights if x.dtype == torch.float32}
    assert fp32 == set(model.fp32_names()) and "layers.1.mlp.e_score_correction_bias" in fp32
    sender.copy_to(WeightReceiver(e, plan), full=True)
    for name, want in model.state_dict().items():
        got = e.model.state_dict()[name]
        assert got.dtype == (torch.float32 if name in fp32 else torch.bfloat16), name
        assert torch.equal(got, want.to(got.dtype)), name


def test_lora_syncs_after_the_first_send_the_moving_router_bias_too():
    """With LoRA only the adapters travel after the first sync, but bias balancing moves
    DeepSeek-V3's score-correction bias (a buffer) every step: every sync sends it, or the
    rollout engine would route by the first step's bias."""
    model = trainer_model(DEEPSEEK_ARGS, LoraConfig(rank=4, alpha=8.0, targets=("q_b", "kv_b")))
    e = engine(DEEPSEEK_ARGS)
    sender = WeightSender(model, rank=0, device="cpu")
    plan = sender.make_plan(e.parameter_shapes, e.dtype, lora_scaling=SCALING)
    assert [x.name for x in plan.buffers] == ["layers.1.mlp.e_score_correction_bias"]
    receiver = WeightReceiver(e, plan)
    sender.copy_to(receiver, full=True)
    with torch.no_grad():                             # a step of bias balancing
        model.layers[1].mlp.e_score_correction_bias.add_(0.001 * torch.tensor([1., -1, 1, -1]))
    set_adapters(model, step=1)
    written = sender.copy_to(receiver, full=False)
    bias = e.model.layers[1].mlp.e_score_correction_bias
    assert torch.equal(bias, model.layers[1].mlp.e_score_correction_bias)
    adapters = sum(p.numel() * 4 for n, p in model.named_parameters() if is_adapter_name(n))
    assert written == adapters + 4 * 4


@pytest.mark.parametrize("args", [ARGS, MOE_ARGS], ids=["dense", "moe_experts"])
def test_lora_sync_sends_adapters_only_and_the_engine_holds_the_merged_weights(args):
    lora = (LORA if args.num_experts == 0 else
            LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "experts.gate", "experts.down")))
    model, e = trainer_model(args, lora), engine(args)
    sender = WeightSender(model, rank=0, device="cpu")
    receiver = WeightReceiver(e, sender.make_plan(e.parameter_shapes, e.dtype,
                                                  lora_scaling=SCALING))
    sender.copy_to(receiver, full=True)
    assert_equal_states(engine_state(e), expected(model, torch.float32, lora=True))
    set_adapters(model, step=1)                       # a training step moves the adapters only
    written = sender.copy_to(receiver, full=False)
    assert_equal_states(engine_state(e), expected(model, torch.float32, lora=True))
    adapters = sum(p.numel() * 4 for n, p in model.named_parameters() if is_adapter_name(n))
    assert written == adapters < sum(p.numel() * 4 for p in e.model.parameters()) / 4


def test_adapters_before_any_base_are_refused():
    model, e = trainer_model(lora=LORA), engine()
    sender = WeightSender(model, rank=0, device="cpu")
    receiver = WeightReceiver(e, sender.make_plan(e.parameter_shapes, e.dtype,
                                                  lora_scaling=SCALING))
    with pytest.raises(RuntimeError, match="first sync must be full"):
        sender.copy_to(receiver, full=False)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_trainable_token_rows_travel_as_adapters_of_the_vocabulary_weights(tied):
    """The deltas of trainable token rows go with the adapters: the engine holds the base
    with rows W[t] + D (the embedding's; an untied head's too), after the full sync and after
    an adapters-only one."""
    args = ARGS.replace(tie_word_embeddings=tied)
    model, e = trainer_model(args, LORA), engine(args)
    apply_trainable_tokens(model, (3, 97, 98))

    def step(n: int) -> dict[str, torch.Tensor]:
        """Move adapters and deltas as training step n would; the engine's expected state."""
        set_adapters(model, n)
        gen = torch.Generator().manual_seed(200 + n)
        with torch.no_grad():
            for _, rows in token_rows(model):
                rows.delta.copy_(torch.randn(rows.delta.shape, generator=gen))
        state = {k: v for k, v in expected(model, torch.float32, lora=True).items()
                 if "token_adapter" not in k}
        for name, rows in token_rows(model):
            state[name] = state[name].clone()
            for i, t in enumerate((3, 97, 98)):
                state[name][t] += rows.delta.detach()[i]
        return state

    want = step(0)
    assert len(token_rows(model)) == (1 if tied else 2)
    sender = WeightSender(model, rank=0, device="cpu")
    receiver = WeightReceiver(e, sender.make_plan(e.parameter_shapes, e.dtype,
                                                  lora_scaling=SCALING))
    sender.copy_to(receiver, full=True)
    assert_equal_states(engine_state(e), want)
    want = step(1)
    written = sender.copy_to(receiver, full=False)
    assert_equal_states(engine_state(e), want)
    moved = sum(p.numel() * 4 for n, p in model.named_parameters() if p.requires_grad)
    assert written == moved


def test_a_whole_embedding_trained_beside_lora_goes_with_every_sync():
    """model.lora.modules_to_save: the embedding trains whole, so the adapters-only syncs
    send it too."""
    model, e = trainer_model(lora=LORA), engine()
    apply_trainable_tokens(model, (), ("embed",))
    sender = WeightSender(model, rank=0, device="cpu")
    plan = sender.make_plan(e.parameter_shapes, e.dtype, lora_scaling=SCALING)
    assert [x.name for x in plan.buffers] == ["embed.weight"]
    receiver = WeightReceiver(e, plan)
    sender.copy_to(receiver, full=True)
    with torch.no_grad():
        model.embed.weight.add_(0.01)
    set_adapters(model, step=1)
    sender.copy_to(receiver, full=False)
    assert_equal_states(engine_state(e), expected(model, torch.float32, lora=True))


class _WholeReloadEngine:
    """An engine that takes all its weights in one call (as vLLM does)."""

    partial_updates = False

    def __init__(self):
        self.inner = engine()
        self.calls: list[list[str]] = []
        self.parameter_shapes, self.dtype = self.inner.parameter_shapes, self.inner.dtype

    def update_weights(self, named):
        named = list(named)
        self.calls.append([n for n, _ in named])
        self.inner.update_weights(named)


def test_an_engine_that_reloads_whole_gets_every_weight_in_one_call_each_sync():
    model, e = trainer_model(lora=LORA), _WholeReloadEngine()
    sender = WeightSender(model, rank=0, device="cpu")
    receiver = WeightReceiver(e, sender.make_plan(e.parameter_shapes, e.dtype,
                                                  lora_scaling=SCALING))
    sender.copy_to(receiver, full=True)
    set_adapters(model, step=1)
    sender.copy_to(receiver, full=False)
    assert e.calls == [list(e.parameter_shapes)] * 2
    assert_equal_states(engine_state(e.inner), expected(model, torch.float32, lora=True))


# ---------------------------------------------------------------------------- 2 ranks + engine

TRAINERS = 2
# small buckets: many per sync, and the (tied) embedding, 128 x 32 x 4 bytes, over one alone
CASES = [("fp32_small_buckets", torch.float32, None, 4096),
         ("bf16_engine", torch.bfloat16, None, 1 << 20),
         ("lora", torch.float32, LORA, 4096)]


def _trainer(rank: int, port: int, queue, out_dir: str) -> None:
    from posttrain.distributed import (ParallelConfig, build_mesh, close_process_group,
                                       init_process_group, parallelize)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(TRAINERS), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    result: dict = {}
    try:
        init_process_group(timeout_s=60)
        mesh = build_mesh()
        for name, dtype, lora, bucket_bytes in CASES:
            model = trainer_model(lora=lora)
            parallelize(model, mesh, ParallelConfig())
            sender = WeightSender(model, rank, "cpu")
            sender.timeout_s = 60
            plan = sender.make_plan(engine(dtype=dtype).parameter_shapes, dtype,
                                    lora_scaling=SCALING if lora else None,
                                    bucket_bytes=bucket_bytes)
            address = sender.serve(1, "127.0.0.1")
            if rank == 0:
                queue.put((plan, address))
            sender.join()
            sent = [sender.send(full=True)]
            if lora is not None:
                set_adapters(model, step=1)
                sent.append(sender.send(full=False))
            result[name] = {"sent": sent, "buckets": [len(plan.buckets(True)),
                                                      len(plan.buckets(False))]}
            sender.close()
    except Exception:
        result["error"] = traceback.format_exc()
    torch.save(result, os.path.join(out_dir, f"trainer{rank}.pt"))
    if "error" in result:
        return
    close_process_group()
    os._exit(0)       # gloo objects held by FSDP modules may abort at interpreter exit


def _engine(queue) -> dict:
    """The engine side, in the test's own process (a process apart from the trainers)."""
    result: dict = {}
    for name, dtype, lora, _ in CASES:
        plan, address = queue.get(timeout=120)    # a trainer that failed never sends
        e = engine(dtype=dtype)
        receiver = WeightReceiver(e, plan)
        receiver.join(address, 1, timeout_s=60)
        received = [receiver.receive(full=True)]
        result[name] = {"synced": [engine_state(e)]}
        if lora is not None:
            received.append(receiver.receive(full=False))
            result[name]["synced"].append(engine_state(e))
        result[name]["received"] = received
        receiver.group.close()
    return result


@pytest.fixture(scope="module")
def broadcast_results(tmp_path_factory):
    from posttrain.distributed import free_port
    out = tmp_path_factory.mktemp("weight_sync")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    trainers = [ctx.Process(target=_trainer, args=(r, port, queue, str(out)))
                for r in range(TRAINERS)]
    for p in trainers:
        p.start()
    try:
        results = {"engine": _engine(queue)}
    finally:
        for p in trainers:
            p.join(timeout=60)
    for r in range(TRAINERS):
        results[r] = torch.load(out / f"trainer{r}.pt", weights_only=False)
        assert "error" not in results[r], f"trainer {r} failed:\n{results[r]['error']}"
    return results


@pytest.mark.parametrize("case", ["fp32_small_buckets", "bf16_engine"])
def test_broadcast_from_two_fsdp_ranks_gives_the_engine_the_exact_weights(broadcast_results,
                                                                           case):
    dtype = dict((c[0], c[1]) for c in CASES)[case]
    got = broadcast_results["engine"][case]
    assert_equal_states(got["synced"][0], expected(trainer_model(), dtype, lora=False))
    want_bytes = sum(t.numel() for t in got["synced"][0].values()) * dtype.itemsize
    assert got["received"] == broadcast_results[0][case]["sent"] == [want_bytes]
    if case == "fp32_small_buckets":       # 4 KB buckets: many, the embedding alone in one
        assert broadcast_results[0][case]["buckets"][0] > 10


def test_broadcast_lora_sync_moves_only_the_adapters(broadcast_results):
    got = broadcast_results["engine"]["lora"]
    first, second = got["synced"]
    assert_equal_states(first, expected(trainer_model(lora=LORA), torch.float32, lora=True))
    stepped = trainer_model(lora=LORA, step=1)
    assert_equal_states(second, expected(stepped, torch.float32, lora=True))
    adapters = sum(p.numel() * 4 for n, p in stepped.named_parameters() if is_adapter_name(n))
    weights = sum(t.numel() * 4 for t in first.values())
    assert got["received"] == broadcast_results[1]["lora"]["sent"] == [weights + adapters,
                                                                       adapters]
