"""Knowledge distillation as a Metaflow flow: prepare -> distill -> evaluate.

    start     resolve where this run keeps its data, checkpoints and weights
    prepare   tokenize the configured sources into Parquet shards under the run's storage
    distill   Ray trainer actors (FSDP2 over gloo/NCCL): the student, and beside it the frozen,
              sharded teacher (online) or its stored top-k log-probs (offline, computed here
              once); checkpoints every K steps; HF export of the student
    join      collect the control task's results
    evaluate  the distillation suite (`steps/evaluate.py`): held-out KL(teacher || student) and
              loss, before and after distillation
    end       record the lineage (datasets and hashes, parent runs, config hash, code
              version, outputs), tag the run with it, draw it in a card; print

Run it (from the repository root):

    python flows/distill_flow.py run                                # tiny CPU run
    python flows/distill_flow.py --config config my_distill.yaml run
    python flows/distill_flow.py resume distill                     # continue from the checkpoint

The config is validated against the distillation schema when the flow is launched. A teacher
that does not share the student's tokenizer fails the distill step before any worker starts.
"""

from _flow_ray import ray_nodes
from _posttrain_flow import parse_config, ship_repo
from _recipe_flow import RecipeFlow
from metaflow import Config, card, current, retry, step

DISTILL_SCHEMA = "posttrain.config.distill.DistillConfig"


@ship_repo("lib", "steps", "configs", "assets")
class DistillFlow(RecipeFlow):
    SCHEMA = DISTILL_SCHEMA
    config = Config("config", default="configs/distill/tiny.yaml",
                    parser=parse_config(DISTILL_SCHEMA))

    @step
    def prepare(self):
        """Stream, validate and tokenize the data into shards; keep the manifest's summary."""
        from _posttrain_flow import prepare_data
        (self.prepared_uri, self.content_hash, self.manifest_summary,
         self.shard_uris) = prepare_data(DISTILL_SCHEMA, self.config, self.storage_root)
        self.next(self.distill, num_parallel=self.num_nodes)

    @card(type="blank", id="training")
    @retry(times=1)
    @ray_nodes("config")
    @step
    def distill(self):
        """Distill the teacher into the student (continuing from the newest checkpoint);
        export the student. The control task drives the Ray trainer actors."""
        from _posttrain_flow import join, publish, train_recipe, train_summary
        result = train_recipe("train_distill", DISTILL_SCHEMA, self.config, self.prepared_uri,
                              self.storage_root, "distill", self.num_nodes,
                              current.card["training"])
        out = join(self.storage_root, "distill")
        self.hf_uri, self.metrics_uri = result["hf_uri"], result["metrics_uri"]
        self.base_student_uri = result["base_model_uri"]
        self.teacher_uri = (self.config.teacher.hf_dir or
                            publish(result["teacher_dir"], join(out, "teacher_model")))
        self.checkpoint_uri, self.distill_result = result["checkpoint_uri"], train_summary(result)
        self.next(self.join)

    @card(type="blank", id="evaluation")
    @step
    def evaluate(self):
        """The distillation suite: held-out KL(teacher || student) and loss of the exported
        student against the student it started from."""
        from _posttrain_flow import evaluate_recipe
        result = evaluate_recipe("train_distill", DISTILL_SCHEMA, self.config, self.hf_uri,
                                 self.base_student_uri, self.storage_root,
                                 current.card["evaluation"], models={"teacher": self.teacher_uri},
                                 provenance={"content_hash": self.content_hash})
        self.eval_table, self.eval_uri = result["table"], result["eval_uri"]
        self.eval_provenance = result["provenance"]
        first = next(iter(result["tasks"].values()))
        self.kl_before = first["baseline"]["kl_teacher_model"]
        self.kl_after = first["model"]["kl_teacher_model"]
        self.eval_loss = first["model"]["loss"]
        self.next(self.end)

    def lineage_start(self) -> tuple[dict, list]:
        return {"base_model_uri": self.base_student_uri, "teacher_uri": self.teacher_uri}, []

    def report_lines(self) -> list[str]:
        return [f"student Hugging Face checkpoint: {self.hf_uri}", f"teacher: {self.teacher_uri}",
                f"checkpoints: {self.checkpoint_uri}", f"eval: {self.eval_uri}",
                f"held-out KL(teacher || student): {self.kl_before:.4f} -> {self.kl_after:.4f}; "
                f"held-out student loss {self.eval_loss:.4f}"]


if __name__ == "__main__":
    DistillFlow()
