"""The artifact store on S3 (`RAYPAI_ARTIFACT_URI=s3://bucket/prefix`) against a real S3 protocol
server on loopback: multipart writes, the same digest as the local store, and a server that goes
down mid-upload (clean failure, no partial artifact visible, success on retry once it is back).

The server is moto's S3 app served by werkzeug in this process, so that "going down" closes the
listening socket and every open connection while the stored objects survive, as a real S3
endpoint with durable storage behaves across an outage.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from raypai.artifacts import ArtifactStore, digest_dir
from raypai.errors import NotFoundError, StoreError

BIG = 40 << 20  # 40 MiB: several multipart parts (pyarrow uploads S3 objects in 10 MiB parts)


class S3Server:
    """moto's S3 over HTTP on 127.0.0.1:port; stop() drops the listener and all connections."""

    def __init__(self, port: int):
        self.port = port
        self._srv = None

    def start(self) -> "S3Server":
        from moto.moto_server.threaded_moto_server import MotoRequestHandler
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        conns: set[socket.socket] = set()
        self._down = down = threading.Event()

        class Tracked(MotoRequestHandler):
            def setup(self):
                super().setup()
                conns.add(self.connection)

            def handle(self):
                if not down.is_set():  # once stopping, a new connection is closed unanswered
                    super().handle()

        self._srv = make_server(
            "127.0.0.1",
            self.port,
            DomainDispatcherApplication(create_backend_app),
            threaded=True,
            request_handler=Tracked,
        )
        self._conns = conns
        self._thread = threading.Thread(target=self._srv.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        # refuse and cut connections first: shutdown() alone waits up to a poll interval (0.5 s)
        # while in-flight requests would keep completing
        self._down.set()
        for c in list(self._conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._srv.shutdown()
        self._srv.server_close()
        self._thread.join(10)


@pytest.fixture
def s3(free_port, monkeypatch):
    """A running S3 server with a fresh bucket; the AWS variables point at it, as in production."""
    import boto3

    server = S3Server(free_port()).start()
    endpoint = f"http://127.0.0.1:{server.port}"
    for k, v in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "raypai",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3")
    bucket = f"raypai-{os.urandom(4).hex()}"
    client.create_bucket(Bucket=bucket)
    yield server, client, bucket
    server.stop()


def _artifact_dir(root: Path) -> Path:
    root.mkdir()
    (root / "a-manifest.json").write_text('{"rows": 3}')
    (root / "shards").mkdir()
    (root / "shards" / "b-part-0.bin").write_bytes(os.urandom(BIG))
    return root


def test_s3_store_writes_multipart_and_digests_like_the_local_store(s3, tmp_path):
    server, client, bucket = s3
    src = _artifact_dir(tmp_path / "src")
    art = ArtifactStore(f"s3://{bucket}/prefix", cache_dir=tmp_path / "cache").put_dir(src, kind="dataset", name="d")
    local = ArtifactStore(str(tmp_path / "local")).put_dir(src, kind="dataset", name="d")
    assert art.digest == local.digest == digest_dir(src)[0] and art.size_bytes == local.size_bytes
    assert art.uri == f"s3://{bucket}/prefix/dataset/{art.digest}"
    head = client.head_object(Bucket=bucket, Key=f"prefix/dataset/{art.digest}/shards/b-part-0.bin")
    parts = int(head["ETag"].strip('"').rsplit("-", 1)[1])  # multipart ETags end in -<number of parts>
    assert parts >= 2 and head["ContentLength"] == BIG
    # a fresh cache downloads the same content back
    assert digest_dir(art.local_path(tmp_path / "cache2"))[0] == art.digest


def test_server_down_mid_upload_fails_cleanly_and_the_retry_succeeds(s3, tmp_path):
    server, client, bucket = s3
    src = _artifact_dir(tmp_path / "src")
    store = ArtifactStore(f"s3://{bucket}/prefix", cache_dir=tmp_path / "cache")
    digest = digest_dir(src)[0]
    big_key = f"prefix/dataset/{digest}/shards/b-part-0.bin"
    outcome: dict = {}

    def upload():
        try:
            outcome["artifact"] = store.put_dir(src, kind="dataset", name="d")
        except Exception as exc:  # noqa: BLE001 - the test inspects what came out
            outcome["error"] = exc

    worker = threading.Thread(target=upload)
    worker.start()
    # wait until the big file is mid-upload: a multipart upload exists with at least one part stored
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        uploads = [u for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) if u["Key"] == big_key]
        if uploads and client.list_parts(Bucket=bucket, Key=big_key, UploadId=uploads[0]["UploadId"]).get("Parts"):
            break
        time.sleep(0.01)
    else:
        pytest.fail("the upload never reached the multipart stage")
    server.stop()
    worker.join(120)
    assert not worker.is_alive()
    assert isinstance(outcome.get("error"), StoreError), outcome
    assert "Nothing was committed; retry" in str(outcome["error"])

    server.start()  # back, with whatever it had stored
    uri = f"s3://{bucket}/prefix/dataset/{digest}"
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert big_key not in keys  # the interrupted object never became visible
    assert not store.exists(uri)  # and the artifact is not visible: no commit marker
    with pytest.raises(NotFoundError):
        store.open_artifact(outcome.get("artifact") or _record(uri, digest))

    art = store.put_dir(src, kind="dataset", name="d")  # the retry
    assert art.uri == uri and store.exists(uri)
    assert digest_dir(store.open_artifact(art))[0] == digest


def _record(uri: str, digest: str):
    from raypai.artifacts import Artifact

    return Artifact(id="x", kind="dataset", name="d", uri=uri, digest=digest, size_bytes=0)
