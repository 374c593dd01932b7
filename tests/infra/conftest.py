"""Fixtures for the infra tests: free loopback ports, the repository root and a moto S3 server."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="session")
def free_port():
    """`free_port()` -> a TCP port nobody listens on now (colleagues' clusters use the default ones)."""
    return _free_port


@pytest.fixture(scope="session")
def port_open():
    return _port_open


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="module")
def running_services(tmp_path_factory, pg_server_url):
    """(ServicesConfig, env) of `raypai services up` on free ports, with databases and a bucket of
    its own; stopped and its databases dropped after the module."""
    import uuid

    from sqlalchemy import create_engine, text

    from raypai.tools.services import ServicesConfig, down, up

    tag = uuid.uuid4().hex[:8]
    cfg = ServicesConfig(
        home=tmp_path_factory.mktemp("services"),
        postgres_url=pg_server_url,
        mlflow_db=f"raypai_mlflow_t{tag}",
        metadata_db=f"raypai_t{tag}",
        mlflow_port=_free_port(),
        s3_port=_free_port(),
        bucket=f"raypai-t{tag}",
    )
    try:
        yield cfg, up(cfg)
    finally:
        down(cfg)
        engine = create_engine(pg_server_url, isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            for db in (cfg.mlflow_db, cfg.metadata_db):
                conn.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
        engine.dispose()


@pytest.fixture
def s3(free_port, monkeypatch):
    """(boto3 client, bucket) of a running moto S3 server; the AWS variables point at it."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for k, v in {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "raypai",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3")
    bucket = f"raypai-{os.urandom(4).hex()}"
    client.create_bucket(Bucket=bucket)
    yield client, bucket
    server.stop()
