"""Engine: sharded build from an HF checkpoint, vocabulary growth, one step against a reference."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from posttrain.distributed.env import init_process_group

from posttrain.models.hf_io import load_hf
from posttrain.train.engine import Engine, EngineConfig, ModelConfig, ModelInitConfig, \
    write_random_hf_model
from posttrain.train.export import export_hf
from posttrain.train.host_heap import resident_bytes
from posttrain.train.optim import OptimizerConfig

INIT = ModelInitConfig(family="qwen3", overrides={"hidden_size": 32, "intermediate_size": 64,
                                                   "num_hidden_layers": 2, "head_dim": 8,
                                                   "tie_word_embeddings": True}, seed=3)


def _engine(tmp_path, hf_dir, **kw):
    cfg = EngineConfig(max_steps=4, optimizer=OptimizerConfig(lr=1e-2), **kw.pop("cfg", {}))
    init_process_group()
    return Engine(ModelConfig(init=INIT), cfg, hf_dir, str(tmp_path / "run"), **kw)


def test_building_an_engine_has_no_global_side_effects(tmp_path):
    """No process group is started behind the caller's back, and the global RNG is untouched."""
    hf_dir = write_random_hf_model(INIT, 300, tmp_path / "base")
    cfg = EngineConfig(max_steps=4)
    if dist.is_initialized():
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="init_process_group"):
        Engine(ModelConfig(init=INIT), cfg, hf_dir, str(tmp_path / "run"))
    assert not dist.is_initialized()
    init_process_group()
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    Engine(ModelConfig(init=INIT), cfg, hf_dir, str(tmp_path / "run"))
    assert torch.equal(torch.get_rng_state(), before)


_BUILD_FROM_THE_CACHE = """
import sys, torch
from posttrain.config.model import ModelInitConfig
from posttrain.models.random_init import write_random_hf_model
write_random_hf_model(ModelInitConfig(**{init!r}), 300, {out!r})
sys.stdout.buffer.write(torch.get_rng_state().numpy().tobytes())
assert "transformers.modeling_utils" not in sys.modules, "built, not copied"
assert "posttrain.train.engine" not in sys.modules, "a launcher would import the engine"
"""


def test_a_kept_random_model_is_the_one_a_build_writes(tmp_path, monkeypatch):
    """POSTTRAIN_INIT_CACHE: another process copies the checkpoint a build kept (the same
    bytes, the generator left in the same state) without importing transformers' model code
    or the training stack; another seed is another entry."""
    monkeypatch.setenv("POSTTRAIN_INIT_CACHE", str(tmp_path / "cache"))
    built = Path(write_random_hf_model(INIT, 300, tmp_path / "built"))
    state = torch.get_rng_state().numpy().tobytes()
    script = _BUILD_FROM_THE_CACHE.format(init=dataclasses.asdict(INIT),
                                          out=str(tmp_path / "copied"))
    copied = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert copied.returncode == 0, copied.stderr.decode()[-2000:]
    assert copied.stdout == state
    names = sorted(p.name for p in built.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "copied").iterdir())
    for name in names:
        assert (built / name).read_bytes() == (tmp_path / "copied" / name).read_bytes(), name
    other = Path(write_random_hf_model(dataclasses.replace(INIT, seed=4), 300, tmp_path / "o"))
    assert (other / "model.safetensors").read_bytes() != (built / "model.safetensors").read_bytes()
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_build_matches_checkpoint(tmp_path):
    hf_dir = write_random_hf_model(INIT, 300, tmp_path / "base")
    engine = _engine(tmp_path, hf_dir)
    reference = load_hf(hf_dir)
    assert engine.args.padded_vocab_size == 320
    for name, p in reference.named_parameters():
        assert torch.equal(engine.model.get_parameter(name).full_tensor(), p.detach()), name


def test_vocab_grows_for_added_tokens(tmp_path):
    hf_dir = write_random_hf_model(INIT, 300, tmp_path / "base")
    engine = _engine(tmp_path, hf_dir, vocab_size=330)
    old = load_file(f"{hf_dir}/model.safetensors")["model.embed_tokens.weight"]
    emb = engine.model.embed.weight.full_tensor()
    assert engine.args.vocab_size == 330 and emb.shape[0] == 384
    assert torch.equal(emb[:300], old)
    torch.testing.assert_close(emb[300:330], old.mean(0).expand(30, -1))
    assert emb[330:].abs().sum() == 0
    out = export_hf(engine.full_state_dict(), engine.args, str(tmp_path / "hf"))
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.config.vocab_size == 330
    assert hf.get_input_embeddings().weight.shape[0] == 330


def test_one_step_equals_plain_adamw_on_the_loss(tmp_path):
    hf_dir = write_random_hf_model(INIT, 300, tmp_path / "base")
    engine = _engine(tmp_path, hf_dir, cfg={"grad_clip_norm": 0.0})
    ref = load_hf(hf_dir)
    opt = torch.optim.AdamW([p for p in ref.parameters()], lr=1e-2, betas=(0.9, 0.95),
                            eps=1e-8, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (2, 16), generator=gen)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    pos = torch.arange(16).expand(2, 16)
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos, "document_lengths": None}
    n = int((labels != -100).sum())
    metrics = engine.train_step([batch], n)
    logits = ref.logits(ref(ids))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             ignore_index=-100)
    loss.backward()
    opt.step()
    assert abs(metrics["loss"] - loss.item()) < 1e-5
    for name, p in ref.named_parameters():
        torch.testing.assert_close(engine.model.get_parameter(name).full_tensor(), p.detach(),
                                   atol=1e-5, rtol=1e-4)  # Adam amplifies 1e-9 grad noise


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap, Linux's VmRSS")
def test_a_host_budget_keeps_pages_after_the_first_step_and_changes_no_number(tmp_path):
    """On a CPU the engine's heap (`host_heap.HostHeap`) releases at every point of the first
    step; with a budget the rank fits, later points keep their pages, and without one every
    point releases. Catches a budget the engine does not hand its heap, a heap that never
    settles, and a release policy that touches the numbers (losses and weights are bitwise
    those of the run that releases everywhere)."""
    hf_dir = write_random_hf_model(INIT, 300, tmp_path / "base")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (2, 16), generator=gen)
    labels = torch.roll(ids, -1, 1)
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(16).expand(2, 16),
             "document_lengths": None}
    runs = {}
    for budget in (None, resident_bytes()[0] + (4 << 30)):
        engine = _engine(tmp_path / str(budget), hf_dir, host_budget=budget)
        losses = [engine.train_step([batch], 32)["loss"] for _ in range(3)]
        runs[budget] = (losses, engine.full_state_dict(), engine.heap)
    (plain_losses, plain_state, plain), (losses, state, heap) = runs.values()
    # a step's points: before the forward, after each of the 2 blocks, after the forward,
    # after the backward, after the optimizer step
    assert (plain.released, plain.kept) == (3 * 6, 0)
    assert heap.settled and (heap.released, heap.kept) == (6, 2 * 6)
    assert losses == plain_losses
    assert all(torch.equal(state[k], plain_state[k]) for k in plain_state)


def test_lora_checkpoint_holds_adapters_only_and_resumes_bit_identical(tmp_path):
    """The frozen base is rebuilt from its HF checkpoint, not saved; resuming from the
    adapter-only checkpoint gives exactly the weights of the uninterrupted run (adapter
    dropout draws from the restored RNG). The 4 tokens the tokenizer added (ids 300..303)
    train as embedding rows beside the adapters (model.lora.trainable_tokens: added, the
    default), are checkpointed with them and exported into the merged embedding."""
    from torch.distributed.checkpoint import FileSystemReader

    from posttrain.train.engine import LoraSettings

    hf_dir = write_random_hf_model(INIT, 300, tmp_path / "base")
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, 304, (2, 16), generator=gen)
        ids[:, ::4] = torch.arange(300, 304)
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = -100
        batches.append({"input_ids": ids, "labels": labels,
                        "position_ids": torch.arange(16).expand(2, 16), "document_lengths": None})

    def engine(run: str) -> Engine:
        init_process_group()
        torch.manual_seed(0)                    # the LoRA dropout's stream, as a worker seeds it
        return Engine(ModelConfig(init=INIT, lora=LoraSettings(rank=4, alpha=8.0, dropout=0.1)),
                      EngineConfig(max_steps=4, optimizer=OptimizerConfig(lr=1e-2)), hf_dir,
                      str(tmp_path / run), vocab_size=304, added_tokens=range(300, 304))

    def steps(e: Engine, todo: list[dict]) -> None:
        for b in todo:
            e.train_step([b], int((b["labels"] != -100).sum()))

    whole = engine("whole")
    steps(whole, batches)
    want = whole.full_state_dict()

    first = engine("killed")
    steps(first, batches[:2])
    path = first.save_checkpoint({})
    del first
    saved = set(FileSystemReader(f"{path}/dcp").read_metadata().state_dict_metadata)
    model_keys = {k for k in saved if k.startswith("model.")}
    assert model_keys and all("lora_" in k or "token_adapter" in k for k in model_keys)
    assert "model.model.embed.token_adapter.delta" in model_keys, sorted(model_keys)[:5]

    resumed = engine("killed")
    assert resumed.load_checkpoint() is not None and resumed.step == 2
    steps(resumed, batches[2:])
    got = resumed.full_state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # the adapters trained (B starts at zero), so equal weights are not trivially equal
    lora_b = [k for k in want if "lora_B" in k]
    assert lora_b and all(want[k].abs().sum() > 0 for k in lora_b)
    delta = want["embed.token_adapter.delta"]
    assert delta.shape == (4, 32) and (delta.norm(dim=-1) > 0).all()

    # the merged export writes the rows: W[t] + D for the added ids, the base elsewhere
    out = export_hf(got, resumed.args, str(tmp_path / "merged"), fmt="merged",
                    lora=resumed.model_cfg.lora)
    embed = load_file(f"{out}/model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(embed[300:], want["embed.weight"][300:304] + delta)
    assert torch.equal(embed[:300], want["embed.weight"][:300])


def test_lora_refuses_to_leave_added_token_rows_frozen(tmp_path):
    from posttrain.errors import ConfigError
    from posttrain.train.engine import LoraSettings

    hf_dir = write_random_hf_model(INIT, 300, tmp_path / "base")
    init_process_group()
    with pytest.raises(ConfigError, match=r"tokenizer added 4 tokens \(ids 300..303.*"
                                          r"model\.lora\.trainable_tokens: added"):
        Engine(ModelConfig(init=INIT, lora=LoraSettings(rank=4, trainable_tokens="none")),
               EngineConfig(max_steps=1), hf_dir, str(tmp_path / "run"), vocab_size=304,
               added_tokens=range(300, 304))
