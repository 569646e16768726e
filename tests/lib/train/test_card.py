from posttrain.train.card import line_chart, step_records, training_charts, training_summary


def _rec(step, loss, tps=100.0, mfu=0.1):
    return {"step": step, "loss": loss, "real_tokens_per_s": tps, "mfu": mfu,
            "peak_memory_bytes": 2**30}


def test_step_records_keep_the_last_record_of_a_step_and_skip_eval_records():
    records = [_rec(1, 5.0), _rec(2, 4.0), _rec(2, 3.9), {"step": 2, "eval_loss": 4.2},
               _rec(3, 3.5)]
    assert [(r["step"], r["loss"]) for r in step_records(records)] == [(1, 5.0), (2, 3.9),
                                                                      (3, 3.5)]


def test_training_charts_are_vega_lite_line_charts_over_steps():
    charts = training_charts([_rec(1, 5.0, 200.0, 0.2), _rec(2, 4.0, 300.0, 0.3)])
    assert [c["title"] for c in charts] == ["train loss", "real tokens/s (padding excluded)",
                                            "MFU (model FLOPs / peak)"]
    assert charts[1]["data"]["values"] == [{"step": 1, "real_tokens_per_s": 200.0},
                                           {"step": 2, "real_tokens_per_s": 300.0}]
    assert all(c["mark"]["type"] == "line" for c in charts)


def test_line_chart_drops_non_finite_values():
    chart = line_chart([_rec(1, float("nan")), _rec(2, 1.0)], "loss", "loss")
    assert chart["data"]["values"] == [{"step": 2, "loss": 1.0}]


def test_summary():
    rows = dict(training_summary([_rec(1, 5.0, 100.0, 0.1), _rec(2, 4.0, 300.0, 0.3)]))
    assert rows["final train loss"] == 4.0 and rows["mean real tokens/s"] == 200.0
    assert rows["mean MFU"] == "20.00%"
