"""Knowledge distillation as a Metaflow flow: prepare -> distill -> evaluate.

    start     resolve where this run keeps its data, checkpoints and weights
    prepare   tokenize the configured sources into Parquet shards under the run's storage
    distill   Ray trainer actors (FSDP2 over gloo/NCCL): the student, and beside it the frozen,
              sharded teacher (online) or its stored top-k log-probs (offline, computed here
              once); checkpoints every K steps; HF export of the student
    join      collect the control task's results
    evaluate  held-out KL(teacher || student) and held-out loss, before and after distillation
    end       record the lineage (datasets and hashes, parent runs, config hash, code
              version, outputs), tag the run with it, draw it in a card; print

Run it (from the repository root):

    python flows/distill_flow.py run                                # tiny CPU run
    python flows/distill_flow.py --config config my_distill.yaml run
    python flows/distill_flow.py resume distill                     # continue from the checkpoint

The config is validated against the distillation schema when the flow is launched. A teacher
that does not share the student's tokenizer fails the distill step before any worker starts.
"""

from _posttrain_flow import build_config, parse_config, ray_nodes, ship_repo
from metaflow import Config, FlowSpec, card, current, retry, step

DISTILL_SCHEMA = "posttrain.train.distill.DistillConfig"


@ship_repo("lib", "steps", "configs", "assets")
class DistillFlow(FlowSpec):
    config = Config("config", default="configs/distill/tiny.yaml",
                    parser=parse_config(DISTILL_SCHEMA))

    @step
    def start(self):
        """Fix this run's storage root; retries and `resume` read it back from here."""
        from _posttrain_flow import storage_and_nodes
        self.storage_root, self.num_nodes = storage_and_nodes(self)
        self.next(self.prepare)

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
        self.base_student_uri = (self.config.model.hf_dir or
                                 publish(result["base_model_dir"], join(out, "base_model")))
        self.teacher_uri = (self.config.teacher.hf_dir or
                            publish(result["teacher_dir"], join(out, "teacher_model")))
        self.checkpoint_uri, self.distill_result = result["checkpoint_uri"], train_summary(result)
        self.next(self.join)

    @step
    def join(self, inputs):
        """Keep the control task's results (worker nodes produce none)."""
        self.merge_artifacts(inputs)
        self.next(self.evaluate)

    @step
    def evaluate(self):
        """Held-out KL(teacher || student) and held-out loss, before and after distillation."""
        from _posttrain_flow import fetch, join, publish_json
        from posttrain.data.prepared import local_view
        from steps import evaluate_distill
        cfg = build_config(DISTILL_SCHEMA, self.config)
        result = evaluate_distill.run(
            fetch(self.hf_uri), fetch(self.teacher_uri), local_view(self.prepared_uri),
            base_student_dir=fetch(self.base_student_uri), loader=cfg.train.loader,
            max_batches=cfg.eval.max_batches)
        self.kl_before = result["before"]["kl_teacher_student"]
        self.kl_after = result["after"]["kl_teacher_student"]
        self.eval_loss = result["after"]["student_loss"]
        self.eval_table = [{"metric": f"{when} {name}", "value": value}
                           for when in ("before", "after")
                           for name, value in result[when].items()]
        self.eval_uri = publish_json({**result, "content_hash": self.content_hash,
                                      "config": self.config.to_dict()},
                                     join(self.storage_root, "eval.json"))
        self.next(self.end)

    @card(type="blank", id="lineage")
    @step
    def end(self):
        """Record what produced the outputs (lineage artifact, run tags, card); point at them."""
        from _posttrain_flow import lineage_card, record_lineage
        self.lineage = record_lineage(
            self, outputs={"hf_uri": self.hf_uri, "checkpoint_uri": self.checkpoint_uri,
                           "eval_uri": self.eval_uri},
            started_from={"base_model_uri": self.base_student_uri,
                          "teacher_uri": self.teacher_uri})
        lineage_card(current.card["lineage"], self.lineage)
        print(f"student Hugging Face checkpoint: {self.hf_uri}\nteacher: {self.teacher_uri}\n"
              f"checkpoints: {self.checkpoint_uri}\neval: {self.eval_uri}\n"
              f"held-out KL(teacher || student): {self.kl_before:.4f} -> {self.kl_after:.4f}; "
              f"held-out student loss {self.eval_loss:.4f}")


if __name__ == "__main__":
    DistillFlow()
