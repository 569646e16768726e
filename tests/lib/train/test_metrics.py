"""Metrics: JSONL + TensorBoard mirror, throughput/MFU arithmetic, lr schedules."""

import math

import pytest

from posttrain.train.metrics import MetricsWriter, batch_counts, read_metrics, step_metrics
from posttrain.train.optim import SchedulerConfig, lr_factor


def test_jsonl_and_tensorboard_mirror(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    writer = MetricsWriter(tmp_path / "m.jsonl", tensorboard_dir=str(tmp_path / "tb"))
    for step in (1, 2, 3):
        writer.write({"step": step, "loss": 1.0 / step, "note": "text is skipped"})
    writer.close()
    assert [r["loss"] for r in read_metrics(tmp_path / "m.jsonl")] == [1.0, 0.5, 1 / 3]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Scalars("loss")
    assert [e.step for e in scalars] == [1, 2, 3]
    assert scalars[1].value == pytest.approx(0.5)


def test_step_metrics_count_real_tokens_and_executed_flops():
    """Every recipe's step metrics: padding excluded from tokens/s, MFU = FLOPs / s / peak."""
    batches = [{"num_real_tokens": 300, "num_pad_tokens": 100, "num_loss_tokens": 120},
               {"num_real_tokens": 200, "num_pad_tokens": 0, "num_loss_tokens": 80}]
    m = step_metrics(batch_counts(batches), seconds=2.0, data_wait_s=0.1, flops=4e9, peak_flops=1e10,
                     device=None)
    assert (m["real_tokens"], m["loss_tokens"]) == (500, 200)
    assert m["padding_fraction"] == pytest.approx(100 / 600)
    assert m["real_tokens_per_s"] == 250.0
    assert m["mfu"] == pytest.approx(0.2) and m["step_flops"] == 4e9
    assert m["peak_memory_bytes"] > 0


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedules(kind):
    cfg = SchedulerConfig(kind=kind, warmup_steps=4, min_lr_ratio=0.1)
    factors = [lr_factor(s, 20, cfg) for s in range(21)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    if kind == "constant":
        assert set(factors[4:]) == {1.0}
        return
    assert factors[4] == pytest.approx(1.0) and factors[20] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    mid = lr_factor(12, 20, cfg)
    expected = 0.55 if kind == "linear" else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))
    assert mid == pytest.approx(expected)
