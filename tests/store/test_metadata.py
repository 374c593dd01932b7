"""The metadata suite, run on SQLite and on PostgreSQL (RAYPAI_TEST_DATABASE_URL)."""

import uuid

import pytest

from raypai.artifacts import Artifact
from raypai.deployment import DeploymentSpec
from raypai.errors import ConfigError, NotFoundError, StoreError
from raypai.lineage import openlineage_events, sources, upstream
from raypai.store import MetadataStore


def _art(kind="dataset", name="d", digest=None) -> Artifact:
    return Artifact(uuid.uuid4().hex, kind, name, f"/store/{kind}/{name}", digest or uuid.uuid4().hex * 2, 10, {"k": 1})


def test_runs_and_step_state_transitions(db_url):
    store = MetadataStore(db_url)
    run = store.create_run("pipe", {"n": 3}, source_file="p.py")
    sid = store.create_step_run(run, "clean", "mod:clean", {"n": 3}, "key1")
    store.transition(sid, "running", attempt=0, ray_task_id="t1")
    store.transition(sid, "failed", error="boom", traceback="Traceback ...")
    store.transition(sid, "running", attempt=1)
    store.transition(sid, "succeeded", metrics={"kept": 5}, result={"value": None, "outputs": ["output"]})
    states = [s for s, _ in store.step_events(sid)]
    assert states == ["pending", "running", "failed", "running", "succeeded"]
    sr = store.get_step_run(sid)
    assert sr["state"] == "succeeded" and sr["attempt"] == 1 and sr["metrics"] == {"kept": 5}
    assert sr["started_at"] <= sr["finished_at"]
    store.update_run(run, state="succeeded")
    r = store.get_run(run[:10])
    assert r["pipeline"] == "pipe" and r["params"] == {"n": 3} and r["finished_at"] is not None
    assert store.pipeline_source("pipe") == "p.py"
    with pytest.raises(StoreError, match="unknown step state"):
        store.transition(sid, "exploded")
    with pytest.raises(NotFoundError, match=r"not found \(newest runs: [0-9a-f]{12} \([\w-]+, \w+\).*raypai runs"):
        store.get_run("0" * 32)


def test_lookups_that_miss_name_what_exists(tmp_path):
    store = MetadataStore(f"sqlite:///{tmp_path}/meta.db")
    with pytest.raises(NotFoundError, match=r"no runs are recorded yet\); list runs with `raypai runs`"):
        store.get_run("abc")
    with pytest.raises(NotFoundError, match=r"newest: the store holds none yet\); list them with `raypai artifacts`"):
        store.get_artifact("abcdef")
    with pytest.raises(NotFoundError, match=r"no token named 'ci' \(tokens: none yet\)"):
        store.revoke_token("ci")
    run = store.create_run("toy", {})
    art = store.record_artifact(_art("dataset", "clean"))
    store.create_token("deployer", ["deploy"])
    with pytest.raises(NotFoundError, match=rf"newest runs: {run[:12]} \(toy, \w+\)"):
        store.get_run("zzz")
    with pytest.raises(NotFoundError, match=rf"newest: {art.id[:12]} \(dataset clean\)"):
        store.get_artifact("ffffff")
    with pytest.raises(NotFoundError, match=r"tokens: deployer\)"):
        store.revoke_token("ci")
    with pytest.raises(NotFoundError, match="`raypai show RUN_ID` lists a run's step runs"):
        store.get_step_run("nope")


def test_artifacts_edges_cache_lookup_and_lineage(db_url):
    store = MetadataStore(db_url)
    run = store.create_run("lin", {})
    src = store.record_artifact(_art("source", "raw"))
    s1 = store.create_step_run(run, "clean", "m:clean", {}, "k-clean")
    ds = store.record_artifact(_art("dataset", "clean"), producer_step_run_id=s1)
    store.add_edge(s1, src.id, "raw", direction="input")
    store.add_edge(s1, ds.id, "output", direction="output")
    store.transition(s1, "succeeded")
    s2 = store.create_step_run(run, "tok", "m:tok", {}, "k-tok")
    tok = store.record_artifact(_art("tokenizer", "tok"), producer_step_run_id=s2)
    store.add_edge(s2, ds.id, "data", direction="input")
    store.add_edge(s2, tok.id, "output", direction="output")
    store.transition(s2, "succeeded")

    hit = store.find_cached("k-clean")
    assert hit["step_run"]["id"] == s1 and hit["outputs"]["output"].id == ds.id
    assert store.find_cached("nope") is None
    assert store.get_artifact(ds.id[:8]).name == "clean"
    assert store.get_artifact(ds.uri).id == ds.id == store.get_artifact(ds.uri + "/").id  # `raypai verify URI`
    tree = upstream(store, tok.id)
    assert tree["produced_by"]["node"] == "tok"
    assert [a["name"] for a in sources(tree)] == ["raw"]
    # diamond: a step that reads both the tokenizer and the dataset it was trained on
    s3 = store.create_step_run(run, "pack", "m:pack", {}, "k-pack")
    packed = store.record_artifact(_art("dataset", "packed"), producer_step_run_id=s3)
    store.add_edge(s3, ds.id, "data", direction="input")
    store.add_edge(s3, tok.id, "tokenizer", direction="input")
    store.add_edge(s3, packed.id, "output", direction="output")
    store.transition(s3, "succeeded")
    diamond = upstream(store, packed.id)
    assert [a["name"] for a in sources(diamond)] == ["raw"]  # the second visit of `clean` is no leaf
    events = openlineage_events(store, run)
    assert {e["eventType"] for e in events} == {"COMPLETE"}
    complete_clean = [e for e in events if e["job"]["name"] == "lin.clean"][0]
    assert complete_clean["inputs"][0]["name"] == "source/raw"
    assert complete_clean["outputs"][0]["facets"]["version"]["datasetVersion"] == ds.digest


def test_tokens_are_hashed_and_scoped(db_url):
    store = MetadataStore(db_url)
    name = f"ci-{uuid.uuid4().hex[:6]}"
    token = store.create_token(name, ["infer", "deploy"])
    rec = store.lookup_token(token)
    assert rec.name == name and rec.scopes == ["deploy", "infer"] and not rec.revoked
    assert store.lookup_token(token + "x") is None
    with store.session() as s:
        from sqlalchemy import select

        from raypai.store.models import ApiToken

        stored = s.scalar(select(ApiToken.token_hash).where(ApiToken.name == name))
    assert token not in stored and len(stored) == 64
    with pytest.raises(StoreError, match="already exists"):
        store.create_token(name, ["infer"])
    store.revoke_token(name)
    assert store.lookup_token(token).revoked


def test_deployments_keep_desired_state_and_history(db_url):
    store = MetadataStore(db_url)
    name = f"dep-{uuid.uuid4().hex[:6]}"
    spec = DeploymentSpec(model="tiny", version=1)
    store.save_deployment(name, spec, "running")
    rec = store.save_deployment(name, spec.with_canary(2, 50), "running")
    assert rec.spec == DeploymentSpec(model="tiny", version=1, canary_version=2, canary_percent=50)
    assert len(rec.history) == 2 and rec.history[-1]["spec"]["canary_version"] == 2
    assert store.get_deployment(name).spec == rec.spec  # typed on the way out as on the way in
    assert store.rollback_canary(name, 2, "worse") and store.get_deployment(name).spec == spec
    assert not store.rollback_canary(name, 2, "again")  # no longer the canary
    assert name in [d.name for d in store.list_deployments()]
    assert store.delete_deployment(name) and store.get_deployment(name) is None
    with pytest.raises(TypeError, match="takes a raypai.deployment.DeploymentSpec"):
        store.save_deployment(name, {"model": "tiny", "version": 1}, "running")


def test_deployment_spec_transitions_and_stored_json():
    spec = DeploymentSpec(model="m", version=3, previous_versions=(1, 2))
    canary = spec.with_canary(4, 10)
    assert canary.served() == [(3, "stable"), (4, "canary")] and canary.versions() == {3, 4}
    promoted = canary.promoted()
    assert (promoted.version, promoted.canary_version, promoted.previous_versions) == (4, None, (1, 2, 3))
    assert promoted.rolled_back() == DeploymentSpec(model="m", version=3, previous_versions=(1, 2))
    assert DeploymentSpec.from_dict(canary.to_dict()) == canary
    assert canary.to_dict()["batching"] == {"max_batch_size": 16, "batch_wait_timeout_s": 0.01, "max_kv_cells": 65536}
    with pytest.raises(ConfigError) as err:
        DeploymentSpec.from_dict({"model": "m", "verison": 3, "replicas": "two"})
    assert err.value.problems == [
        "unknown option 'verison' (did you mean 'version'?); valid options: model, version, canary_version, "
        "canary_percent, previous_versions, replicas, autoscaling, cpus, gpus, batching, canary_policy, "
        "max_ongoing_requests, max_queued_requests, request_timeout_s, drain_timeout_s, engine",
        "replicas must be int (got str 'two')",
        "version is required (int)",
    ]


def test_op_stats_round_trip(db_url):
    store = MetadataStore(db_url)
    rows = [
        {"op_name": "dedup", "op_index": 1, "rows_in": 10, "rows_out": 7, "seconds": 0.5, "clusters": 2},
        {"op_name": "length", "op_index": 0, "rows_in": 12, "rows_out": 10, "seconds": 0.1},
    ]
    aid = uuid.uuid4().hex
    store.record_op_stats(None, aid, rows)
    got = store.op_stats(artifact_id=aid)
    assert [r["op_name"] for r in got] == ["length", "dedup"]
    assert got[1]["dropped"] == 3 and got[1]["clusters"] == 2


def test_unreachable_database_is_one_clear_error():
    with pytest.raises(StoreError) as err:
        MetadataStore("postgresql+psycopg://nobody@127.0.0.1:1/none")
    assert "cannot reach the metadata database" in str(err.value) and "RAYPAI_DATABASE_URL" in str(err.value)


def test_concurrent_writers_from_ray_tasks_lose_nothing(db_url):
    """8 Ray tasks each record artifacts with lineage edges into one database: 500 each on
    PostgreSQL (the production store), 200 each on SQLite (one writer at a time by design)."""
    import ray

    store = MetadataStore(db_url)
    run = store.create_run("concurrency", {})
    ray.init(address="local", num_cpus=8, include_dashboard=False)
    try:

        @ray.remote(num_cpus=1)
        def writer(url, run_id, worker, n):
            st = MetadataStore(url, migrate_schema=False)
            sid = st.create_step_run(run_id, f"w{worker}", "test:writer", {}, None)
            for i in range(n):
                a = st.record_artifact(
                    Artifact(uuid.uuid4().hex, "dataset", f"w{worker}-{i}", "/x", f"{worker:04d}{i:060d}", i, {}),
                    producer_step_run_id=sid,
                )
                st.add_edge(sid, a.id, f"out{i}", direction="output")
            return sid

        per_worker = 500 if db_url.startswith("postgresql") else 200
        sids = ray.get([writer.remote(db_url, run, w, per_worker) for w in range(8)], timeout=600)
    finally:
        ray.shutdown()
    assert len(set(sids)) == 8
    assert sum(len(store.outputs_of(s)) for s in sids) == 8 * per_worker


def test_cache_components_and_the_run_a_miss_is_explained_against(db_url):
    store = MetadataStore(db_url)
    step = f"m{uuid.uuid4().hex[:6]}:clean"
    parts = {"v": 1, "step": step, "code": {"m": "d1"}}
    a = store.create_run("pipe_a", {})
    mine = store.create_step_run(
        a,
        "clean",
        step,
        {"n": 1},
        "k1",
        cache_components=parts,
        cache_reason="cache miss: no earlier run of this step recorded its key",
    )
    store.transition(mine, "succeeded")
    failed = store.create_step_run(store.create_run("pipe_a", {}), "clean", step, {}, "k2", cache_components=parts)
    store.transition(failed, "failed")  # failed runs are not what a key is compared with
    other = store.create_step_run(store.create_run("pipe_b", {}), "clean_2", step, {}, "k3", cache_components=parts)
    store.transition(other, "cached")  # newer, but another pipeline's node
    got = store.get_step_run(mine)
    assert got["cache_components"] == parts and got["cache_reason"].startswith("cache miss: no earlier")
    assert store.last_keyed_step_run(step, pipeline="pipe_a", node="clean")["id"] == mine
    assert store.last_keyed_step_run(step, pipeline="pipe_c", node="clean")["id"] == other  # newest otherwise
    assert store.last_keyed_step_run("m:absent", pipeline="pipe_a", node="clean") is None
