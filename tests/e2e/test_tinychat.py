"""The whole product in one test: a small tinychat run from raw text to a deployed endpoint,
queried over HTTP, and the lineage chain from the deployment back to the raw files."""

import httpx

from raypai.lineage.deploy import deployment_lineage
from raypai.pipelines.tinychat import tinychat
from raypai.runner import Runner
from raypai.serving.control import serve_port
from raypai.store import MetadataStore

# small enough for the test-time budget: one Ray Train worker (multi-worker pretraining is
# tests/train's), 4 GRPO steps (each one evaluated and checkpointed)
SMALL = dict(
    docs=800,
    vocab_size=512,
    block_size=64,
    hidden=64,
    pretrain_steps=30,
    workers=1,
    sft_steps=100,
    sft_lr=3e-3,
    rm_steps=60,
    align_steps=4,
)


def _chain(store, artifact_id: str) -> list[str]:
    """Steps along the main input path from an artifact to its raw source, read from the store."""
    out = []
    art = store.get_artifact(artifact_id)
    while art.producer_step_run_id:
        out.append(store.get_step_run(art.producer_step_run_id)["node"])
        inputs = store.inputs_of(art.producer_step_run_id)
        nxt = next((inputs[k] for k in ("sft_model", "base_model", "shards", "dataset", "raw") if k in inputs), None)
        if nxt is None:
            break
        art = nxt
    return out


def test_tinychat_end_to_end_with_lineage(raypai_home):
    from ray import serve

    result = Runner(raypai_home).run(tinychat.build(**SMALL, require_improvement=False))  # gate off: always an endpoint
    try:
        assert result.ok, {n: s.error for n, s in result.steps.items() if s.error}
        assert result.result["deployed"] and result.result["deployment"] == "tinychat"
        store = MetadataStore(raypai_home.database_url)
        token = store.create_token("e2e", ["infer"])
        r = httpx.post(
            f"http://127.0.0.1:{serve_port()}/v1/chat/completions",
            timeout=120,
            headers={"Authorization": f"Bearer {token}"},
            json={"model": "tinychat", "messages": [{"role": "user", "content": "3+4="}], "max_tokens": 4},
        )
        assert r.status_code == 200, r.text
        version = r.headers["x-raypai-model-version"]
        assert version == f"tinychat/{result.result['version']}" == r.json()["raypai_model_version"]

        graph = deployment_lineage(store, raypai_home, "tinychat")
        stable = graph["models"][0]
        assert f"{stable['model']}/{stable['version']}" == version
        chain = _chain(store, stable["tags"]["raypai.artifact_id"])
        assert chain == ["grpo", "sft", "pretrain", "tokenize", "clean", "ingest"], chain  # ingest reads the raw files
        raws = stable["raw_sources"]
        assert [a["kind"] for a in raws] == ["source"] and raws[0]["uri"].endswith("synth-800-4-0")
        assert stable["lineage"]["produced_by"]["mlflow_run_id"]
        ev = result["evaluate"].value
        assert ev["metric"] == "held_out_reward"
        assert {"candidate", "baseline", "ppl_candidate", "ppl_baseline", "improved"} <= set(ev)
        # SFT mixes pretraining blocks (ptx): held-out perplexity stays below a uniform guess over the vocabulary
        assert ev["ppl_baseline"] < 512 and ev["ppl_candidate"] < 512, ev
        assert result["register"].value["promoted"] == ev["improved"]
    finally:
        serve.shutdown()


def test_algorithm_parameter_picks_the_alignment_steps_and_rejects_unknown_names():
    import pytest

    from raypai.errors import ConfigError

    assert {"reward_model", "ppo"} <= set(tinychat.build(algorithm="ppo").nodes)
    assert "reward_model" not in tinychat.build(algorithm="dpo").nodes
    with pytest.raises(ConfigError, match="algorithm 'rlhf' is not available in tinychat; choose one of grpo, ppo"):
        tinychat.build(algorithm="rlhf")
