"""The steps every recipe flow shares, written once: `start`, `prepare` and `join`.

A recipe flow subclasses `RecipeFlow`, names its config class in `SCHEMA`, declares its
`config`, and writes the steps that are its own (the training step, `evaluate`, `end`), or
overrides a shared one where it starts differently (GRPO's base model, a sequence-RL start
from another run). Metaflow builds the graph from every step the class has, inherited ones
included, and the code package carries this file beside the flows.

    start     resolve where this run keeps its data, checkpoints and weights
    prepare   tokenize the configured sources into shards under the run's storage; then the
              training step `train`, on `run.num_nodes` nodes (@metaflow_ray)
    join      keep the control task's results (worker nodes produce none); then `evaluate`
"""

from __future__ import annotations

from metaflow import FlowSpec, step


class RecipeFlow(FlowSpec):
    SCHEMA = ""                     # the recipe's config class, "posttrain.config.sft.SFTConfig"

    @step
    def start(self):
        """Fix this run's storage root; retries and `resume` read it back from here."""
        from _posttrain_flow import storage_and_nodes
        self.storage_root, self.num_nodes = storage_and_nodes(self, self.SCHEMA)
        self.next(self.prepare)

    @step
    def prepare(self):
        """Stream, validate and tokenize the data into shards; keep the manifest's summary."""
        from _posttrain_flow import prepare_data
        (self.prepared_uri, self.content_hash, self.manifest_summary,
         self.shard_uris) = prepare_data(self.SCHEMA, self.config, self.storage_root)
        self.next(self.train, num_parallel=self.num_nodes)

    @step
    def join(self, inputs):
        """Keep the control task's results (worker nodes produce none)."""
        self.merge_artifacts(inputs)
        self.next(self.evaluate)
