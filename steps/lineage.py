"""Show where a run's artifacts came from: the run, its datasets, config and code, and the runs
it started from, recursively (each recipe flow stores a `lineage` artifact in its end step).

    posttrain lineage GRPOFlow/1733000000000000          # the tree, parents indented
    posttrain lineage GRPOFlow/1733000000000000 --json   # the same tree as JSON
    posttrain lineage GRPOFlow/1733000000000000 --brief  # one line per run

It reads runs through the Metaflow client, so it uses the same metadata and datastore as the
flows (set METAFLOW_* / the Metaflow profile the same way). Runs of every namespace are
visible: a pathspec names one run. An unknown run, or one without a `lineage` artifact,
prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from posttrain.lineage import LineageError, check_pathspec, format_tree, walk


def load_from_metaflow(pathspec: str) -> dict[str, Any]:
    """The `lineage` artifact of the run `pathspec`, read with the Metaflow client."""
    from metaflow import Run, get_namespace, namespace
    from metaflow.exception import (MetaflowInvalidPathspec, MetaflowNotFound,
                                    MetaflowUnknownUser)
    check_pathspec(pathspec)
    try:
        previous = get_namespace()
    except MetaflowUnknownUser:     # no user name to default to: every namespace is read anyway
        previous = None
    namespace(None)             # a parent may come from another user's or a production run
    try:
        try:
            run = Run(pathspec)
        except (MetaflowNotFound, MetaflowInvalidPathspec) as e:
            raise LineageError(f"{pathspec}: no such run ({e})") from None
        data = run.data             # the end step's artifacts; None before the run ends
        if data is None or "lineage" not in data:
            state = "finished" if run.finished else "not finished"
            raise LineageError(f"{pathspec} ({state}) has no `lineage` artifact: it ran "
                               f"before lineage was recorded, or its end step did not run")
        return dict(data.lineage)
    finally:
        namespace(previous)


def run(pathspec: str) -> dict[str, Any]:
    """The lineage tree of `pathspec` (see `posttrain.lineage.walk`)."""
    return walk(pathspec, load_from_metaflow)


def main(args: argparse.Namespace) -> int:
    tree = run(args.pathspec)
    if args.json:
        print(json.dumps(tree, indent=2, default=str))
    else:
        print(format_tree(tree, details=not args.brief))
    return 0


if __name__ == "__main__":
    import sys

    from steps.cli import main as cli_main
    sys.exit(cli_main(["lineage", *sys.argv[1:]]))
