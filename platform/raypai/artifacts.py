"""Artifact store: immutable, content-addressed folders over any pyarrow filesystem.

    store = ArtifactStore("/data/artifacts")            # or "s3://bucket/prefix"
    art = store.put_dir("out/", kind="dataset", name="clean")
    store.open_artifact(art)                             # folder with the files (remote ones cached)

Layout: `<root>/<kind>/<digest>/...files` plus a `_RAYPAI_COMMITTED.json` marker written last.
A folder without the marker is invisible (a crash mid-write leaves no half artifact); on local
disks the files are also staged and renamed into place. The digest is sha256 over the sorted
relative paths and each file's sha256, so the same content has the same digest on any machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs

from raypai.errors import DataError, NotFoundError, StoreError

MARKER = "_RAYPAI_COMMITTED.json"
KINDS = ("source", "dataset", "tokenizer", "token_shards", "model", "checkpoint", "report", "deployment", "value")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHUNK = 8 << 20  # 8 MiB: large enough that S3 writes go multipart, small enough for memory


def default_cache_dir(kind: str) -> Path:
    """Where downloads go when the caller names no cache folder: `$XDG_CACHE_HOME/raypai/<kind>`
    (`~/.cache/raypai/<kind>`). Library code never reads raypai's Settings; entry points pass
    `settings.home / "cache"` where they want the cache under RAYPAI_HOME."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "raypai" / kind


@dataclass(frozen=True)
class Artifact:
    """A record of one immutable output. Travels between steps; the files stay in the store."""

    id: str
    kind: str
    name: str
    uri: str
    digest: str
    size_bytes: int
    metadata: dict = field(default_factory=dict)
    producer_step_run_id: str | None = None

    def local_path(self, cache_dir: str | Path | None = None) -> Path:
        """A local folder (or file, for a single-file source) holding this artifact's content. A
        remote artifact is downloaded into `cache_dir` (`ArtifactStore.open_artifact` passes the store's,
        `$RAYPAI_HOME/cache`); without one, into the user cache (`default_cache_dir("artifacts")`).
        Content-addressed by digest, so any cache folder is safe to share."""
        if _is_local(self.uri):
            return Path(_local(self.uri))
        if cache_dir is None:
            cache_dir = default_cache_dir("artifacts")
        target = Path(cache_dir) / self.digest
        if (target / MARKER).exists():
            return target
        fs, path = pafs.FileSystem.from_uri(self.uri)
        tmp = Path(cache_dir) / f".{self.digest}.{uuid.uuid4().hex[:8]}"
        _download(fs, path, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
        return target

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Artifact":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def _is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def _local(uri: str) -> str:
    return urlparse(uri).path if uri.startswith("file://") else uri


def check_name(name: str) -> str:
    """Artifact names end up in paths: refuse anything that could escape the store."""
    if not _NAME_RE.match(name or ""):
        raise DataError(
            f"artifact name {name!r} is not allowed: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (no '/', no '..')"
        )
    return name


def _walk(root: Path) -> list[tuple[str, Path]]:
    """(relative posix path, absolute path) of every file under root, sorted; refuses escapes."""
    root = root.resolve()
    if root.is_file():
        return [(root.name, root)]
    files = []
    for dirpath, _dirs, names in os.walk(root, followlinks=False):
        for n in names:
            p = Path(dirpath) / n
            rel = p.relative_to(root).as_posix()
            if p.is_symlink() and not p.resolve().is_relative_to(root):
                raise DataError(f"{p}: symlink points outside the artifact folder {root}; copy the file in instead")
            if n == MARKER:
                continue
            files.append((rel, p))
    return sorted(files)


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def digest_dir(path: str | Path) -> tuple[str, int]:
    """(sha256 digest, total bytes) of a folder's files, independent of machine and mtime."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or folder; check the path")
    h = hashlib.sha256()
    total = 0
    for rel, p in _walk(path):
        h.update(rel.encode() + b"\0" + _file_sha(p).encode() + b"\n")
        total += p.stat().st_size
    return h.hexdigest(), total


def _download(fs: pafs.FileSystem, src: str, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for info in fs.get_file_info(pafs.FileSelector(src, recursive=True)):
        if info.type != pafs.FileType.File:
            continue
        rel = info.path[len(src.rstrip("/")) + 1 :]
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(info.path) as fin, open(out, "wb") as fout:
            while chunk := fin.read(_CHUNK):
                fout.write(chunk)


class ArtifactStore:
    """Write-once, content-addressed artifact folders under one root URI."""

    def __init__(self, root_uri: str, cache_dir: str | Path | None = None):
        self.root_uri = root_uri.rstrip("/")
        self.cache_dir = Path(cache_dir) if cache_dir else None
        try:
            if _is_local(self.root_uri):
                Path(_local(self.root_uri)).mkdir(parents=True, exist_ok=True)
                self.fs, self.root = pafs.LocalFileSystem(), str(Path(_local(self.root_uri)).absolute())
            else:
                self.fs, self.root = pafs.FileSystem.from_uri(self.root_uri)
        except (OSError, ValueError) as exc:
            raise StoreError(
                f"artifact store {root_uri!r} cannot be opened ({exc}); check RAYPAI_ARTIFACT_URI "
                "and, for s3://, AWS_ENDPOINT_URL and credentials"
            ) from exc

    def _uri(self, path: str) -> str:
        if _is_local(self.root_uri):
            return path
        scheme = urlparse(self.root_uri).scheme
        return f"{scheme}://{path}"

    def exists(self, uri: str) -> bool:
        fs, path = (self.fs, uri) if _is_local(uri) else pafs.FileSystem.from_uri(uri)
        return fs.get_file_info(f"{path.rstrip('/')}/{MARKER}").type == pafs.FileType.File or (
            _is_local(uri) and Path(uri).exists() and not Path(uri).is_dir()
        )

    def put_dir(self, local_dir: str | Path, *, kind: str, name: str, metadata: dict | None = None) -> Artifact:
        """Copy a local folder into the store (once per content) and return its record."""
        if kind not in KINDS:
            raise DataError(f"artifact kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
        check_name(name)
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise DataError(f"{local_dir}: not a folder; a step must save a folder of files as an artifact")
        digest, size = digest_dir(local_dir)
        final = f"{self.root}/{kind}/{digest}"
        marker = {"kind": kind, "digest": digest, "size_bytes": size, "committed_at": time.time()}
        if self.fs.get_file_info(f"{final}/{MARKER}").type != pafs.FileType.File:
            try:
                if isinstance(self.fs, pafs.LocalFileSystem):
                    self._put_local(local_dir, final, marker)
                else:
                    self._put_remote(local_dir, final, marker)
            except OSError as exc:
                raise StoreError(
                    f"writing artifact {name!r} ({kind}) to {self.root_uri} failed: {exc}. Nothing was "
                    "committed; retry once the store is reachable"
                ) from exc
        return Artifact(
            id=uuid.uuid4().hex,
            kind=kind,
            name=name,
            uri=self._uri(final),
            digest=digest,
            size_bytes=size,
            metadata=dict(metadata or {}),
        )

    def _put_local(self, src: Path, final: str, marker: dict) -> None:
        staging = Path(self.root) / ".staging" / uuid.uuid4().hex
        staging.parent.mkdir(parents=True, exist_ok=True)
        try:
            for rel, p in _walk(src):
                out = staging / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, out)
            (staging / MARKER).write_text(json.dumps(marker))
            Path(final).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(staging, final)  # atomic on one filesystem
            except OSError:
                if not (Path(final) / MARKER).exists():  # not a lost race with identical content
                    shutil.rmtree(final, ignore_errors=True)
                    os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _put_remote(self, src: Path, final: str, marker: dict) -> None:
        for rel, p in _walk(src):
            with open(p, "rb") as fin, self.fs.open_output_stream(f"{final}/{rel}") as fout:
                while chunk := fin.read(_CHUNK):
                    fout.write(chunk)
        with self.fs.open_output_stream(f"{final}/{MARKER}") as fout:  # last: makes it visible
            fout.write(json.dumps(marker).encode())

    def register_external(
        self, path: str | Path, *, kind: str = "source", name: str | None = None, metadata: dict | None = None
    ) -> Artifact:
        """Record raw inputs (a file or folder) by digest without copying them."""
        p = Path(path).absolute()
        if not p.exists():
            raise DataError(f"input {path}: no such file or folder; pass an existing path")
        digest, size = digest_dir(p)
        files = [rel for rel, _ in _walk(p)]
        meta = {"files": files[:1000], "num_files": len(files), **(metadata or {})}
        return Artifact(uuid.uuid4().hex, kind, check_name(name or _safe(p.name)), str(p), digest, size, meta)

    def open_artifact(self, artifact: Artifact) -> Path:
        if not _is_local(artifact.uri) and not self.exists(artifact.uri):
            raise NotFoundError(f"artifact {artifact.name} ({artifact.digest[:12]}) is missing from {self.root_uri}")
        return artifact.local_path(self.cache_dir)


def _safe(name: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip("._-") or "input"
    return cleaned[:128]
