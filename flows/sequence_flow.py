"""Event-sequence pretraining as a Metaflow flow: prepare -> train -> evaluate.

    start     resolve where this run keeps its data, checkpoints and weights
    prepare   map the rows of item ids to the config's event vocabulary, with the heads' labels
              as columns, into Parquet shards under the run's storage
    train     a model from scratch (`model.init`): next item plus per-position heads, checkpoints
              every K steps, export (HF causal LM + event_vocab.json + heads); over
              `run.num_nodes` machines with @metaflow_ray, or one machine
    join      collect the control task's results
    evaluate  the held-out next-item and head metrics of the exported weights (computed by the
              train step on `data.eval`; the recipe has no evaluation suite yet), as eval.json
              and a card
    end       record the lineage (datasets and hashes, config hash, code version, outputs),
              tag the run with it, draw it in a card; print

Run it (from the repository root):

    python flows/sequence_flow.py run                               # tiny CPU run
    python flows/sequence_flow.py --config config my_events.yaml run
    python flows/sequence_flow.py resume train                      # continue from the checkpoint

Load the result with `transformers.AutoModelForCausalLM.from_pretrained(<hf_uri>)` and
`posttrain.models.heads.load_heads(<hf_uri>)` (steps/train_sequence.py).
"""

from _flow_ray import ray_nodes
from _posttrain_flow import parse_config, ship_repo
from _recipe_flow import RecipeFlow
from metaflow import Config, card, current, retry, step

SEQUENCE_SCHEMA = "posttrain.config.sequence.SequenceConfig"


@ship_repo("lib", "steps", "configs", "assets")
class SequenceFlow(RecipeFlow):
    SCHEMA = SEQUENCE_SCHEMA
    config = Config("config", default="configs/sequence/tiny.yaml",
                    parser=parse_config(SEQUENCE_SCHEMA))

    @card(type="blank", id="training")
    @retry(times=1)
    @ray_nodes("config")
    @step
    def train(self):
        """Pretrain from the prepared shards (continuing from the newest checkpoint); export.

        Checkpoints live under the run's storage root, so a retried attempt and
        `resume train` find them."""
        from _posttrain_flow import train_recipe, train_summary
        result = train_recipe("train_sequence", SEQUENCE_SCHEMA, self.config, self.prepared_uri,
                              self.storage_root, "train", self.num_nodes, current.card["training"])
        self.hf_uri, self.metrics_uri = result["hf_uri"], result["metrics_uri"]
        self.base_uri = result["base_model_uri"]
        self.checkpoint_uri, self.train_result = result["checkpoint_uri"], train_summary(result)
        self.next(self.join)

    @card(type="blank", id="evaluation")
    @step
    def evaluate(self):
        """Held-out next item and heads of the exported weights, published beside them."""
        from _posttrain_flow import heldout_metrics
        self.heldout, self.eval_uri = heldout_metrics(
            self.train_result["eval"], self.hf_uri, self.storage_root,
            current.card["evaluation"], provenance={"content_hash": self.content_hash})
        self.next(self.end)

    def lineage_start(self) -> tuple[dict, list]:
        return {"base_model_uri": self.base_uri}, []

    def report_lines(self) -> list[str]:
        return [f"Hugging Face checkpoint (+ event_vocab.json, heads): {self.hf_uri}",
                f"checkpoints: {self.checkpoint_uri}", f"eval: {self.eval_uri}",
                f"dataset hash: {self.content_hash}",
                *(f"  {key:<32}{value:.4g}" for key, value in self.heldout.items())]


if __name__ == "__main__":
    SequenceFlow()
