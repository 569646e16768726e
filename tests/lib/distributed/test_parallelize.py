"""FSDP2 / TP / activation checkpointing on 2 real gloo processes give the 1-process numbers."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from posttrain.distributed import (ParallelConfig, build_mesh, close_process_group, count_params,
                                   free_port, gather_full_state_dict, init_process_group,
                                   parallelize)
from posttrain.distributed.parallelize import UnsupportedParallelismError, parallelize_frozen
from posttrain.errors import ConfigError

VOCAB, HIDDEN, HEADS, HEAD_DIM, INTER, LAYERS = 64, 32, 4, 8, 48, 2
BATCH_PER_RANK, SEQ, STEPS, LR = 2, 12, 3, 2e-3
WORLD = 2


# --- a tiny stand-in with the native model's structure ------------------------------------

class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads = HEADS
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
                                  for _ in range(3))
        self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(B, T, -1))


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, INTER, bias=False)
        self.up = nn.Linear(HIDDEN, INTER, bias=False)
        self.down = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.attn, self.mlp = _Attn(), _MLP()

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB, HIDDEN))


class TinyLM(nn.Module):
    def __init__(self, tie: bool = True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        nn.init.normal_(self.embed.weight, std=0.1)
        self.layers = nn.ModuleList(_Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = _Head()
        if tie:
            self.head.weight = self.embed.weight
        else:
            nn.init.normal_(self.head.weight, std=0.1)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class LossWrapper(nn.Module):
    """What the trainer does: the loss reads `head.weight`, so it runs inside the root forward."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        hidden = self.model(input_ids)
        logits = hidden @ self.model.head.weight.t()
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _make_model(tie=True) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(tie)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of every step (the same one, so the loss must fall): [STEPS, B, T]."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (WORLD * BATCH_PER_RANK, SEQ + 1), generator=g)
    ids = ids.expand(STEPS, -1, -1)
    return ids[..., :-1], ids[..., 1:]


def _train(root: nn.Module, params, batches) -> list[float]:
    # Adam's first update is lr * g / (|g| + eps): for a gradient near 0 a reduction-order
    # difference of 1e-9 can move the weight by ~lr. A larger eps bounds that by lr * 1e-9 / eps.
    opt = torch.optim.AdamW(params, lr=LR, eps=1e-6)
    losses = []
    for ids, labels in batches:
        loss = root(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().float()
        if dist.is_initialized():
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def _reference(tie=True) -> tuple[list[float], dict]:
    model = _make_model(tie)
    ids, labels = _batch()
    losses = _train(LossWrapper(model), model.parameters(), zip(ids, labels))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- the 2-process side ----------------------------------------------------------------

def _distributed_run(cfg: ParallelConfig, tie: bool = True) -> tuple[list[float], dict, int]:
    model = _make_model(tie)
    root = parallelize(model, build_mesh(cfg.dp_shard, cfg.tp), cfg, root=LossWrapper(model))
    ids, labels = _batch()
    dp_rank = dist.get_rank() if cfg.tp == 1 else 0
    dp_size = WORLD // cfg.tp
    per = ids.shape[1] // dp_size  # each data-parallel rank trains its slice of the global batch
    local = zip(ids[:, dp_rank * per:(dp_rank + 1) * per],
                labels[:, dp_rank * per:(dp_rank + 1) * per])
    losses = _train(root, root.parameters(), local)
    return losses, gather_full_state_dict(model), count_params(model)


def _frozen_run() -> dict:
    """A frozen root (`parallelize_frozen`): its forward on this rank's slice of the batch, the
    share of the parameters this rank holds between calls, and that nothing needs gradients."""
    model = _make_model()
    root = parallelize_frozen(model, build_mesh(), ParallelConfig(), root=LossWrapper(model))
    ids, labels = _batch()
    per = ids.shape[1] // WORLD
    mine = slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)
    with torch.no_grad():
        loss = root(ids[0, mine], labels[0, mine])
    local = sum(p.to_local().numel() for p in root.parameters())
    return {"loss": loss.item(), "local_numel": local,
            "numel": sum(p.numel() for p in root.parameters()),
            "trainable": sum(p.requires_grad for p in root.parameters())}


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    results = {}
    try:
        init_process_group(timeout_s=60)
        init_process_group()  # idempotent
        for name, cfg, tie in [
            ("fsdp", ParallelConfig(), True),
            ("fsdp_ac", ParallelConfig(activation_checkpointing="full"), True),
            ("fsdp_untied_no_reshard", ParallelConfig(reshard_after_forward=False), False),
            ("tp", ParallelConfig(dp_shard=1, tp=2), True),
            ("bf16", ParallelConfig(mixed_precision="bf16"), True),
            ("bf16_offload", ParallelConfig(mixed_precision="bf16", offload=True), True),
            ("tp_offload", ParallelConfig(dp_shard=1, tp=2, offload=True), True),
        ]:
            results[name] = _distributed_run(cfg, tie)
        results["frozen"] = _frozen_run()
        try:
            build_mesh(dp_shard=2, tp=2)
        except ConfigError as e:
            results["bad_mesh"] = str(e)
    except Exception:
        results["error"] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    if "error" in results:
        if dist.is_initialized():  # no barrier: the peer may never reach it
            dist.destroy_process_group()
        return
    close_process_group()
    # Skip interpreter finalization, where gloo objects still referenced by the FSDP modules
    # now and then abort the process (see test_checkpoint_distributed.py).
    os._exit(0)


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return results


def test_frozen_root_is_sharded_and_computes_the_plain_forward(two_rank_results):
    model = _make_model()
    ids, labels = _batch()
    per = ids.shape[1] // WORLD
    for rank, res in enumerate(two_rank_results):
        got = res["frozen"]
        with torch.no_grad():
            want = LossWrapper(model)(ids[0, rank * per:(rank + 1) * per],
                                      labels[0, rank * per:(rank + 1) * per])
        assert got["loss"] == pytest.approx(want.item(), abs=1e-6)
        assert got["trainable"] == 0
        assert got["local_numel"] * WORLD == got["numel"]  # every dim 0 here splits evenly


@pytest.mark.parametrize("name", ["fsdp", "fsdp_ac", "tp"])
def test_losses_match_single_process(two_rank_results, name):
    ref_losses, _ = _reference()
    for res in two_rank_results:
        assert res[name][0] == pytest.approx(ref_losses, abs=1e-5)
    assert ref_losses[-1] < ref_losses[0]  # it did train


def test_untied_head_and_no_reshard(two_rank_results):
    ref_losses, ref_sd = _reference(tie=False)
    losses, sd, _ = two_rank_results[0]["fsdp_untied_no_reshard"]
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert sd.keys() == ref_sd.keys()


@pytest.mark.parametrize("name", ["fsdp", "fsdp_ac", "tp"])
def test_full_state_dict_on_rank0_equals_single_process(two_rank_results, name):
    _, ref_sd = _reference()
    _, sd, _ = two_rank_results[0][name]
    assert sd.keys() == ref_sd.keys()
    for key, ref in ref_sd.items():
        assert sd[key].device.type == "cpu"
        torch.testing.assert_close(sd[key], ref, atol=1e-5, rtol=0,
                                   msg=lambda m: f"{key}: {m}")
    assert two_rank_results[1][name][1] == {}


def test_count_params_is_global(two_rank_results):
    expected = sum(p.numel() for p in _make_model().parameters())
    for res in two_rank_results:
        assert res["fsdp"][2] == expected
        assert res["tp"][2] == expected


def test_bf16_trains_close_and_keeps_fp32_weights(two_rank_results):
    ref_losses, _ = _reference()
    losses, sd, _ = two_rank_results[0]["bf16"]
    assert losses == pytest.approx(ref_losses, abs=5e-3)
    assert all(v.dtype == torch.float32 for v in sd.values())


@pytest.mark.parametrize("name,plain", [("bf16_offload", "bf16"), ("tp_offload", "tp")])
def test_offload_composes_with_bf16_and_tensor_parallelism(two_rank_results, name, plain):
    """parallel.offload (FSDP2 CPU offload) under bf16 mixed precision and under TP trains
    exactly as without it: same losses and full weights."""
    for res in two_rank_results:
        assert res[name][0] == pytest.approx(res[plain][0], abs=1e-6, rel=0)
    got, want = two_rank_results[0][name][1], two_rank_results[0][plain][1]
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6


def test_bad_mesh_in_a_group_is_a_config_error(two_rank_results):
    for res in two_rank_results:
        assert "dp_shard=2 x parallel.tp=2 = 4" in res["bad_mesh"]


# --- single-process checks --------------------------------------------------------------

@pytest.mark.parametrize("dp_shard,tp,world,match", [
    (3, 1, 2, "world size is 2"),
    (-1, 3, 4, "does not divide"),
    (0, 1, 2, "dp_shard must be"),
    (1, 0, 2, "tp must be"),
])
def test_bad_mesh_sizes_raise_clear_errors(monkeypatch, dp_shard, tp, world, match):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError, match=match):
        build_mesh(dp_shard=dp_shard, tp=tp)


def test_parallel_config_validates():
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        ParallelConfig(activation_checkpointing="partial")
    with pytest.raises(ConfigError, match="ac_every"):
        ParallelConfig(activation_checkpointing="selective", ac_every=0)
    with pytest.raises(ConfigError, match="mixed_precision"):
        ParallelConfig(mixed_precision="fp16")


def test_tp_refuses_blocks_without_linear_mlp():
    from posttrain.distributed.tensor_parallel import check_tp_block
    block = _Block()
    block.mlp = nn.Sequential(nn.Linear(HIDDEN, HIDDEN))
    with pytest.raises(UnsupportedParallelismError, match="gated MLP"):
        check_tp_block(block, 0, 2)
    with pytest.raises(UnsupportedParallelismError, match="num_heads=4"):
        check_tp_block(_Block(), 0, 3)


def test_activation_checkpointing_and_compile_keep_names_and_numbers():
    from posttrain.distributed import apply_activation_checkpointing, apply_compile
    ref = _make_model()
    model = _make_model()
    apply_activation_checkpointing(model, "full")
    apply_compile(model, backend="eager")
    _assert_same_loss_and_grads(model, ref)


def _assert_same_loss_and_grads(model: nn.Module, ref: nn.Module) -> None:
    """One forward and backward of both: the same names, loss and every gradient."""
    assert model.state_dict().keys() == ref.state_dict().keys()
    ids, labels = _batch()
    loss, ref_loss = LossWrapper(model)(ids[0], labels[0]), LossWrapper(ref)(ids[0], labels[0])
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_selective_activation_checkpointing_wraps_every_kth_block_and_keeps_numbers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import \
        CheckpointWrapper

    from posttrain.distributed import apply_activation_checkpointing
    ref = _make_model()
    model = _make_model()
    apply_activation_checkpointing(model, "selective", every=2)
    wrapped = [i for i, b in enumerate(model.layers) if isinstance(b, CheckpointWrapper)]
    assert wrapped == list(range(0, len(model.layers), 2)) and len(model.layers) > 1
    _assert_same_loss_and_grads(model, ref)


def test_plain_single_process_forms_a_group_of_one_and_matches(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    ref_losses, ref_sd = _reference()
    try:
        mesh = build_mesh()
        assert dist.get_world_size() == 1 and tuple(mesh.shape) == (1, 1, 1, 1)
        model = _make_model()
        cfg = ParallelConfig(activation_checkpointing="full")
        root = parallelize(model, mesh, cfg, root=LossWrapper(model))
        ids, labels = _batch()
        assert _train(root, root.parameters(), zip(ids, labels)) == pytest.approx(ref_losses,
                                                                                  abs=1e-6)
        sd = gather_full_state_dict(model)
        for key, ref in ref_sd.items():
            torch.testing.assert_close(sd[key], ref, atol=1e-6, rtol=0)
        close_process_group()
        assert not dist.is_initialized()
        close_process_group()  # a no-op without a group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_partial_launcher_environment_is_an_error(monkeypatch):
    from posttrain.errors import PosttrainError
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(PosttrainError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        init_process_group()
    assert not dist.is_initialized()


def test_mesh_that_does_not_match_the_config_is_refused():
    from posttrain.distributed.parallelize import _check_mesh

    class _FakeMesh:
        mesh_dim_names = ("dp_replicate", "dp_shard", "cp", "tp")

        def __getitem__(self, name):
            sizes = {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}
            return type("M", (), {"size": lambda self: sizes[name]})()

    with pytest.raises(ConfigError, match="mesh is dp_replicate=1 x dp_shard=2 x cp=1 x tp=1"):
        _check_mesh(_FakeMesh(), ParallelConfig(tp=2))
    with pytest.raises(ConfigError, match="dp_replicate=2"):
        _check_mesh(_FakeMesh(), ParallelConfig(dp_replicate=2))
    with pytest.raises(ConfigError, match="cp=2"):
        _check_mesh(_FakeMesh(), ParallelConfig(cp=2))
    _check_mesh(_FakeMesh(), ParallelConfig())


def test_free_port_lies_below_the_ephemeral_range_and_skips_a_listened_port(monkeypatch):
    """A rendezvous port the kernel could hand an outgoing connection as its local port fails
    rank 0 with EADDRINUSE (seen in CI): `free_port` picks below that range, never a port
    something listens on; where the range leaves no room the kernel picks."""
    import random
    import socket

    from posttrain.distributed import env
    low = env.ephemeral_ports()[0]
    ports = {env.free_port("127.0.0.1") for _ in range(20)}
    assert all(20_000 <= p < low for p in ports) and len(ports) > 1, ports
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", low - 1))
        taken.listen(1)
        draws = []

        class FirstTheTakenPort(random.Random):
            def randrange(self, a, b):
                draws.append(low - 1 if not draws else super().randrange(a, b))
                return draws[-1]

        monkeypatch.setattr(env.random, "SystemRandom", FirstTheTakenPort)
        got = env.free_port("127.0.0.1")
        assert draws[0] == low - 1 and len(draws) == 2 and got == draws[1] != low - 1
        monkeypatch.setattr(env, "ephemeral_ports", lambda: (20_500, 60_999))
        assert not 20_000 <= env.free_port("127.0.0.1") < 20_500   # no room: the kernel picks
