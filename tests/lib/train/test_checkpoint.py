"""Single-process checkpoints: exact resume, pruning, crash safety, a full disk, damage
fallback, s3, s3 outages."""

from __future__ import annotations

import copy
import errno
import io
import json
import logging
import os
import pickle
import random
import re
import time

import numpy as np
import pytest
import torch
from torch import nn

from posttrain.errors import ConfigError, PosttrainError
from posttrain.retry import RetryConfig
from posttrain.train import checkpoint as ckpt_mod
from posttrain.train import checkpoint_storage as storage_mod
from posttrain.train.checkpoint import (
    Checkpoint,
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    CheckpointStorageError,
)
from posttrain.train.rng import capture_rng, restore_rng


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(model, opt, sched, steps: int) -> list[float]:
    """Steps whose losses depend on weights, optimizer, scheduler and the global RNGs."""
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 6) + float(np.random.rand()) + random.random()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def _assert_same_tree(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same_tree(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_tree(x, y)
    else:
        assert a == b


def _snapshot(model, opt, sched):
    return copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict()))


def _manager(tmp_path, **kw) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(dir=str(tmp_path / "ckpt"), **kw))


def test_rng_state_is_json_and_restores_draws():
    state = json.loads(json.dumps(capture_rng()))
    first = _draws()
    np.random.randn()  # leave a cached gaussian behind, then go back
    restore_rng(state)
    assert _draws() == first


def test_config_rejects_impossible_values():
    with pytest.raises(ConfigError, match="keep_last"):
        CheckpointConfig(dir="x", keep_last=0)
    with pytest.raises(ConfigError, match="every_steps"):
        CheckpointConfig(dir="x", every_steps=0)
    assert issubclass(CheckpointError, PosttrainError)


def test_save_perturb_load_restores_everything_bit_identical(tmp_path):
    model, opt, sched = _setup()
    _train(model, opt, sched, 2)
    mgr = _manager(tmp_path)
    path = mgr.save(2, model, opt, scheduler=sched, extra={"tokens_seen": 96},
                    rank_extra={"cursor": 7})
    assert path == str(tmp_path / "ckpt" / "step-00000002")
    saved = _snapshot(model, opt, sched)
    rng_after_save = capture_rng()
    expected_losses = _train(model, opt, sched, 2)
    restore_rng(rng_after_save)
    expected_draws = _draws()

    _train(model, opt, sched, 3)  # perturb weights, optimizer, scheduler and RNG
    with torch.no_grad():
        model[0].weight.add_(1.0)
    got = mgr.load(model, opt, scheduler=sched)

    assert got == Checkpoint(path=path, step=2, meta={
        "extra": {"tokens_seen": 96}, "rank_extra": {"cursor": 7}, "world_size": 1,
        "world_size_changed": False})
    _assert_same_tree(saved, _snapshot(model, opt, sched))
    rng_after_load = capture_rng()
    assert _draws() == expected_draws
    restore_rng(rng_after_load)
    assert _train(model, opt, sched, 2) == expected_losses


def test_load_into_fresh_objects_and_without_optimizer(tmp_path):
    model, opt, sched = _setup(seed=0)
    _train(model, opt, sched, 2)
    mgr = _manager(tmp_path)
    mgr.save(2, model, opt, scheduler=sched)
    saved = _snapshot(model, opt, sched)

    fresh = _setup(seed=1)  # different init, optimizer without state
    assert mgr.load(*fresh[:2], scheduler=fresh[2]).step == 2
    _assert_same_tree(saved, _snapshot(*fresh))

    weights_only, _, _ = _setup(seed=2)
    mgr.load(weights_only, restore_rng=False)
    _assert_same_tree(saved[0], weights_only.state_dict())


def _setup_half_frozen(seed: int, frozen_seed: int = 0):
    """_setup's model with its first layer frozen, built from `frozen_seed` (its 'base')."""
    model, _, _ = _setup(seed)
    torch.manual_seed(frozen_seed)
    base = nn.Linear(6, 16)
    with torch.no_grad():
        model[0].weight.copy_(base.weight)
        model[0].bias.copy_(base.bias)
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _saved_keys(path: str) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader
    return set(FileSystemReader(f"{path}/dcp").read_metadata().state_dict_metadata)


@pytest.mark.parametrize("save_frozen", [False, True])
def test_frozen_parameters_are_rebuilt_not_saved_unless_asked(tmp_path, save_frozen):
    model, opt, sched = _setup_half_frozen(seed=0)
    _train(model, opt, sched, 2)
    mgr = _manager(tmp_path, save_frozen=save_frozen)
    path = mgr.save(2, model, opt, scheduler=sched)
    saved = _snapshot(model, opt, sched)
    frozen = {"model.0.weight", "model.0.bias"}
    model_keys = {k for k in _saved_keys(path) if k.startswith("model.")}
    assert model_keys == {"model.3.weight", "model.3.bias"} | (frozen if save_frozen else set())

    # A fresh run rebuilds its frozen layer from the same base: everything is restored exactly.
    fresh = _setup_half_frozen(seed=1)
    assert mgr.load(*fresh[:2], scheduler=fresh[2]).step == 2
    _assert_same_tree(saved, _snapshot(*fresh))
    # Built from another base: a checkpoint with the frozen layer restores it; one without
    # refuses to resume on a base it was not trained with, naming the parameter.
    other = _setup_half_frozen(seed=1, frozen_seed=5)
    if save_frozen:
        mgr.load(*other[:2], scheduler=other[2])
        _assert_same_tree(saved, _snapshot(*other))
    else:
        with pytest.raises(CheckpointError, match=r"frozen parameter 0\.weight is not the one"):
            mgr.load(*other[:2], scheduler=other[2])


def test_load_with_nothing_saved_returns_none(tmp_path):
    model, opt, _ = _setup()
    assert _manager(tmp_path).load(model, opt) is None
    assert _manager(tmp_path).latest() is None


def test_keep_last_prunes_oldest(tmp_path):
    model, opt, sched = _setup()
    mgr = _manager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, model, opt, scheduler=sched)
    assert [c.step for c in mgr.list()] == [3, 4]
    assert mgr.latest().step == 4
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-00000003", "step-00000004"]


def test_saving_a_step_again_replaces_it(tmp_path):
    model, opt, sched = _setup()
    mgr = _manager(tmp_path)
    mgr.save(1, model, opt, extra={"try": 1})
    mgr.save(1, model, opt, extra={"try": 2})
    assert [c.step for c in mgr.list()] == [1]
    assert mgr.load(model, opt).meta["extra"] == {"try": 2}
    assert os.listdir(tmp_path / "ckpt") == ["step-00000001"]


class _Crash(Exception):
    pass


@pytest.mark.parametrize("crash_at", ["rank-00000.json", "meta.json", "manifest.json", "commit"])
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch, crash_at):
    model, opt, sched = _setup()
    mgr = _manager(tmp_path)
    mgr.save(1, model, opt, scheduler=sched, extra={"step": 1})
    good = _snapshot(model, opt, sched)
    _train(model, opt, sched, 1)

    real_write, real_commit = ckpt_mod._write_file, storage_mod.Store.commit

    def write(store, path, data):
        if path.endswith(crash_at):
            real_write(store, path, data[: len(data) // 2])  # half a file, then the process dies
            raise _Crash(path)
        real_write(store, path, data)

    def commit(*args):
        raise _Crash("commit")

    monkeypatch.setattr(ckpt_mod, "_write_file", write)
    if crash_at == "commit":
        monkeypatch.setattr(storage_mod.Store, "commit", commit)
    with pytest.raises(_Crash):
        mgr.save(2, model, opt, scheduler=sched, extra={"step": 2})
    monkeypatch.setattr(ckpt_mod, "_write_file", real_write)
    monkeypatch.setattr(storage_mod.Store, "commit", real_commit)

    leftovers = [n for n in os.listdir(tmp_path / "ckpt") if ".tmp-" in n]
    assert len(leftovers) == 1 and leftovers[0].startswith("step-00000002.tmp-")
    assert [c.step for c in mgr.list()] == [1]
    mgr.verify(mgr.latest().path)
    assert mgr.load(model, opt, scheduler=sched).meta["extra"] == {"step": 1}
    _assert_same_tree(good, _snapshot(model, opt, sched))

    mgr.save(3, model, opt, scheduler=sched)  # the next good save clears the dead attempt
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-00000001", "step-00000003"]


@pytest.mark.parametrize("full_at", ["__0_0.distcp", ".metadata", "rank-00000.json",
                                     "meta.json", "manifest.json", "commit"])
def test_save_on_a_full_disk_fails_naming_path_and_bytes_and_keeps_the_previous(
        tmp_path, monkeypatch, full_at):
    """The disk fills up at one point of a save (ENOSPC from fsync, where a full disk reports
    delayed writes, or from the commit rename): the save fails with a CheckpointError naming
    the checkpoint, the file and the bytes it needs, the partial attempt is removed and the
    previous checkpoint loads bit-identically. Catches a raw OSError or DCP traceback in place
    of the message, a torn attempt left (or taken) as a checkpoint, and a size estimate off."""
    model, opt, sched = _setup()
    mgr = _manager(tmp_path)
    previous = mgr.save(1, model, opt, scheduler=sched, extra={"step": 1})
    size = sum(p.stat().st_size for p in (tmp_path / "ckpt" / "step-00000001").rglob("*")
               if p.is_file())
    good = _snapshot(model, opt, sched)
    _train(model, opt, sched, 1)

    real_fsync, real_rename = os.fsync, os.rename
    no_space = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if "step-00000002" in path and os.path.basename(path).startswith(full_at):
            raise no_space
        real_fsync(fd)

    def rename(src, dst):
        if full_at == "commit" and str(dst).endswith("step-00000002"):
            raise no_space
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CheckpointError) as err:
        mgr.save(2, model, opt, scheduler=sched, extra={"step": 2})
    monkeypatch.undo()

    message = str(err.value)
    assert f"checkpoint {tmp_path / 'ckpt' / 'step-00000002'} could not be saved" in message
    assert "No space left on device" in message
    # DCP's own files are named by its directory (an OSError from fsync names no file)
    written = {"__0_0.distcp": "/dcp", ".metadata": "/dcp", "commit": "step-00000002"}.get(
        full_at, full_at)
    assert re.search(rf"\(writing [^)]*{re.escape(written)}\)", message), message
    needed = int(re.search(r"needs about ([\d,]+) bytes", message)[1].replace(",", ""))
    assert needed == size, (needed, size)                # the previous checkpoint's size
    assert f"resumes from the previous checkpoint, {previous}" in message
    assert os.listdir(tmp_path / "ckpt") == ["step-00000001"]    # the attempt removed
    assert mgr.load(model, opt, scheduler=sched).meta["extra"] == {"step": 1}
    _assert_same_tree(good, _snapshot(model, opt, sched))


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, file, reason", [
    ("flip", "dcp/__0_0.distcp", "sha256 mismatch"),
    ("flip", "dcp/.metadata", "sha256 mismatch"),
    ("delete", "rank-00000.json", "file missing"),
    ("truncate", "meta.json", "size mismatch"),
    ("garble", "manifest.json", "unreadable manifest"),
])
def test_damaged_newest_checkpoint_falls_back_with_warning(tmp_path, caplog, damage, file, reason):
    model, opt, sched = _setup()
    mgr = _manager(tmp_path)
    mgr.save(1, model, opt, scheduler=sched, rank_extra={"cursor": 1})
    good = _snapshot(model, opt, sched)
    _train(model, opt, sched, 2)
    newest = mgr.save(2, model, opt, scheduler=sched, rank_extra={"cursor": 2})

    target = tmp_path / "ckpt" / "step-00000002" / file
    if damage == "flip":
        _flip_byte(target)
    elif damage == "delete":
        target.unlink()
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-1])
    else:
        target.write_text("{not json")

    with pytest.raises(CheckpointError, match=f"{file}: {reason}"):
        mgr.verify(newest)
    with caplog.at_level(logging.WARNING, logger="posttrain.train.checkpoint"):
        got = mgr.load(model, opt, scheduler=sched)
    assert got.step == 1 and got.meta["rank_extra"] == {"cursor": 1}
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"step-00000002/{file}" in warning and reason in warning
    _assert_same_tree(good, _snapshot(model, opt, sched))

    with pytest.raises(CheckpointError, match=reason):  # an explicit path does not fall back
        mgr.load(model, opt, scheduler=sched, path=newest)


def test_non_json_state_is_refused_before_writing(tmp_path):
    model, opt, _ = _setup()
    mgr = _manager(tmp_path)
    with pytest.raises(CheckpointError, match="rank_extra.*JSON"):
        mgr.save(1, model, opt, rank_extra={"buffer": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"^extra has a non-string dict key at shard_rows"):
        mgr.save(1, model, opt, extra={"shard_rows": {3: 100}})
    assert not (tmp_path / "ckpt").exists()


def test_dcp_index_unpickler_refuses_foreign_globals():
    for foreign in (os.system, torch.load):
        with pytest.raises(pickle.UnpicklingError, match=f"{foreign.__name__}.*refusing"):
            storage_mod._MetadataUnpickler(io.BytesIO(pickle.dumps(foreign))).load()


def test_s3_round_trip_prunes_and_ignores_incomplete(s3):
    prefix = "ckpt/s3-round-trip"
    cfg = CheckpointConfig(dir=s3.uri(prefix), keep_last=2)
    mgr = CheckpointManager(cfg, storage_options=s3.storage_options)
    model, opt, sched = _setup()
    for step in (1, 2):
        _train(model, opt, sched, 1)
        mgr.save(step, model, opt, scheduler=sched, extra={"step": step})
    saved = _snapshot(model, opt, sched)
    # An attempt that died before its manifest: not listed, and removed by the next save.
    s3.put(f"{prefix}/step-00000009/meta.json", b"{}")
    assert [c.step for c in mgr.list()] == [1, 2]
    mgr.verify(mgr.latest().path)

    fresh = _setup(seed=3)
    got = mgr.load(*fresh[:2], scheduler=fresh[2])
    assert got.path == s3.uri(f"{prefix}/step-00000002") and got.meta["extra"] == {"step": 2}
    _assert_same_tree(saved, _snapshot(*fresh))

    mgr.save(3, model, opt, scheduler=sched)
    names = sorted(k["Key"] for k in s3.client.list_objects_v2(
        Bucket=s3.bucket, Prefix=prefix + "/")["Contents"])
    assert {n.split("/")[2] for n in names} == {"step-00000002", "step-00000003"}
    assert f"{prefix}/step-00000003/manifest.json" in names

    # Damage on s3 is detected the same way.
    s3.put(f"{prefix}/step-00000003/rank-00000.json", b"{}")
    with pytest.raises(CheckpointError, match="rank-00000.json: size mismatch"):
        mgr.verify(s3.uri(f"{prefix}/step-00000003"))
    assert mgr.load(*fresh[:2], scheduler=fresh[2]).step == 2


# --- s3 outages (`s3_outage`: a proxy in front of moto that goes down and comes back) -------

FAST_RETRY = RetryConfig(initial_backoff_s=0.25, max_backoff_s=1.0)


def _outage_at(monkeypatch, proxy, at: str, seconds: float | None = None) -> None:
    """Take the proxy down the first time a save reaches `at` (``dcp``: DCP starts writing its
    data; else a checkpoint file about to be written), for `seconds` or until started again."""
    fired = []

    def go_down():
        if not fired:
            fired.append(at)
            proxy.go_down(seconds) if seconds else proxy.stop()

    if at == "dcp":
        real_writer = storage_mod.Store.dcp_writer

        def dcp_writer(store, path):
            writer = real_writer(store, path)
            write_data = writer.write_data

            def down_then_write(*args, **kwargs):
                go_down()
                return write_data(*args, **kwargs)
            writer.write_data = down_then_write
            return writer
        monkeypatch.setattr(storage_mod.Store, "dcp_writer", dcp_writer)
    else:
        real_write = ckpt_mod._write_file

        def write(store, path, data):
            if path.endswith(at):
                go_down()
            real_write(store, path, data)
        monkeypatch.setattr(ckpt_mod, "_write_file", write)


def _retry_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "transient storage error" in r.getMessage()]


@pytest.mark.parametrize("at", ["dcp", "meta.json", "manifest.json"])
def test_s3_save_across_an_outage_commits_a_complete_checkpoint(s3, s3_outage, caplog,
                                                                monkeypatch, at):
    prefix = f"ckpt/outage-{at}"
    mgr = CheckpointManager(CheckpointConfig(dir=s3.uri(prefix), retry=FAST_RETRY),
                            storage_options=s3_outage.storage_options)
    model, opt, sched = _setup()
    _train(model, opt, sched, 1)
    mgr.save(1, model, opt, scheduler=sched, extra={"step": 1})
    _train(model, opt, sched, 1)
    saved = _snapshot(model, opt, sched)

    _outage_at(monkeypatch, s3_outage, at, seconds=2.0)
    with caplog.at_level(logging.WARNING):
        path = mgr.save(2, model, opt, scheduler=sched, extra={"step": 2})
    assert s3_outage.outages == 1
    warnings = _retry_warnings(caplog)
    where = s3.uri(f"{prefix}/step-00000002/{at}")
    assert warnings and all(m.startswith(f"{where}: transient storage error") for m in warnings)

    assert path == s3.uri(f"{prefix}/step-00000002") == mgr.latest().path
    assert [c.step for c in mgr.list()] == [1, 2]
    mgr.verify(path)
    fresh = _setup(seed=3)
    got = mgr.load(*fresh[:2], scheduler=fresh[2])
    assert got.path == path and got.meta["extra"] == {"step": 2}
    _assert_same_tree(saved, _snapshot(*fresh))   # every tensor bit-identical


@pytest.mark.parametrize("at", ["dcp", "meta.json"])
def test_s3_outage_longer_than_the_retries_fails_naming_the_file(s3, s3_outage, caplog,
                                                                 monkeypatch, at):
    prefix = f"ckpt/long-outage-{at}"
    retry = RetryConfig(max_attempts=3, initial_backoff_s=0.1, max_backoff_s=0.1)
    mgr = CheckpointManager(CheckpointConfig(dir=s3.uri(prefix), retry=retry),
                            storage_options=s3_outage.storage_options)
    model, opt, sched = _setup()
    mgr.save(1, model, opt, scheduler=sched, extra={"step": 1})
    good = _snapshot(model, opt, sched)
    _train(model, opt, sched, 1)

    _outage_at(monkeypatch, s3_outage, at)   # and it stays down
    started = time.monotonic()
    with pytest.raises(CheckpointStorageError) as e:
        mgr.save(2, model, opt, scheduler=sched, extra={"step": 2})
    assert time.monotonic() - started < 10
    assert str(e.value).startswith(f"{s3.uri(prefix)}/step-00000002/{at}: gave up after 3 "
                                   "attempts")
    assert "EndpointConnectionError" in str(e.value)
    assert len(_retry_warnings(caplog)) == 2

    # Loading while it is down fails the same way: no falling back to step 1, or to nothing.
    with pytest.raises(CheckpointStorageError, match="gave up after 3 attempts"):
        mgr.load(model, opt, scheduler=sched)
    s3_outage.start()
    real_read_manifest = ckpt_mod.read_manifest

    def down_then_read(store, root):   # down between listing and verifying
        s3_outage.stop()
        return real_read_manifest(store, root)

    monkeypatch.setattr(ckpt_mod, "read_manifest", down_then_read)
    caplog.clear()
    with pytest.raises(CheckpointStorageError, match="manifest.json: gave up after 3 attempts"):
        mgr.load(model, opt, scheduler=sched)
    assert not [r for r in caplog.records if "damaged" in r.getMessage()]

    monkeypatch.setattr(ckpt_mod, "read_manifest", real_read_manifest)
    s3_outage.start()
    assert [c.step for c in mgr.list()] == [1]   # the failed save never committed
    assert mgr.load(model, opt, scheduler=sched).meta["extra"] == {"step": 1}
    _assert_same_tree(good, _snapshot(model, opt, sched))
