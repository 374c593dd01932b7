"""The `pretrain` step inside a real pipeline run: core runner, artifact store, MLflow registry."""

from raypai import Artifact, StepContext, pipeline, step
from raypai.runner import Runner, tracker_for
from raypai.store import MetadataStore
from raypai.tracking import ARTIFACT_TAG
from raypai.train.steps import pretrain

from .conftest import make_shards, make_tokenizer


@step(cpus=0.1)
def fake_tokenize(ctx: StepContext, blocks: int = 256) -> dict:
    """Stands in for raypai.data's tokenizer + tokenize steps: same artifact kinds and formats."""
    tok = make_tokenizer(ctx.output_dir("tokenizer"))
    shards_dir = ctx.output_dir("shards")
    manifest = make_shards(shards_dir, blocks=blocks)
    return {
        "tokenizer": ctx.save(tok, kind="tokenizer", name="tok"),
        "shards": ctx.save(shards_dir, kind="token_shards", name="shards", metadata=manifest),
    }


@pipeline(name="pretrain-test")
def tiny(steps: int = 30):
    data = fake_tokenize()
    return pretrain(
        data["shards"],
        data["tokenizer"],
        steps=steps,
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        intermediate=128,
        lr=5e-3,
        checkpoint_every=15,
        eval_every=15,
        register_as="tiny-base",
        options={"log_every": 5, "model": {"max_positions": 64}},
    )


def test_pretrain_step_saves_a_model_artifact_registered_with_lineage(raypai_home):
    result = Runner(raypai_home).run(tiny.build(steps=30))
    assert result.ok, {n: s.error for n, s in result.steps.items() if s.error}
    model: Artifact = result["pretrain"].output()
    assert model.kind == "model" and model.metadata["eval_loss"] < model.metadata["unigram_entropy_nats"]
    assert (model.local_path() / "raypai.json").exists()

    store = MetadataStore(raypai_home.database_url)
    inputs = store.inputs_of(model.producer_step_run_id)
    assert {a.kind for a in inputs.values()} == {"token_shards", "tokenizer"}  # lineage leads to the shards

    version, tags = tracker_for(raypai_home).resolve_model("tiny-base", 1)
    assert version == 1 and tags[ARTIFACT_TAG] == model.id
    assert tags["raypai.input.shards.artifact_id"] == inputs["shards"].id
    assert tags["raypai.run_id"] == result.run_id

    again = Runner(raypai_home).run(tiny.build(steps=30))
    assert again["pretrain"].state == "cached"  # an unchanged pipeline does no training
