"""The toy pipeline against production-shaped services on loopback (`raypai services up`: metadata
in PostgreSQL, an MLflow server with its backend in PostgreSQL, artifacts in an S3 bucket) and the
same pipeline embedded (SQLite, local MLflow, local folder): the lineage and the MLflow records are
identical in shape, and each record is where production keeps it. One local Ray for both runs."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import create_engine, text

from raypai.artifacts import digest_dir
from raypai.lineage import upstream
from raypai.pipelines.toy import toy
from raypai.runner import Runner, tracker_for
from raypai.settings import Settings
from raypai.store import MetadataStore
from raypai.tools.parity import differences, lineage_digests, lineage_shape, mlflow_shape, registry_shape

_RAYPAI_VARS = (
    "RAYPAI_HOME",
    "RAYPAI_DATABASE_URL",
    "MLFLOW_TRACKING_URI",
    "RAYPAI_ARTIFACT_URI",
    "RAY_ADDRESS",
    "RAYPAI_CONFIG",
)
PARAMS = dict(n=12, seed=3)


@pytest.fixture(scope="module")
def runs(running_services, tmp_path_factory):
    """{'production': (settings, result), 'embedded': (settings, result)} of one toy run each."""
    import ray

    cfg, env = running_services
    with pytest.MonkeyPatch.context() as mp:
        for var in _RAYPAI_VARS:
            mp.delenv(var, raising=False)
        for k, v in env.items():  # the AWS variables reach Ray's workers through the environment, as on a node
            if k.startswith(("AWS_", "MLFLOW_S3_")):
                mp.setenv(k, v)
        if ray.is_initialized():  # started before the variables were set: its workers would lack them
            ray.shutdown()
        services = {k: env[k] for k in ("RAYPAI_DATABASE_URL", "MLFLOW_TRACKING_URI", "RAYPAI_ARTIFACT_URI")}
        prod = Settings.load({"RAYPAI_HOME": str(tmp_path_factory.mktemp("prod")), **services})
        embedded = Settings.load({"RAYPAI_HOME": str(tmp_path_factory.mktemp("embedded"))})
        out = {
            name: (s, Runner(s, progress=lambda e: None).run(toy.build(**PARAMS)))
            for name, s in (("production", prod), ("embedded", embedded))
        }
        yield cfg, env, out


def _tree(settings, result) -> dict:
    return upstream(MetadataStore(settings.database_url, migrate_schema=False), result.result.id)


def _s3(env):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_REGION"],
    )


def test_production_settings_point_at_the_services(runs):
    cfg, env, out = runs
    prod, _ = out["production"]
    assert prod.database_url.startswith("postgresql+psycopg://") and prod.database_url.endswith(cfg.metadata_db)
    assert prod.mlflow_tracking_uri == cfg.mlflow_uri and prod.artifact_uri == f"s3://{cfg.bucket}/artifacts"
    for name, (_, result) in out.items():
        assert result.ok, (name, {n: s.error for n, s in result.steps.items() if s.error})


def test_lineage_is_identical_in_shape_and_content(runs):
    cfg, _, out = runs
    trees = {name: _tree(s, r) for name, (s, r) in out.items()}
    assert differences(lineage_shape(trees["production"]), lineage_shape(trees["embedded"])) == []
    # the toy pipeline is deterministic: content-addressed artifacts get the same digests on both stores
    assert lineage_digests(trees["production"]) == lineage_digests(trees["embedded"])
    assert list(lineage_digests(trees["production"])) == ["counts", "counts<-text", "counts<-text<-text"]

    chain, edges, kinds, node = [], [], [], trees["production"]
    while node is not None:
        step = node["produced_by"]
        chain.append(step["node"])
        kinds.append(node["artifact"]["kind"])
        edges += [i["name"] for i in step["inputs"]]
        node = step["inputs"][0]["lineage"] if step["inputs"] else None  # write_text reads no artifact
    assert chain == ["count", "transform", "write_text"] and kinds == ["report", "dataset", "dataset"]
    assert edges == ["text", "text"]
    assert set(trees["production"]) == set(trees["embedded"]) == {"artifact", "produced_by"}

    def uris(tree):
        step = tree["produced_by"]
        return [tree["artifact"]["uri"]] + ([u for i in step["inputs"] for u in uris(i["lineage"])] if step else [])

    assert all(u.startswith(f"s3://{cfg.bucket}/artifacts/") for u in uris(trees["production"]))
    emb_root = out["embedded"][0].artifact_uri
    assert all(u.startswith(emb_root) for u in uris(trees["embedded"]))


def test_mlflow_records_are_identical_in_shape(runs):
    _, _, out = runs
    shapes = {name: mlflow_shape(tracker_for(s), r.mlflow_run_id) for name, (s, r) in out.items()}
    assert differences(shapes["production"], shapes["embedded"]) == []
    shape = shapes["production"]
    assert shape["experiment"] == "toy" and shape["status"] == "FINISHED"
    assert shape["param_keys"] == ["fail_if_exists", "n", "seed", "upper"]
    assert sorted(shape["children"]) == ["count", "transform", "write_text"]
    count = shape["children"]["count"][0]
    assert count["metric_keys"] == ["distinct_words", "words"] and count["inputs"] == [
        ["transformed", "input", "dataset"]
    ]
    assert "raypai.step_run_id" in count["tag_keys"] and "mlflow.parentRunId" in count["tag_keys"]
    # and the same values: the server stored what the embedded store stored
    metrics = {name: tracker_for(s).client.get_run(_child(s, r, "count")).data.metrics for name, (s, r) in out.items()}
    assert metrics["production"] == metrics["embedded"] and metrics["production"]["words"] > 0


def _child(settings, result, node: str) -> str:
    return MetadataStore(settings.database_url, migrate_schema=False).get_step_run(result[node].step_run_id)[
        "mlflow_run_id"
    ]


def test_artifacts_are_objects_in_the_bucket(runs):
    cfg, env, out = runs
    s3 = _s3(env)
    (_, prod_result), (_, emb_result) = out["production"], out["embedded"]
    for node in ("write_text", "transform", "count"):
        art, local = prod_result[node].output(), emb_result[node].output()
        prefix = art.uri.removeprefix(f"s3://{cfg.bucket}/") + "/"
        keys = sorted(o["Key"][len(prefix) :] for o in s3.list_objects_v2(Bucket=cfg.bucket, Prefix=prefix)["Contents"])
        files = sorted(p.relative_to(local.uri).as_posix() for p in local.local_path().rglob("*") if p.is_file())
        assert keys == files, (node, keys, files)  # the same files, the commit marker included
        assert "_RAYPAI_COMMITTED.json" in keys
    report = prod_result["count"].output()
    body = s3.get_object(Bucket=cfg.bucket, Key=report.uri.removeprefix(f"s3://{cfg.bucket}/") + "/counts.json")
    counts = json.loads(body["Body"].read())
    assert counts == json.loads((emb_result["count"].output().local_path() / "counts.json").read_text())
    assert "RAY" in counts  # upper-cased by transform


def test_runs_are_in_postgresql(runs):
    cfg, _, out = runs
    prod, result = out["production"]
    child_ids = {n: _child(prod, result, n) for n in ("write_text", "transform", "count")}
    engine = create_engine(cfg.db_url(cfg.mlflow_db))
    try:
        with engine.connect() as conn:
            rows = dict(
                conn.execute(
                    text(
                        "SELECT r.run_uuid, r.status FROM runs r JOIN experiments e "
                        "ON r.experiment_id = e.experiment_id WHERE e.name = 'toy'"
                    )
                ).all()
            )
    finally:
        engine.dispose()
    assert rows == {rid: "FINISHED" for rid in [result.mlflow_run_id, *child_ids.values()]}

    engine = create_engine(prod.database_url)
    try:
        with engine.connect() as conn:
            steps = dict(
                conn.execute(text("SELECT node, state FROM step_runs WHERE run_id = :r"), {"r": result.run_id}).all()
            )
            run = conn.execute(
                text("SELECT state, mlflow_run_id FROM pipeline_runs WHERE id = :r"), {"r": result.run_id}
            ).one()
            arts = conn.execute(text("SELECT uri FROM artifacts")).scalars().all()
    finally:
        engine.dispose()
    assert steps == {"write_text": "succeeded", "transform": "succeeded", "count": "succeeded"}
    assert tuple(run) == ("succeeded", result.mlflow_run_id)
    assert len(arts) == 3 and all(u.startswith(f"s3://{cfg.bucket}/artifacts/") for u in arts)


def test_a_rerun_on_the_services_is_all_cache_hits(runs):
    _, _, out = runs
    prod, first = out["production"]
    again = Runner(prod, progress=lambda e: None).run(toy.build(**PARAMS))
    assert [s.state for s in again.steps.values()] == ["cached"] * 3
    assert again.result.digest == first.result.digest and again.result.uri == first.result.uri


def test_registry_on_the_server_matches_embedded(runs, tmp_path):
    """A model folder registered with lineage tags, through the MLflow server (files proxied to S3,
    versions in PostgreSQL) and embedded: the same registry shape. Both registries now hold a
    `toy-model` version 1 with different weights; downloads into one shared cache (one RAYPAI_HOME
    used with both, as after `raypai services up`) each return their own registry's bytes."""
    cfg, env, out = runs
    shapes, sources = {}, {}
    for name, (s, r) in out.items():
        model = tmp_path / f"model-{name}"
        model.mkdir()
        (model / "config.json").write_text('{"model_type": "llama"}')
        (model / "model.safetensors").write_bytes(name.encode() * 4096)
        tracker = tracker_for(s)
        digest = digest_dir(model)[0]  # a version's digest must be its files' (register_model checks)
        version = tracker.register_model(
            model,
            "toy-model",
            run_id=_child(s, r, "count"),
            alias="champion",
            tags={"raypai.artifact_id": r.result.id, "raypai.digest": digest},
        )
        assert tracker.resolve_model("toy-model", "champion") == (
            version,
            {"raypai.artifact_id": r.result.id, "raypai.digest": digest},
        )
        shapes[name] = registry_shape(tracker, "toy-model")
        sources[name] = tracker.model_source("toy-model", version)
        got = tracker.download_model("toy-model", version, cache_dir=tmp_path / "shared-cache")
        assert (got / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
    assert differences(shapes["production"], shapes["embedded"]) == []
    assert shapes["production"]["versions"] == [
        {
            "version": 1,
            "status": "READY",
            "aliases": ["champion"],
            "tag_keys": ["raypai.artifact_id", "raypai.digest"],
            "run_name": "count",
        }
    ]
    assert sources["production"].startswith("mlflow-artifacts:/")  # proxied by the server ...
    keys = [o["Key"] for o in _s3(env).list_objects_v2(Bucket=cfg.bucket, Prefix="mlflow/")["Contents"]]
    assert any(k.endswith("/artifacts/model/model.safetensors") for k in keys)  # ... into the bucket
    engine = create_engine(cfg.db_url(cfg.mlflow_db))
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name, version FROM model_versions")).all() == [("toy-model", 1)]
    finally:
        engine.dispose()
