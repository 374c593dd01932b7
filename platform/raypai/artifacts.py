"""Artifact store: immutable, content-addressed folders over any pyarrow filesystem.

    store = ArtifactStore("/data/artifacts")            # or "s3://bucket/prefix"
    art = store.put_dir("out/", kind="dataset", name="clean")
    store.open_artifact(art)                             # folder with the files (remote ones cached)
    store.verify(art)                                    # [] when every file still holds what was saved

Layout: `<root>/<kind>/<digest>/...files` plus a `_RAYPAI_COMMITTED.json` marker written last,
recording each file's size and sha256 (raypai.integrity). A folder without the marker is
invisible. On local disks the files are copied into a staging folder, each hashed as it is
written and compared with the digest computed before, fsynced with their folders, and renamed
into place: after a crash an artifact is either whole or absent. A committed artifact whose
files' sizes differ from the marker is damaged: never a cache hit, refused on read, replaced by
the next save of the same content. Downloads are hashed and compared with the recorded digest.
The digest is sha256 over the sorted relative paths and each file's sha256, so the same content
has the same digest on any machine.
"""

from __future__ import annotations

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
from raypai.integrity import (
    CHUNK,
    CorruptArtifact,
    check_digest,
    content_problems,
    copy_hashing,
    digest_of,
    fsync_dir,
    fsync_tree,
    hash_stream,
    join_key,
    marker_problems,
    safe_key,
)

MARKER = "_RAYPAI_COMMITTED.json"
KINDS = ("source", "dataset", "tokenizer", "token_shards", "model", "checkpoint", "report", "deployment", "value")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHUNK = CHUNK


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
        `$RAYPAI_HOME/cache`); without one, into the user cache (`default_cache_dir("artifacts")`),
        and its files' digest is checked against the record. Content-addressed by digest, so any
        cache folder is safe to share. A committed folder whose files' sizes differ from its marker
        raises CorruptArtifact naming the file."""
        if _is_local(self.uri):
            path = Path(_local(self.uri))
            problems = committed_problems(path)
            if problems:
                raise CorruptArtifact(self._where(), problems, self._fix())
            return path
        target = Path(cache_dir or default_cache_dir("artifacts")) / check_digest(self.digest)
        if (target / MARKER).exists():
            if not committed_problems(target):
                return target
            _discard(target)  # a damaged cached copy is only a cache: download it again
        fs, path = pafs.FileSystem.from_uri(self.uri)
        tmp = target.parent / f".{self.digest}.{uuid.uuid4().hex[:8]}"
        try:
            _download(fs, path, tmp, self)
            try:
                tmp.rename(target)
            except OSError:  # another process won the race; its copy was verified as this one was
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target

    def _where(self) -> str:
        return f"artifact {self.name} ({self.kind} {self.digest[:12]}) at {self.uri}"

    def _fix(self) -> str:
        return (
            "It is not used: run the step that made it again (its next save replaces the damaged copy), "
            f"and check it with `raypai verify {self.id}`"
        )

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
    with open(path, "rb") as f:
        return hash_stream(f)[0]


def _entries(path: Path) -> list[tuple[str, Path, int, str]]:
    """(relative path, absolute path, size, sha256) of every file of a folder."""
    return [(rel, p, p.stat().st_size, _file_sha(p)) for rel, p in _walk(path)]


def digest_dir(path: str | Path) -> tuple[str, int]:
    """(sha256 digest, total bytes) of a folder's files, independent of machine and mtime."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or folder; check the path")
    entries = _entries(path)
    return digest_of([(rel, sha) for rel, _p, _n, sha in entries]), sum(n for _r, _p, n, _s in entries)


def read_marker(path: str | Path) -> dict | None:
    """The commit marker of a local artifact folder, or None when it has none."""
    try:
        return json.loads((Path(path) / MARKER).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"damaged_marker": True}


def committed_problems(path: Path) -> list[str]:
    """What is wrong with a committed local folder's files against its marker (sizes only: cheap
    enough for every cache hit and read); [] for a whole one, and for anything without a marker
    (a raw source file or folder, checked by digest where it is used)."""
    if not path.is_dir():
        return []
    marker = read_marker(path)
    if marker is None:
        return []
    if marker.get("damaged_marker"):
        return [f"its commit marker {MARKER} cannot be read"]
    return marker_problems(marker, {rel: p.stat().st_size for rel, p in _walk(path)})


def _discard(path: Path) -> None:
    """Move a folder out of the way (one rename, so readers never see it half-deleted), then delete it."""
    aside = path.parent / f".discarded-{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _download(fs: pafs.FileSystem, src: str, dst: Path, art: Artifact) -> None:
    """Copy a remote artifact folder into `dst`, hashing each object as it is written; refuse
    (CorruptArtifact naming the file) when the files' digest is not the recorded one."""
    dst.mkdir(parents=True, exist_ok=True)
    remote_marker = None
    files: dict[str, list] = {}
    root = src.rstrip("/")
    for info in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
        if info.type != pafs.FileType.File:
            continue
        rel = safe_key(info.path[len(root) + 1 :])  # a listing must not lead outside dst
        if rel == MARKER:
            try:
                with fs.open_input_stream(info.path) as fin:
                    remote_marker = json.loads(fin.read().decode())
            except ValueError:
                remote_marker = None  # only used to name the file that differs
            continue
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(info.path) as fin, open(out, "wb") as fout:
            sha, n = copy_hashing(fin, fout)
        files[rel] = [n, sha]
    got = digest_of([(rel, e[1]) for rel, e in files.items()])
    if got != art.digest:
        named = content_problems((remote_marker or {}).get("files"), {r: tuple(e) for r, e in files.items()})
        raise CorruptArtifact(
            art._where(),
            named or [f"its files' digest is {got[:12]}…, {art.digest[:12]}… was recorded"],
            "The download was discarded: save it again from its source (re-run the step that made it)",
        )
    marker = {
        "digest": got,
        "size_bytes": sum(e[0] for e in files.values()),
        "files": files,
        "verified_at": time.time(),
    }
    (dst / MARKER).write_text(json.dumps(marker))


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

    def _fs_path(self, uri: str) -> tuple[pafs.FileSystem, str]:
        return (self.fs, _local(uri)) if _is_local(uri) else pafs.FileSystem.from_uri(uri)

    def exists(self, uri: str) -> bool:
        fs, path = self._fs_path(uri)
        return fs.get_file_info(f"{path.rstrip('/')}/{MARKER}").type == pafs.FileType.File or (
            _is_local(uri) and Path(uri).exists() and not Path(uri).is_dir()
        )

    def problems(self, uri: str) -> list[str]:
        """[] when the artifact at `uri` is committed and each file has the size its marker records
        (what a cache hit requires), else what is wrong, naming the files. One listing on S3."""
        fs, path = self._fs_path(uri)
        if _is_local(uri) and Path(path).is_file():
            return []  # a single-file source, recorded by digest
        return _problems_at(fs, path.rstrip("/"))

    def put_dir(self, local_dir: str | Path, *, kind: str, name: str, metadata: dict | None = None) -> Artifact:
        """Copy a local folder into the store (once per content; a damaged copy is replaced) and
        return its record. Each file is hashed again as it is copied: a file that changes while it
        is saved is refused, and nothing is committed."""
        if kind not in KINDS:
            raise DataError(f"artifact kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
        check_name(name)
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise DataError(f"{local_dir}: not a folder; a step must save a folder of files as an artifact")
        entries = _entries(local_dir)
        digest = digest_of([(rel, sha) for rel, _p, _n, sha in entries])
        size = sum(n for _r, _p, n, _s in entries)
        final = join_key(self.root, f"{kind}/{digest}")
        files = {rel: [n, sha] for rel, _p, n, sha in entries}
        marker = {"kind": kind, "digest": digest, "size_bytes": size, "committed_at": time.time(), "files": files}
        if _problems_at(self.fs, final):  # absent, or committed but damaged: write it
            try:
                if isinstance(self.fs, pafs.LocalFileSystem):
                    self._put_local(entries, final, marker)
                else:
                    self._put_remote(entries, final, marker)
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

    def _put_local(self, entries: list, final: str, marker: dict) -> None:
        staging = Path(self.root) / ".staging" / uuid.uuid4().hex
        staging.parent.mkdir(parents=True, exist_ok=True)
        replaced = staging.parent / f"{staging.name}-replaced"
        try:
            for rel, src, size, sha in entries:
                out = staging / safe_key(rel)
                out.parent.mkdir(parents=True, exist_ok=True)
                with open(src, "rb") as fin, open(out, "wb") as fout:
                    got = copy_hashing(fin, fout)
                    fout.flush()
                    os.fsync(fout.fileno())
                _same_as_digested(src, got, (sha, size))
            with open(staging / MARKER, "w") as f:
                f.write(json.dumps(marker))
                f.flush()
                os.fsync(f.fileno())
            fsync_tree(staging)  # the files' names are durable before the rename makes them visible
            parent = Path(final).parent
            parent.mkdir(parents=True, exist_ok=True)
            fsync_dir(parent.parent)
            try:
                os.rename(staging, final)  # atomic on one filesystem
            except OSError:
                if not committed_problems(Path(final)) and (Path(final) / MARKER).exists():
                    return  # lost a race to a whole copy of identical content
                os.rename(final, replaced)  # a damaged or uncommitted folder: out of the way, then ours in
                os.rename(staging, final)
            fsync_dir(parent)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(replaced, ignore_errors=True)

    def _put_remote(self, entries: list, final: str, marker: dict) -> None:
        marker_key = f"{final}/{MARKER}"
        if self.fs.get_file_info(marker_key).type == pafs.FileType.File:
            self.fs.delete_file(marker_key)  # a damaged copy: invisible while it is written again
        for rel, src, size, sha in entries:
            with open(src, "rb") as fin, self.fs.open_output_stream(join_key(final, rel)) as fout:
                got = copy_hashing(fin, fout)
            _same_as_digested(src, got, (sha, size))
        with self.fs.open_output_stream(marker_key) as fout:  # last: makes it visible
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

    def verify(self, artifact: Artifact) -> list[str]:
        """Read and hash every file of `artifact` again (local or remote, nothing downloaded to
        disk): [] when they hold the recorded digest, else what differs, naming each file whose
        sha256 or size is not the one its commit marker records."""
        fs, path = self._fs_path(artifact.uri)
        path = path.rstrip("/")
        if _is_local(artifact.uri) and not Path(path).exists():
            return [f"{path} is gone"]
        if _is_local(artifact.uri) and Path(path).is_file():
            got = digest_dir(path)[0]
            return [] if got == artifact.digest else [f"{Path(path).name} differs from what was recorded"]
        actual: dict[str, tuple[int, str]] = {}
        marker = None
        for info in fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True)):
            if info.type != pafs.FileType.File:
                continue
            rel = info.path[len(path) + 1 :]
            with fs.open_input_stream(info.path) as fin:
                if rel == MARKER:
                    marker = json.loads(fin.read().decode() or "{}")
                else:
                    sha, n = hash_stream(fin)
                    actual[rel] = (n, sha)
        if not actual and marker is None:
            return [f"{artifact.uri} is gone"]
        got = digest_of([(rel, sha) for rel, (_n, sha) in actual.items()])
        if got == artifact.digest:
            return []
        named = content_problems((marker or {}).get("files"), actual)
        if artifact.kind == "source" and marker is None:
            recorded = set(artifact.metadata.get("files") or [])
            named = [f"{r} is missing" for r in sorted(recorded - set(actual))]
            named += [f"{r} was not recorded" for r in sorted(set(actual) - recorded) if recorded]
        return named or [f"its files' digest is {got[:12]}…, {artifact.digest[:12]}… was recorded"]


def _problems_at(fs: pafs.FileSystem, path: str) -> list[str]:
    """ArtifactStore.problems for a folder `path` of `fs`: one listing and the marker."""
    listing = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    sizes = {i.path[len(path) + 1 :]: i.size for i in listing if i.type == pafs.FileType.File}
    if MARKER not in sizes:
        return ["it is gone from the artifact store" if not sizes else "it was never committed (no marker)"]
    sizes.pop(MARKER)
    try:
        with fs.open_input_stream(f"{path}/{MARKER}") as f:
            marker = json.loads(f.read().decode())
    except (OSError, ValueError):
        return [f"its commit marker {MARKER} cannot be read"]
    return marker_problems(marker, sizes)


def _same_as_digested(src: Path, got: tuple[str, int], expected: tuple[str, int]) -> None:
    """The copy just written must hold what the digest was computed from."""
    if got != expected:
        raise StoreError(
            f"{src} changed while it was being saved (sha256 {expected[0][:12]}… and {expected[1]} bytes when "
            f"digested, {got[0][:12]}… and {got[1]} bytes when copied). Nothing was committed; save it "
            "again once nothing writes to it"
        )


def _safe(name: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip("._-") or "input"
    return cleaned[:128]
