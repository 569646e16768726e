"""Supervised fine-tuning as a Metaflow flow: prepare -> train -> evaluate.

    start     resolve where this run keeps its data, checkpoints and weights
    prepare   tokenize the configured sources into Parquet shards under the run's storage
    train     Ray trainer actors (FSDP2 over gloo/NCCL), checkpoints every K steps, HF export;
              over `run.num_nodes` machines with @metaflow_ray, or one machine with local Ray
    join      collect the control task's results
    evaluate  the SFT suite (one evaluation step, `steps/evaluate.py`): held-out loss and
              perplexity of the exported checkpoint against the starting one, a few answers
    end       record the lineage (datasets and hashes, parent runs, config hash, code
              version, outputs), tag the run with it, draw it in a card; print

Run it (from the repository root):

    python flows/sft_flow.py run                                   # tiny CPU run, local datastore
    python flows/sft_flow.py --config config configs/sft/qwen3_0p6b_lora_1gpu.yaml run
    python flows/sft_flow.py --datastore=s3 --config config configs/sft/qwen3_8b_full_2nodes.yaml \\
        run --with kubernetes                                     # num_nodes: 2 -> @metaflow_ray
    python flows/sft_flow.py resume train                         # continue from the checkpoint
    python flows/sft_flow.py card server                          # loss / tokens/s / MFU / eval

The config is validated against the SFT schema when the flow is launched: an unknown key
fails before any step runs. Weights and datasets go to storage; artifacts hold their URIs.
"""

from _flow_ray import ray_nodes
from _posttrain_flow import parse_config, ship_repo
from _recipe_flow import RecipeFlow
from metaflow import Config, card, current, retry, step

SFT_SCHEMA = "posttrain.config.sft.SFTConfig"


@ship_repo("lib", "steps", "configs", "assets")
class SFTFlow(RecipeFlow):
    SCHEMA = SFT_SCHEMA
    config = Config("config", default="configs/sft/tiny.yaml", parser=parse_config(SFT_SCHEMA))

    @card(type="blank", id="training")
    @retry(times=1)
    @ray_nodes("config")
    @step
    def train(self):
        """Train from the prepared shards (continuing from the newest checkpoint); export HF.

        The control task drives the Ray trainer actors; on @metaflow_ray worker nodes only
        hold their share of the cluster. Checkpoints live under the run's storage root, so a
        retried attempt and `resume train` find them.
        """
        from _posttrain_flow import train_recipe, train_summary
        result = train_recipe("train_sft", SFT_SCHEMA, self.config, self.prepared_uri,
                              self.storage_root, "train", self.num_nodes, current.card["training"])
        self.hf_uri, self.metrics_uri = result["hf_uri"], result["metrics_uri"]
        self.base_uri = result["base_model_uri"]
        self.checkpoint_uri, self.train_result = result["checkpoint_uri"], train_summary(result)
        self.next(self.join)

    @card(type="blank", id="evaluation")
    @step
    def evaluate(self):
        """The SFT suite on the exported checkpoint against the starting one: held-out loss
        and perplexity of each held-out source, and a few greedy answers."""
        from _posttrain_flow import evaluate_recipe
        result = evaluate_recipe("train_sft", SFT_SCHEMA, self.config, self.hf_uri,
                                 self.base_uri, self.storage_root, current.card["evaluation"],
                                 provenance={"content_hash": self.content_hash})
        self.eval_table, self.eval_uri = result["table"], result["eval_uri"]
        self.eval_provenance = result["provenance"]
        first = next(iter(result["tasks"].values()))
        self.eval_loss, self.eval_perplexity = first["model"]["loss"], first["model"]["perplexity"]
        self.samples = [r for r in first["records"] if "model_output" in r]
        self.next(self.end)




if __name__ == "__main__":
    SFTFlow()
