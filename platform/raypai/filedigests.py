"""Content digests of the files and folders a step reads, with a fast path for unchanged files.

    digests = FileDigests(settings.home / "cache" / "file_digests.json")
    digests.of("data/chats.jsonl")   # {"path": "/abs/data/chats.jsonl", "sha256": "…", "bytes": 812}
    digests.save()                   # keep the (size, mtime_ns) → sha256 table for the next run

A path's digest is the one the artifact store gives a folder (raypai.artifacts.digest_dir: sha256
over the sorted relative paths and each file's sha256; a single file counts as a folder of one),
so it equals the digest of the source artifact recorded when the step registers the path. Each
file's sha256 is remembered under its absolute path with its size and mtime_ns: a file whose size
and mtime_ns are unchanged is not read again; any change of either re-hashes it. A URI (s3://, gs://)
is read through pyarrow's filesystem listing: relative path, size and mtime of each object.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

from raypai.artifacts import _file_sha, _walk

__all__ = ["FileDigests"]


class FileDigests:
    """A table of file sha256s keyed by (absolute path, size, mtime_ns); `path=None` keeps it in memory."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else None
        self._table: dict[str, list] = {}
        self._dirty = False
        if self.path is not None and self.path.is_file():
            try:
                self._table = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self._table = {}  # a damaged table only costs re-hashing

    def of(self, value: str | Path) -> dict:
        """What of the path `value` enters a cache key: where it is and its content digest."""
        text = str(value)
        if "://" in text and not text.startswith("file://"):
            return _remote(text)
        p = Path(text.removeprefix("file://")).absolute()
        if not p.exists():
            return {"path": str(p), "missing": True}  # the step itself says what is wrong
        h, total = hashlib.sha256(), 0
        for rel, f in _walk(p):
            st = f.stat()
            h.update(f"{rel}\0{self._sha(f, st)}\n".encode())
            total += st.st_size
        return {"path": str(p), "sha256": h.hexdigest(), "bytes": total}

    def _sha(self, f: Path, st: os.stat_result) -> str:
        key = str(f)
        got = self._table.get(key)
        if got and got[0] == st.st_size and got[1] == st.st_mtime_ns:
            return got[2]
        sha = _file_sha(f)  # new, or size/mtime changed: read it
        self._table[key] = [st.st_size, st.st_mtime_ns, sha]
        self._dirty = True
        return sha

    def save(self) -> None:
        """Write the table (atomically: two runs at once lose at most each other's new entries)."""
        if self.path is None or not self._dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(self._table))
        os.replace(tmp, self.path)
        self._dirty = False


def _remote(uri: str) -> dict:
    """A URI's listing digested: a changed object changes it. On S3 (boto3 installed) each object's
    ETag and size: the ETag is S3's own digest of the content (the MD5 of a single-part upload, of
    the parts' MD5s for a multipart one), so a same-size rewrite changes it, without reading the
    objects. Elsewhere (or without boto3) pyarrow's listing: relative path, size and mtime, where an
    object rewritten with the same size within one mtime tick would go unseen."""
    if uri.startswith("s3://"):
        etags = _s3_etags(uri)
        if etags is not None:
            return etags
    import pyarrow.fs as pafs

    try:
        fs, root = pafs.FileSystem.from_uri(uri)
        info = fs.get_file_info(root)
        infos = [info] if info.type == pafs.FileType.File else fs.get_file_info(pafs.FileSelector(root, recursive=True))
    except Exception:  # noqa: BLE001 - unreachable or unknown (fsspec raises its own)
        # the URI text alone keys it; the step, reading it, says what is wrong
        return {"uri": uri, "unlisted": True}
    h, total = hashlib.sha256(), 0
    for i in sorted((i for i in infos if i.type == pafs.FileType.File), key=lambda i: i.path):
        rel = os.path.relpath(i.path, root) if i.path != root else os.path.basename(root)
        mtime = i.mtime_ns if i.mtime_ns is not None else ""
        h.update(f"{rel}\0{i.size}\0{mtime}\n".encode())
        total += i.size or 0
    return {"uri": uri, "listing": h.hexdigest(), "bytes": total}


def _s3_etags(uri: str) -> dict | None:
    """{uri, etags: sha256 over (relative key, size, ETag) of every object under `uri`, bytes}, or
    None where boto3 is missing or the listing fails (the pyarrow listing is tried then). The
    endpoint and credentials come from the environment, as pyarrow's (AWS_ENDPOINT_URL, ...)."""
    try:
        import boto3
    except ImportError:
        return None
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    prefix = prefix.rstrip("/")
    try:
        client = boto3.client("s3")
        objects = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                key = o["Key"]
                if key == prefix or key.startswith(prefix + "/") or not prefix:
                    rel = os.path.basename(key) if key == prefix else key[len(prefix) :].lstrip("/")
                    objects.append((rel, o["Size"], o["ETag"].strip('"')))
    except Exception:  # noqa: BLE001 - unreachable, no credentials: the pyarrow listing says what is wrong
        return None
    if not objects:
        return None
    h, total = hashlib.sha256(), 0
    for rel, size, etag in sorted(objects):
        h.update(f"{rel}\0{size}\0{etag}\n".encode())
        total += size
    return {"uri": uri, "etags": h.hexdigest(), "bytes": total}
