"""Golden losses: the first steps of each recipe's reference run on the tiny assets, stored.

The recipe tests compare their runs with each other (1 vs 2 workers, killed vs uninterrupted,
packed vs padded); a change that moves every layout together passes those. These stored
numbers catch it: `check_golden(name, losses)` compares the first GOLDEN_STEPS losses of a
reference run with `tests/golden/<name>.json`.

They are compared across machines, so the tolerance must hold across CPU float kernels: the
spread measured over ATEN_CPU_CAPABILITY=default/avx2 and 1/2 threads is in GOLDEN_ATOL's
comment and in tests/golden/README.md. After a change that is meant to move the numbers,
rewrite them with

    POSTTRAIN_UPDATE_GOLDEN=1 make test      # or pytest tests/steps/test_train_<recipe>.py

and say why in the commit.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
GOLDEN_STEPS = 10
# fp32 on CPU; measured between kernel settings over these 10 steps (ATEN_CPU_CAPABILITY default
# vs avx2, 1 vs 2 threads): at most 5.7e-6 (tests/golden/README.md)
GOLDEN_ATOL = 1e-5


def check_golden(name: str, losses: list[float], *, compare_steps: int = GOLDEN_STEPS,
                 atol: float = GOLDEN_ATOL) -> None:
    """Assert that `losses[:GOLDEN_STEPS]` equal the stored values of `name` within `atol`;
    `compare_steps` compares only the first ones (the rest are stored, not compared: for runs
    whose later steps move by more than GOLDEN_ATOL between CPU kernels, as measured and noted
    where it is used). A larger `atol` is for values of a larger scale (gradient norms),
    measured and noted where it is used."""
    got = [float(x) for x in losses[:GOLDEN_STEPS]]
    assert len(got) == GOLDEN_STEPS, f"{name}: {len(got)} steps, need {GOLDEN_STEPS}"
    assert all(math.isfinite(x) for x in got), got
    path = GOLDEN_DIR / f"{name}.json"
    if os.environ.get("POSTTRAIN_UPDATE_GOLDEN") == "1":
        path.write_text(json.dumps({"losses": got}, indent=1) + "\n")
        return
    assert path.is_file(), (f"no golden losses {path}: run with POSTTRAIN_UPDATE_GOLDEN=1 to "
                            "write them")
    want = json.loads(path.read_text())["losses"]
    got, want = got[:compare_steps], want[:compare_steps]
    diffs = [abs(a - b) for a, b in zip(got, want)]
    table = "\n".join(f"  step {i + 1:2d}: {a:.8f} stored {b:.8f} diff {d:.1e}"
                      for i, (a, b, d) in enumerate(zip(got, want, diffs)))
    assert max(diffs) <= atol, (
        f"{name}: the first {compare_steps} values moved from the stored ones by up to "
        f"{max(diffs):.1e} (> {atol}); if that is intended, rewrite them with "
        f"POSTTRAIN_UPDATE_GOLDEN=1 and say why:\n{table}")
