"""Evaluate a distilled student against its teacher: held-out KL(teacher || student) per token,
and each model's held-out loss, for the student before and after distillation.

Runs on the exported checkpoints in one process (the numbers describe the artifacts), over the
prepared eval split. Writes `<out>/eval.json` when `out_dir` is given.

    python -m steps.evaluate_distill --student runs/distill_tiny/hf \\
        --base-student runs/distill_tiny/base_model --teacher runs/distill_tiny/teacher_model \\
        --prepared-dir runs/distill_tiny/prepared
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from posttrain.data.loader import LoaderConfig, sources_from_manifest
from posttrain.eval.distill import teacher_student_kl
from posttrain.models.hf_io import load_hf


def run(student_dir: str, teacher_dir: str, prepared_dir: str, *,
        base_student_dir: str | None = None, loader: LoaderConfig | None = None,
        max_batches: int = 50, out_dir: str | None = None) -> dict[str, Any]:
    """{"after": metrics of `student_dir`, "before": of `base_student_dir` (when given)}."""
    import torch
    teacher = load_hf(teacher_dir, dtype=torch.float32)
    sources = sources_from_manifest(prepared_dir, "eval")
    loader = loader or LoaderConfig()
    result: dict[str, Any] = {"student_dir": student_dir, "teacher_dir": teacher_dir}
    for name, path in (("before", base_student_dir), ("after", student_dir)):
        if path:
            result[name] = teacher_student_kl(load_hf(path, dtype=torch.float32), teacher,
                                              sources, loader, max_batches)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "eval.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m steps.evaluate_distill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", required=True)
    p.add_argument("--teacher", required=True)
    p.add_argument("--prepared-dir", required=True)
    p.add_argument("--base-student")
    p.add_argument("--out-dir")
    a = p.parse_args(argv)
    print(json.dumps(run(a.student, a.teacher, a.prepared_dir, base_student_dir=a.base_student,
                         out_dir=a.out_dir), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
