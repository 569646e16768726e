"""What each data-parallel rank reads and packs, with the data as streams, at W = 1, 2, 4 ranks.

Data: the bundled chat train set (2,000 conversations), prepared with the bundled tokenizer
into shard files of `--rows-per-shard` rows. The loader config is `train.loader.streams: 4`:
the run's data is 4 independent streams, global micro-batch i from stream i mod 4, and rank
r of W opens streams r, r + W, ... (`posttrain.data.loader.StreamLoader`). Every rank of every
W consumes its share of the same `--steps` optimizer steps (`--micro-batches` per step).

Per rank it measures, in this one process, one rank after another:

* ``bytes``: bytes the process read from files while the rank's loader ran (Linux
  ``/proc/self/io`` rchar: what pyarrow really read, footers and all);
* ``file_bytes``: the sizes of the shard files the rank's streams own;
* ``packed``: samples its packers took in (the packing work).

and reports, per W, the largest rank's value as a fraction of the W = 1 value, next to the
1.5 / W bound (`issue 13`: each rank reads at most 1.5/W of a single rank's bytes). The
replicated rule (`streams: 1`, every rank reads everything and keeps 1/W of the batches) is
measured too, for contrast: its fraction is 1 at every W.

Run: ``python bench/data_per_rank.py [--steps 10]``. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--rows-per-shard", type=int, default=100)
    args = p.parse_args()

    from posttrain.config.recipes import DataConfig, OutputConfig, PrepareConfig
    from posttrain.data.loader import (LoaderConfig, StreamLoader, TrainLoader,
                                       sources_from_manifest)
    from posttrain.data.packing import PackingConfig
    from posttrain.data.sources import SourceConfig
    from posttrain.data.tokenizer import TokenizerConfig
    from steps import prepare

    out = Path(tempfile.mkdtemp(prefix="data_per_rank")) / "prepared"
    prepare.run(PrepareConfig(
        TokenizerConfig(path=str(ROOT / "assets/tokenizer")),
        DataConfig(train=[SourceConfig(path=str(ROOT / "assets/data/chat/train.jsonl"),
                                       name="chat")], max_tokens_per_sample=512),
        OutputConfig(dir=str(out), rows_per_shard=args.rows_per_shard)), show_progress=False)
    sources = sources_from_manifest(str(out), "train")
    packing = PackingConfig(max_tokens_per_pack=1024, buffer_samples=64)
    total = args.steps * args.micro_batches

    def measure(loader, n: int) -> dict[str, int]:
        start = rchar()
        it = iter(loader)
        for _ in range(n):
            next(it)
        read = rchar() - start
        stats = loader.stats
        files = loader.files
        loader.close()
        return {"bytes": read, "file_bytes": sum(os.path.getsize(f) for f in files),
                "packed": stats["samples_in"]}

    cfg = LoaderConfig(packing=packing, shuffle_buffer_samples=256, seed=0, epochs=1,
                       streams=args.streams, background=False)
    replicated = LoaderConfig(packing=packing, shuffle_buffer_samples=256, seed=0, epochs=1,
                              background=False)
    results: dict[str, dict] = {"streams": {}, "replicated": {}}
    for w in (1, 2, 4):
        ranks = [measure(StreamLoader(sources, cfg, own=list(range(r, args.streams, w))),
                         total // w) for r in range(w)]
        # the replicated rule: every rank reads the whole stream for its 1/W of the batches
        every = [measure(TrainLoader(sources, replicated), total) for _ in range(w)]
        results["streams"][w] = ranks
        results["replicated"][w] = every
    report: dict[str, object] = {"bench": "data_per_rank", "num_streams": args.streams,
                                 "shard_files": len(sources["chat"]),
                                 "micro_batches": total, "rows_per_shard": args.rows_per_shard}
    for rule, by_w in results.items():
        base = {k: max(r[k] for r in by_w[1]) for k in ("bytes", "file_bytes", "packed")}
        report[rule] = {str(w): {"max_rank_fraction": {
            k: round(max(r[k] for r in ranks) / max(base[k], 1), 3) for k in base},
            "bound_1.5/W": round(1.5 / w, 3),
            "per_rank": ranks} for w, ranks in by_w.items()}
    report["streams_within_bound"] = all(
        v <= 1.5 / int(w) for w, entry in report["streams"].items()
        for v in entry["max_rank_fraction"].values())
    print(json.dumps(report))


if __name__ == "__main__":
    main()
