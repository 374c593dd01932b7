"""The artifact store's checks on S3 (`RAYPAI_ARTIFACT_URI=s3://bucket/prefix`) against a real S3
protocol server on loopback (moto's, in this process): a download whose objects differ from the
recorded digest is refused, naming the object; a listing key with '..' never leads outside the
download folder; a committed artifact whose object sizes differ is no cache hit; `verify` hashes the
objects without downloading them to disk.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from raypai.artifacts import MARKER, ArtifactStore
from raypai.errors import DataError


def _saved(tmp_path: Path, bucket: str):
    src = tmp_path / "src"
    (src / "shards").mkdir(parents=True)
    (src / "manifest.json").write_text('{"rows": 3}')
    (src / "shards" / "part-0.bin").write_bytes(b"a" * 4096)
    store = ArtifactStore(f"s3://{bucket}/prefix", cache_dir=tmp_path / "cache")
    art = store.put_dir(src, kind="dataset", name="d")
    return store, art, f"prefix/dataset/{art.digest}"


def test_a_download_whose_objects_differ_from_the_recorded_digest_is_refused(s3, tmp_path):
    from raypai.integrity import CorruptArtifact

    client, bucket = s3
    store, art, key = _saved(tmp_path, bucket)
    marker = client.get_object(Bucket=bucket, Key=f"{key}/{MARKER}")["Body"].read()
    assert b'"shards/part-0.bin": [4096' in marker  # each object's size and sha256 recorded at commit
    client.put_object(Bucket=bucket, Key=f"{key}/shards/part-0.bin", Body=b"b" * 4096)  # same size

    assert store.problems(art.uri) == []  # sizes agree: a cache hit's check cannot tell
    problems = store.verify(art)
    assert len(problems) == 1 and problems[0].startswith("shards/part-0.bin differs"), problems
    with pytest.raises(CorruptArtifact, match=r"shards/part-0.bin differs.*download was discarded"):
        store.open_artifact(art)
    assert not (tmp_path / "cache" / art.digest).exists()
    assert not [p for p in (tmp_path / "cache").iterdir()]  # the partial download is gone too

    client.put_object(Bucket=bucket, Key=f"{key}/shards/part-0.bin", Body=b"a" * 4096)
    assert store.verify(art) == []
    local = store.open_artifact(art)
    assert (local / "shards" / "part-0.bin").read_bytes() == b"a" * 4096


def test_a_truncated_object_is_no_cache_hit_and_the_next_save_replaces_it(s3, tmp_path):
    client, bucket = s3
    store, art, key = _saved(tmp_path, bucket)
    client.put_object(Bucket=bucket, Key=f"{key}/shards/part-0.bin", Body=b"a" * 100)
    assert store.problems(art.uri) == ["shards/part-0.bin is 100 bytes, 4096 were recorded"]
    store.put_dir(tmp_path / "src", kind="dataset", name="d")
    assert store.problems(art.uri) == [] and store.verify(art) == []


def test_a_listing_key_with_dotdot_never_leads_outside_the_download_folder(s3, tmp_path):
    client, bucket = s3
    store, art, key = _saved(tmp_path, bucket)
    client.put_object(Bucket=bucket, Key=f"{key}/../../escaped.txt", Body=b"pwned")
    (tmp_path / "cache" / "sub").mkdir(parents=True)
    with pytest.raises(DataError, match="not allowed inside an artifact"):
        art.local_path(tmp_path / "cache" / "sub")
    assert not list(tmp_path.rglob("escaped.txt"))
