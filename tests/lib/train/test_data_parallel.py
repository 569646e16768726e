"""Data goes by data-parallel rank, not by global rank: tensor parallelism does not change a run.

The ranks of one tensor-parallel group hold slices of the same weights, so they must see the
same micro-batches, and sums over the data (the loss, the gradient scale) are taken over the
data-parallel ranks only. Three layouts of the same run, on real gloo process groups:

    1 rank                 the reference
    dp_shard=2, tp=1       2 ranks, each its half of the step's micro-batches
    dp_shard=2, tp=2       4 ranks; ranks {0,1} and {2,3} are tensor-parallel pairs
    dp_replicate=2 x dp_shard=2   4 ranks, HSDP (SFT only): two sharded replicas, 4 DP ranks
    cp=2; dp_shard=2 x cp=2       SFT with every packed row cut over two ranks (context
                                  parallelism: the cp ranks see the same micro-batches)
    dp_shard=2, parallel.offload  SFT (qwen3) with shards, gradients and Adam state in host
                                  memory (FSDP2's CPUOffloadPolicy), stopped after step 2 and
                                  resumed from its checkpoint for step 3
    dp_shard=2, parallel.ep=2     SFT of Qwen3-MoE with its experts split over the two ranks
                                  (expert parallelism through the engine: sharded experts,
                                  all-to-all dispatch, clipping over their mesh, export)

must give the same per-step losses (1e-5, fp32) and the same exported weights (1e-5), for SFT
(chunked cross-entropy over packed documents) and DPO (packed pairs, precomputed reference),
on the native Qwen3 and Llama definitions; and, on Qwen3 at 1 rank and dp2, for KTO (packed
unpaired completions, whose reference point z_0 comes from the previous step's log-ratios summed
over the ranks: `posttrain.losses.kto`). Before the data rule used the DP rank, the 4-rank
layout fed the two ranks of a TP pair different micro-batches and scaled the gradient by the
world size (4) instead of the data-parallel size (2).

The offload layout must equal dp_shard=2 without offload within 1e-6 (losses, grad norms,
exported weights): it catches an optimizer built over other tensors than the offloaded shards
(FSDP2 makes host copies of them where the model was not materialized on the CPU), a policy that
is not applied, and optimizer state that a DCP resume does not bring back to host memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from posttrain.config.loader import build, to_dict
from posttrain.distributed.env import free_port

ROOT = Path(__file__).resolve().parents[3]
STEPS = 3
# world, dp_shard, tp, dp_replicate, cp
LAYOUTS = {"1": (1, 1, 1, 1, 1), "dp2": (2, 2, 1, 1, 1), "dp2_tp2": (4, 2, 2, 1, 1),
           "hsdp": (4, 2, 1, 2, 1), "cp2": (2, 1, 1, 1, 2), "dp2_cp2": (4, 2, 1, 1, 2),
           "dp2_offload": (2, 2, 1, 1, 1), "ep2": (2, 2, 1, 1, 1)}
# the recipes a layout runs (default: all); context parallelism is built for SFT
ONLY = {"hsdp": ("sft",), "cp2": ("sft",), "dp2_cp2": ("sft",), "dp2_offload": ("sft",),
        "ep2": ("sft",), "dp2_tp2": ("sft", "dpo")}
OFFLOAD, RESUME_AT = "dp2_offload", 2         # the offload layout: qwen3 only, resumed here
EP = {"ep2": 2}
FAMILIES = ("qwen3", "llama")
MOE = "qwen3_moe"          # SFT at 1 rank and ep2 only
# the families a layout runs (default: FAMILIES; the 1-rank reference also runs MOE's SFT)
FAMILIES_OF = {OFFLOAD: ("qwen3",), "ep2": (MOE,), "1": (*FAMILIES, MOE)}
RECIPES = ("sft", "dpo", "kto")
RECIPE_FAMILIES = {"kto": ("qwen3",)}       # the recipes that run on some families only
ATOL = 1e-5

_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "tie_word_embeddings": False}
# Adam turns float noise in near-zero gradient elements into updates of up to lr each step, so
# the weights of two layouts (whose sums run in another order) drift apart in proportion to lr:
# at lr 3e-3, dp2 x tp2 ended 3e-5 from 1 rank after 3 steps while the losses agreed to 4e-7.
_OPTIM = {"optimizer": {"lr": 5e-4, "weight_decay": 0.0, "betas": [0.9, 0.95]},
          "scheduler": {"kind": "constant", "warmup_steps": 0}, "grad_clip_norm": 1.0,
          "seed": 0, "checkpoint_every_steps": 100, "keep_checkpoints": 1}
_LOADER = {"rows_per_batch": 1, "shuffle_buffer_samples": 16, "seed": 0, "epochs": 1}


def _config(recipe: str, family: str, world: int, dp_shard: int, tp: int,
            data: Path = ROOT / "assets" / "data", dp_replicate: int = 1, cp: int = 1,
            offload: bool = False, ep: int = 1) -> dict:
    """The recipe's config: 4 micro-batches of 1 x 128 tokens per step, data under `data`.
    Qwen3-MoE trains without the load-balancing loss, whose f_e expert parallelism takes over
    the expert group's micro-batches (one rank: each micro-batch's own)."""
    model = {"init": {"family": family, "seed": 0, "overrides": _MODEL},
             "dtype": "float32", "loss_chunk_tokens": 64}
    if family == MOE:
        model["moe_aux_loss_coef"] = 0.0
    common = {
        "run": {"num_workers": world, "launcher": "ray" if world > 1 else "inline"},
        "tokenizer": {"path": str(ROOT / "assets" / "tokenizer")},
        "model": model,
        "eval": {"max_batches": 3},
    }
    parallel = {"dp_shard": dp_shard, "tp": tp, "dp_replicate": dp_replicate, "cp": cp,
                "activation_checkpointing": "none", "offload": offload, "ep": ep}
    if recipe == "kto":
        return {**common,
                "data": {"format": "unpaired", "max_tokens_per_sample": 64, "on_bad_row": "skip",
                         "train": [{"name": "kto", "path": str(data / "unpaired/train.jsonl")}],
                         "eval": [{"name": "kto", "path": str(data / "unpaired/eval.jsonl")}]},
                "train": {"max_steps": STEPS, "tokens_per_step": 512, "parallel": parallel,
                          "loader": {**_LOADER, "format": "unpaired",
                                     "packing": {"max_tokens_per_pack": 128,
                                                 "buffer_samples": 16}},
                          **_OPTIM, "optimizer": {**_OPTIM["optimizer"], "lr": 3e-3}},
                "loss": {"beta": 0.1, "loss_type": "kto"}, "reference": {"kind": "precomputed"}}
    if recipe == "sft":
        return {**common,
                "data": {"format": "chat", "max_tokens_per_sample": 128,
                         "train": [{"name": "chat", "path": str(data / "chat/train.jsonl")}],
                         "eval": [{"name": "chat", "path": str(data / "chat/eval.jsonl")}]},
                "train": {"max_steps": STEPS, "tokens_per_step": 512, "parallel": parallel,
                          "loader": {**_LOADER, "packing": {"max_tokens_per_pack": 128,
                                                            "buffer_samples": 16}},
                          **_OPTIM}}
    return {**common,
            "data": {"format": "preference", "max_tokens_per_sample": 64, "on_bad_row": "skip",
                     "train": [{"name": "pref", "path": str(data / "preference/train.jsonl")}],
                     "eval": [{"name": "pref", "path": str(data / "preference/eval.jsonl")}]},
            "train": {"max_steps": STEPS, "tokens_per_step": 512, "parallel": parallel,
                      "loader": {**_LOADER, "format": "preference",
                                 "packing": {"max_tokens_per_pack": 128, "buffer_samples": 16}},
                      **_OPTIM},
            "loss": {"beta": 0.1, "loss_type": "sigmoid"}, "reference": {"kind": "precomputed"}}


def _recipe(recipe: str) -> type:
    if recipe == "sft":
        from posttrain.train.sft import SFT
        return SFT
    from posttrain.train.dpo import DPO
    return DPO


def _prepare(root: Path) -> dict[tuple[str, str], tuple[str, str]]:
    """(recipe, family) -> (prepared dir, base HF checkpoint), made once in this process from
    the first rows of the bundled chat and preference data (DPO's reference pass reads all)."""
    from steps.common import base_model_dir, ensure_prepared
    for kind in ("chat", "preference", "unpaired"):
        for split, rows in (("train", 96), ("eval", 24)):
            lines = (ROOT / "assets/data" / kind / f"{split}.jsonl").read_text().splitlines()
            (root / "data" / kind).mkdir(parents=True, exist_ok=True)
            (root / "data" / kind / f"{split}.jsonl").write_text("\n".join(lines[:rows]) + "\n")
    out = {}
    for recipe in RECIPES:
        schema = _recipe(recipe).config_cls
        for family in (*FAMILIES, MOE) if recipe == "sft" else \
                RECIPE_FAMILIES.get(recipe, FAMILIES):
            cfg = build(schema, _config(recipe, family, 1, 1, 1, root / "data"), where="config")
            prepared = ensure_prepared(cfg, str(root / f"prepared_{recipe}"), show_progress=False)
            out[recipe, family] = prepared, base_model_dir(cfg, prepared, root / f"{recipe}_{family}")
    return out


def _rank(rank: int, world: int, port: int, layout: str, root: str, inputs: dict) -> None:
    """One rank of `layout`: every (recipe, family) run in turn, losses and weights to disk."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    _, dp_shard, tp, dp_replicate, cp = LAYOUTS[layout]
    for (recipe, family), (prepared, hf_dir) in sorted(inputs.items()):
        if recipe not in ONLY.get(layout, RECIPES) or family not in FAMILIES_OF.get(layout,
                                                                                  FAMILIES):
            continue
        from posttrain.train.recipe import RecipeWorker
        run_dir = Path(root) / layout / f"{recipe}_{family}"
        cfg = _config(recipe, family, world, dp_shard, tp, Path(root) / "data", dp_replicate,
                      cp, offload=layout == OFFLOAD, ep=EP.get(layout, 1))
        worker = RecipeWorker(_recipe(recipe), cfg, hf_dir, prepared, str(run_dir))
        worker.before_training()
        steps = []
        if layout == OFFLOAD:
            _assert_offloaded(worker.engine)
            steps = [worker.train_step() for _ in range(RESUME_AT)]
            worker.save_checkpoint()
            worker.close()
            worker = RecipeWorker(_recipe(recipe), cfg, hf_dir, prepared, str(run_dir))
            worker.before_training()
            assert worker.resume() == RESUME_AT
        steps += [worker.train_step() for _ in range(STEPS - len(steps))]
        evaluation = worker.evaluate()
        hf = worker.export(str(run_dir / "hf"))
        worker.close()
        if rank == 0:
            torch.save(_hf_tensors(hf), run_dir / "weights.pt")
            (run_dir / "result.json").write_text(json.dumps(
                {"losses": [m["loss"] for m in steps],
                 "grad_norms": [m["grad_norm"] for m in steps], "eval": evaluation,
                 "kl": [m.get("kl") for m in steps],
                 "dp": [worker.engine.dp.rank, worker.engine.dp.size]}))
    dist.destroy_process_group()


def _assert_offloaded(engine) -> None:
    """Every FSDP unit runs CPU offload and the optimizer holds the units' own shards (on a
    CPU-only machine the shards are in host memory either way: only the policy tells)."""
    from torch.distributed.fsdp import FSDPModule
    params = [p for m in engine.root.modules() if isinstance(m, FSDPModule)
              for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None
              for p in g.fsdp_params]
    assert params and all(p.offload_to_cpu for p in params)
    shards = {id(p.sharded_param) for p in params}
    held = [q for group in engine.optimizer.param_groups for q in group["params"]]
    assert held and all(id(q) in shards for q in held)


def _ranks(rank: int, world: int, layouts: list[str], root: str, inputs: dict) -> None:
    """One rank of each of `layouts` (of one world size) in turn, each in a process group of
    its own: the processes (and their imports) are shared, not the groups. Rank 0 takes a free
    port for each group just before it forms and hands it to the others in a file."""
    import time
    for layout in layouts:
        note = Path(root) / f"port-{layout}"
        if rank == 0:
            (tmp := note.with_suffix(".tmp")).write_text(str(free_port()))
            tmp.rename(note)
        deadline = time.monotonic() + 120
        while not note.is_file():
            assert time.monotonic() < deadline, f"{layout}: rank 0 gave no port"
            time.sleep(0.01)
        _rank(rank, world, int(note.read_text()), layout, root, inputs)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dp")
    inputs = _prepare(root)
    by_world: dict[int, list[str]] = {}
    for layout, (world, *_) in LAYOUTS.items():
        by_world.setdefault(world, []).append(layout)
    for world, group in by_world.items():
        mp.spawn(_ranks, args=(world, group, str(root), inputs), nprocs=world, join=True)
    return root


def _result(root: Path, layout: str, recipe: str, family: str) -> tuple[dict, dict]:
    run = root / layout / f"{recipe}_{family}"
    return (json.loads((run / "result.json").read_text()),
            torch.load(run / "weights.pt", weights_only=True))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("layout", ["dp2", "dp2_tp2", "hsdp", "cp2", "dp2_cp2"])
def test_layout_trains_like_one_rank(layouts, recipe, family, layout):
    if recipe not in ONLY.get(layout, RECIPES):
        pytest.skip(f"{layout} runs {ONLY[layout]} only")
    if family not in RECIPE_FAMILIES.get(recipe, (family,)):
        pytest.skip(f"{recipe} runs on {RECIPE_FAMILIES[recipe]} only")
    ref, ref_w = _result(layouts, "1", recipe, family)
    got, got_w = _result(layouts, layout, recipe, family)
    print(f"{recipe}/{family}/{layout}: losses {got['losses']} (1 rank: {ref['losses']}); "
          f"grad norms {got['grad_norms']} ({ref['grad_norms']})")
    assert len(got["losses"]) == STEPS
    assert got["losses"] == pytest.approx(ref["losses"], abs=ATOL, rel=0)
    assert ref["losses"][0] != ref["losses"][-1]                 # it trained
    if recipe == "kto":             # the reference point, from every rank's log-ratios
        assert got["kl"] == pytest.approx(ref["kl"], abs=ATOL, rel=0) and ref["kl"][-1] > 0
    # Adam is blind to a gradient's scale (and clipping hides it too): the norm is not
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4)
    for key, value in ref["eval"].items():
        assert got["eval"][key] == pytest.approx(value, abs=ATOL, rel=1e-6), key
    assert got_w.keys() == ref_w.keys()
    worst = max((got_w[k] - ref_w[k]).abs().max().item() for k in ref_w)
    assert worst <= ATOL, worst
    moved = max((ref_w[k] - w).abs().max().item()
                for k, w in _base_weights(layouts, recipe, family).items())
    assert moved > 30 * ATOL                                     # the weights did change


def test_offload_trains_like_no_offload_and_resumes(layouts):
    """parallel.offload (and a stop + DCP resume after step 2) against the same 2 ranks
    keeping everything on the device: equal within 1e-6."""
    ref, ref_w = _result(layouts, "dp2", "sft", "qwen3")
    got, got_w = _result(layouts, OFFLOAD, "sft", "qwen3")
    print(f"offload: losses {got['losses']} ({ref['losses']}); grad norms {got['grad_norms']}")
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-6, rel=0)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], abs=1e-6, rel=0)
    assert got_w.keys() == ref_w.keys()
    assert max((got_w[k] - ref_w[k]).abs().max().item() for k in ref_w) <= 1e-6


def test_expert_parallel_trains_like_one_rank(layouts):
    """Qwen3-MoE SFT with its experts split over two ranks (parallel.ep=2) against one rank:
    per-step losses, grad norms, eval and exported weights within 1e-5."""
    ref, ref_w = _result(layouts, "1", "sft", MOE)
    got, got_w = _result(layouts, "ep2", "sft", MOE)
    print(f"ep2: losses {got['losses']} ({ref['losses']}); grad norms {got['grad_norms']}")
    assert got["losses"] == pytest.approx(ref["losses"], abs=ATOL, rel=0)
    assert ref["losses"][0] != ref["losses"][-1]
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4)
    for key, value in ref["eval"].items():
        assert got["eval"][key] == pytest.approx(value, abs=ATOL, rel=1e-6), key
    assert got_w.keys() == ref_w.keys() and any("experts" in k for k in ref_w)
    assert max((got_w[k] - ref_w[k]).abs().max().item() for k in ref_w) <= ATOL


def _base_weights(root: Path, recipe: str, family: str) -> dict[str, torch.Tensor]:
    return _hf_tensors(str(root / f"{recipe}_{family}" / "base_model"))


def _hf_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    """The native-named tensors of an HF checkpoint."""
    from posttrain.models.hf_io import iter_hf_tensors, load_hf
    args = load_hf(hf_dir, on_meta=True, param_filter=lambda name: False).args
    return {name: t.clone() for name, t in iter_hf_tensors(hf_dir, args)}


def test_rank0_of_a_tensor_parallel_layout_is_data_parallel_rank0(layouts):
    got, _ = _result(layouts, "dp2_tp2", "sft", "qwen3")
    assert got["dp"] == [0, 2]
    got, _ = _result(layouts, "hsdp", "sft", "qwen3")
    assert got["dp"] == [0, 4]                  # replicas x shards: four data-parallel ranks


def test_a_step_that_does_not_split_over_the_data_parallel_ranks_is_refused():
    from posttrain.train.sft import SFTConfig
    cfg = _config("sft", "qwen3", 4, 2, 2)
    cfg["train"]["tokens_per_step"] = 384                   # 3 micro-batches over 2 DP ranks
    with pytest.raises(ValueError, match=r"do not split over 2 data-parallel ranks "
                                         r"\(run.num_workers=4 / parallel.tp=2\)"):
        build(SFTConfig, cfg, where="config")
    cfg["train"]["tokens_per_step"] = 512
    cfg["train"]["parallel"]["dp_shard"] = 3
    with pytest.raises(ValueError, match="dp_shard=3 x parallel.tp=2"):
        build(SFTConfig, cfg, where="config")
    assert to_dict(build(SFTConfig, _config("sft", "qwen3", 4, 2, 2), where="config"))


def test_context_parallel_configs_are_checked_at_launch():
    from posttrain.errors import ConfigError
    from posttrain.train.dpo import DPOConfig
    from posttrain.train.sft import SFTConfig

    def sft(**parallel):
        cfg = _config("sft", "qwen3", 2, 1, 1)
        cfg["train"]["parallel"].update(parallel)
        return cfg

    build(SFTConfig, sft(cp=2), where="config")                       # 128-token packs: 4 chunks
    with pytest.raises((ConfigError, ValueError), match="multiple of 6"):
        build(SFTConfig, sft(cp=3, dp_shard=1) | {"run": {"num_workers": 3,
                                                          "launcher": "ray"}}, where="config")
    dpo = _config("dpo", "qwen3", 2, 1, 1)
    dpo["train"]["parallel"]["cp"] = 2
    with pytest.raises((ConfigError, ValueError), match="the DPO recipe needs parallel.cp=1"):
        build(DPOConfig, dpo, where="config")
