"""A path parameter on S3 enters a step's cache key by its objects' ETags (raypai.filedigests), on a
real S3 protocol server on loopback (moto's, in this process): a same-size rewrite in the same second
changes the key, which a size-and-mtime listing can miss; an unchanged prefix keeps it; objects
beside the prefix (`data2/` next to `data`) are not part of it."""

from __future__ import annotations

from raypai.filedigests import FileDigests


def test_an_s3_prefix_is_keyed_by_its_objects_etags(s3):
    client, bucket = s3
    client.put_object(Bucket=bucket, Key="data/chats.jsonl", Body=b'{"a": 1}\n')
    client.put_object(Bucket=bucket, Key="data/more/b.jsonl", Body=b'{"b": 2}\n')
    uri = f"s3://{bucket}/data"
    first = FileDigests().of(uri)
    assert "etags" in first and first["bytes"] == 18
    assert FileDigests().of(uri) == first  # unchanged: the same key
    client.put_object(Bucket=bucket, Key="data2/other.jsonl", Body=b"x")  # beside the prefix, not in it
    assert FileDigests().of(uri) == first
    client.put_object(Bucket=bucket, Key="data/chats.jsonl", Body=b'{"a": 9}\n')  # same size, new content
    changed = FileDigests().of(uri)
    assert changed["etags"] != first["etags"] and changed["bytes"] == first["bytes"]
    single = FileDigests().of(f"s3://{bucket}/data/chats.jsonl")  # one object
    assert single["bytes"] == 9 and single["etags"] not in (first["etags"], changed["etags"])
