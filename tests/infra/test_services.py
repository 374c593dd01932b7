"""`raypai services`: a real moto S3 server and a real MLflow server with its backend store in
PostgreSQL; a real MLflow client logs a run whose artifact lands in the S3 bucket."""

from __future__ import annotations

import uuid

import psutil
import pytest
from sqlalchemy import create_engine, text

from raypai.errors import ConfigError, StoreError
from raypai.tools.services import ServicesConfig, down, status, up


@pytest.fixture
def services_cfg(tmp_path, pg_server_url, free_port):
    tag = uuid.uuid4().hex[:8]
    cfg = ServicesConfig(
        home=tmp_path / "home",
        postgres_url=pg_server_url,
        mlflow_db=f"raypai_mlflow_t{tag}",
        metadata_db=f"raypai_t{tag}",
        mlflow_port=free_port(),
        s3_port=free_port(),
        bucket=f"raypai-t{tag}",
    )
    yield cfg
    down(cfg)
    engine = create_engine(pg_server_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        for db in (cfg.mlflow_db, cfg.metadata_db):
            conn.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
    engine.dispose()


def test_up_status_log_to_mlflow_with_s3_artifacts_then_down(services_cfg, tmp_path, port_open):
    import boto3
    from mlflow import MlflowClient

    cfg = services_cfg
    env = up(cfg)
    states = {s.name: s for s in status(cfg)}
    assert all(s.running and s.healthy for s in states.values()), states
    assert (cfg.dir / "mlflow.log").exists() and (cfg.dir / "s3.pid").exists()
    assert (cfg.dir / "env.sh").read_text().count("export ") == len(env)
    assert env["MLFLOW_TRACKING_URI"] == f"http://127.0.0.1:{cfg.mlflow_port}"
    assert env["RAYPAI_ARTIFACT_URI"] == f"s3://{cfg.bucket}/artifacts"
    assert up(cfg) == env and states["s3"].pid == status(cfg)[0].pid  # idempotent: reuses the servers

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    exp = client.create_experiment(f"infra-{uuid.uuid4().hex[:6]}")
    run = client.create_run(exp)
    client.log_param(run.info.run_id, "lr", "0.1")
    client.log_metric(run.info.run_id, "loss", 0.5, step=1)
    report = tmp_path / "report.txt"
    report.write_text("served by the MLflow server, stored in S3\n")
    client.log_artifact(run.info.run_id, str(report), artifact_path="reports")
    client.set_terminated(run.info.run_id)

    # the run is in PostgreSQL (MLflow's backend store) ...
    engine = create_engine(cfg.db_url(cfg.mlflow_db))
    with engine.connect() as conn:
        row = conn.execute(text("SELECT status FROM runs WHERE run_uuid = :r"), {"r": run.info.run_id}).first()
    engine.dispose()
    assert row == ("FINISHED",)
    # ... and the artifact is an object in the bucket, written by the server through the S3 API
    s3 = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_REGION"],
    )
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=cfg.bucket, Prefix="mlflow/").get("Contents", [])]
    key = next(k for k in keys if k.endswith(f"{run.info.run_id}/artifacts/reports/report.txt"))
    assert s3.get_object(Bucket=cfg.bucket, Key=key)["Body"].read() == report.read_bytes()
    # and reads come back through the server
    local = client.download_artifacts(run.info.run_id, "reports/report.txt", str(tmp_path / "dl"))
    assert open(local).read() == report.read_text()

    pids = [s.pid for s in status(cfg)]
    assert sorted(down(cfg)) == ["mlflow", "s3"]
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert not port_open(cfg.mlflow_port) and not port_open(cfg.s3_port)
    assert not any(s.running for s in status(cfg)) and down(cfg) == []


def test_unreachable_postgres_fails_before_starting_anything(tmp_path, free_port):
    cfg = ServicesConfig(
        home=tmp_path,
        postgres_url=f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/postgres",
        mlflow_port=free_port(),
        s3_port=free_port(),
    )
    with pytest.raises(StoreError, match="--postgres-url"):
        up(cfg)
    assert not list((tmp_path / "services").glob("*.pid"))


def test_config_errors_are_reported_together(tmp_path):
    bad = ServicesConfig(
        home=tmp_path,
        postgres_url="mysql://x",
        mlflow_db="Bad-Name",
        metadata_db="raypai",
        mlflow_port=9000,
        s3_port=9000,
        bucket="B",
    )
    with pytest.raises(ConfigError) as info:
        bad.validate()
    text_ = str(info.value)
    for needle in ("postgres_url", "mlflow_db", "both 9000", "bucket"):
        assert needle in text_
    assert len(info.value.problems) == 4
