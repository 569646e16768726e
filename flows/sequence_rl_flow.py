"""RL on a sequence model as a Metaflow flow: prepare histories -> RL -> held-out reward.

    start     resolve the run's storage and the starting model: the export of a SequenceFlow
              run given by pathspec (`--sequence-run SequenceFlow/1234`), or the config's
              `model.hf_dir` (a `posttrain train-sequence` export)
    prepare   map the event rows to the starting model's vocabulary (its event_vocab.json) into
              Parquet shards under the run's storage
    train     sequence RL (steps/train_sequence_rl.py): histories -> item completions ->
              rewards -> GRPO update -> weight sync, checkpoints every K steps, export (HF
              causal LM + event_vocab.json); over `run.num_nodes` machines with
              @metaflow_ray, or one machine
    join      collect the control task's results
    evaluate  the held-out reward of the starting model and of the export (computed by the
              train step on `data.eval` with the run's sampling and rewards), as eval.json
              and a card
    end       record the lineage (datasets and hashes, the parent run, config hash, code
              version, outputs), tag the run with it, draw it in a card; print

Run it (from the repository root):

    python flows/sequence_flow.py run                                 # the start
    python flows/sequence_rl_flow.py run --sequence-run SequenceFlow/<run id>
    python flows/sequence_rl_flow.py --config config my_rl.yaml run   # model.hf_dir on disk
    python flows/sequence_rl_flow.py resume train                     # from the checkpoint

A thin composition of the steps `tests/steps/test_train_sequence_rl.py` tests (the driver, as
`posttrain train-sequence-rl` runs it) and of the flow helpers every recipe flow shares.
"""

from _flow_ray import ray_nodes
from _posttrain_flow import parse_config, ship_repo
from _recipe_flow import RecipeFlow
from metaflow import Config, Parameter, card, current, retry, step

SEQUENCE_RL_SCHEMA = "posttrain.config.sequence_rl.SequenceRLConfig"


@ship_repo("lib", "steps", "configs", "assets")
class SequenceRLFlow(RecipeFlow):
    SCHEMA = SEQUENCE_RL_SCHEMA
    config = Config("config", default="configs/sequence_rl/tiny.yaml",
                    parser=parse_config(SEQUENCE_RL_SCHEMA))
    sequence_run = Parameter("sequence-run", default="",
                             help="pathspec of a finished SequenceFlow run (e.g. "
                                  "SequenceFlow/1234) whose export (`hf_uri`) to start from, "
                                  "instead of config.model.hf_dir")

    @step
    def start(self):
        """Fix the storage root and the starting model (recorded as lineage)."""
        from _flow_runs import start_model
        from _posttrain_flow import storage_and_nodes
        self.storage_root, self.num_nodes = storage_and_nodes(self, SEQUENCE_RL_SCHEMA)
        self.parent_run, self.start_uri = start_model(self.config, self.sequence_run,
                                                      "SequenceFlow", "flows/sequence_flow.py")
        print(f"start from {self.start_uri}"
              f"{f' ({self.parent_run})' if self.parent_run else ''}")
        self.next(self.prepare)

    @step
    def prepare(self):
        """Encode the event rows in the starting model's vocabulary; keep the summary."""
        from _flow_runs import with_model
        from _posttrain_flow import prepare_data
        (self.prepared_uri, self.content_hash, self.manifest_summary,
         self.shard_uris) = prepare_data(SEQUENCE_RL_SCHEMA,
                                         with_model(self.config, self.start_uri),
                                         self.storage_root)
        self.next(self.train, num_parallel=self.num_nodes)

    @card(type="blank", id="training")
    @retry(times=1)
    @ray_nodes("config")
    @step
    def train(self):
        """RL from the starting model (continuing from the newest checkpoint); export.

        Checkpoints (weights, optimizer, history stream position) live under the run's
        storage root, so a retried attempt and `resume train` find them."""
        from _posttrain_flow import train_recipe, train_summary
        result = train_recipe("train_sequence_rl", SEQUENCE_RL_SCHEMA, self.config,
                              self.prepared_uri, self.storage_root, "train", self.num_nodes,
                              current.card["training"], start_from=self.start_uri)
        self.hf_uri, self.metrics_uri = result["hf_uri"], result["metrics_uri"]
        self.checkpoint_uri = result["checkpoint_uri"]
        self.train_result = train_summary(result, "final_reward_mean", "max_sync_diff",
                                          "baseline_eval")
        self.next(self.join)

    @card(type="blank", id="evaluation")
    @step
    def evaluate(self):
        """Held-out reward of the start and of the export, published beside the weights."""
        from _posttrain_flow import heldout_metrics
        start = {f"start/{k}": v for k, v in (self.train_result["baseline_eval"] or {}).items()}
        self.heldout, self.eval_uri = heldout_metrics(
            {**start, **(self.train_result["eval"] or {})}, self.hf_uri, self.storage_root,
            current.card["evaluation"], provenance={"content_hash": self.content_hash,
                                                    "start_uri": self.start_uri})
        self.next(self.end)

    def lineage_start(self) -> tuple[dict, list]:
        return {"base_model_uri": self.start_uri}, [self.parent_run] if self.parent_run else []

    def report_lines(self) -> list[str]:
        return [f"Hugging Face checkpoint (+ event_vocab.json): {self.hf_uri}",
                f"checkpoints: {self.checkpoint_uri}", f"eval: {self.eval_uri}",
                f"dataset hash: {self.content_hash}",
                *(f"  {key:<40}{value:.4g}" for key, value in self.heldout.items())]


if __name__ == "__main__":
    SequenceRLFlow()
