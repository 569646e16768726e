"""The steps every recipe flow shares, written once: `start`, `prepare`, `join` and `end`.

A recipe flow subclasses `RecipeFlow`, names its config class in `SCHEMA`, declares its
`config`, and writes the steps that are its own (the training step, `evaluate`), or overrides
a shared one where it starts differently (GRPO's base model, a sequence-RL start from another
run). `end` asks the flow what it produced and started from (`lineage_outputs`,
`lineage_start`) and what to print (`report_lines`); the defaults fit a flow whose training
step exports `hf_uri` and `checkpoint_uri` from `config.model.hf_dir` and whose `evaluate`
leaves `eval_uri` and an `eval_table`. Metaflow builds the graph from every step the class has, inherited ones
included, and the code package carries this file beside the flows.

    start     resolve where this run keeps its data, checkpoints and weights
    prepare   tokenize the configured sources into shards under the run's storage; then the
              training step `train`, on `run.num_nodes` nodes (@metaflow_ray)
    join      keep the control task's results (worker nodes produce none); then `evaluate`
    end       record the lineage (artifact, run tags, card) and print where the outputs are
"""

from __future__ import annotations

from metaflow import FlowSpec, card, current, step


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

    @card(type="blank", id="lineage")
    @step
    def end(self):
        """Record what produced the outputs (lineage artifact, run tags, card); point at them."""
        from _flow_cards import lineage_card, record_lineage
        started_from, parents = self.lineage_start()
        self.lineage = record_lineage(self, outputs=self.lineage_outputs(), parents=parents,
                                      started_from=started_from)
        lineage_card(current.card["lineage"], self.lineage)
        print("\n".join(self.report_lines()))

    def lineage_outputs(self) -> dict:
        """What this run produced, by artifact name: the lineage's outputs."""
        return {"hf_uri": self.hf_uri, "checkpoint_uri": self.checkpoint_uri,
                "eval_uri": self.eval_uri}

    def lineage_start(self) -> tuple[dict, list]:
        """What this run started from, and the runs it continues (its lineage parents)."""
        return {"base_model_uri": self.config.model.hf_dir}, []

    def report_lines(self) -> list[str]:
        """What `end` prints: where the outputs are, then the evaluation's table."""
        return [f"Hugging Face checkpoint: {self.hf_uri}", f"checkpoints: {self.checkpoint_uri}",
                f"eval: {self.eval_uri}", f"dataset hash: {self.content_hash}",
                *eval_rows(self.eval_table)]


def eval_rows(table: list[dict]) -> list[str]:
    """An evaluation table's rows as `end` prints them: task, metric, the model's value."""
    return [f"  {row['task']:<16}{row['metric']:<20}{row['model']:.4g}" for row in table]
