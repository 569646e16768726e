"""Print where a finished flow run left its results and how to open its cards.

    python tools/show_run.py SFTFlow            # the newest successful run
    python tools/show_run.py SFTFlow/1733000000000000
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    from metaflow import Flow, Run, namespace
    namespace(None)
    target = argv[0] if argv else "SFTFlow"
    run = Run(target) if "/" in target else Flow(target).latest_successful_run
    if run is None:
        print(f"no successful run of {target} yet")
        return 1
    flow_file = {"SFTFlow": "flows/sft_flow.py"}.get(run.parent.id, "flows/<flow>.py")
    end = run["end"].task.data
    train = run["join"].task.data if "join" in [s.id for s in run] else end
    print(f"\n== {run.pathspec} finished ==")
    result = getattr(train, "train_result", {}) or {}
    if result:
        print(f"trained {result.get('steps')} steps; final loss {result.get('final_loss'):.4f}; "
              f"{result.get('mean_real_tokens_per_s', 0):.0f} real tokens/s; "
              f"MFU {result.get('mean_mfu', 0):.1%}")
    print(f"Hugging Face checkpoint: {end.hf_uri}")
    print(f"evaluation, the export against its starting checkpoint ({end.eval_uri}):")
    print(f"  {'task':<14}{'metric':<14}{'model':>10}{'start':>10}{'delta':>10}")
    for row in end.eval_table:
        start = "" if row["baseline"] is None else f"{row['baseline']:.4g}"
        delta = "" if row["delta"] is None else f"{row['delta']:+.4g}"
        print(f"  {row['task']:<14}{row['metric']:<14}{row['model']:>10.4g}{start:>10}"
              f"{delta:>10}")
    python = os.path.relpath(sys.executable)
    print("cards (loss, tokens/s, MFU; eval table and samples; lineage):")
    print("  make cards                              # then open http://localhost:8324")
    for step in ("train", "evaluate", "end"):
        print(f"  {python} {flow_file} card get {run.id}/{step} {step}-card.html")
    if "lineage" in end:
        posttrain = os.path.join(os.path.dirname(python), "posttrain")
        print(f"lineage (datasets, config, code, parent runs):\n"
              f"  {posttrain} lineage {run.pathspec}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
