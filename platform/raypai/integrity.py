"""What raypai checks about the files of an artifact, so that none can be half-written or swapped:

    key = join_key(root, "shards/part-0.parquet")    # refuses "..", "/abs", "a//b" before any I/O
    sha, n = copy_hashing(fin, fout)                   # the copy is hashed as it is written
    size_problems(marker["files"], {"a.txt": 3})       # ["a.txt is 3 bytes, 5 were recorded"]

The commit marker of an artifact (`_RAYPAI_COMMITTED.json`, written last) records each file's
size and sha256 (`files`: {relative path: [size, sha256]}): the size is checked on every cache hit
and every read, the sha256 by a download and by `raypai verify`. Markers written before the
per-file record carry only the total size, which is what is checked for them.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from raypai.errors import DataError, StoreError

CHUNK = 8 << 20  # 8 MiB: large enough that S3 writes go multipart, small enough for memory
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


class CorruptArtifact(StoreError):
    """An artifact whose files are not the ones recorded when it was committed (truncated, missing,
    extra or changed): it is never served as a cache hit nor handed to a step."""

    def __init__(self, where: str, problems: list[str], fix: str):
        self.where, self.problems = where, list(problems)
        shown = "; ".join(self.problems[:5]) + (f"; {len(self.problems) - 5} more" if len(self.problems) > 5 else "")
        super().__init__(f"{where} is damaged: {shown}. {fix}")


def safe_key(rel: str) -> str:
    """A relative key inside an artifact (a file's path below its folder, an S3 key suffix) as
    posix text, refused when it could name anything outside: absolute, '..', '.', empty parts, a
    backslash or a drive letter."""
    text = str(rel)
    parts = text.split("/")
    if (
        not text
        or text.startswith("/")
        or "\\" in text
        or "\0" in text
        or re.match(r"^[A-Za-z]:", text)
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise DataError(
            f"key {text!r} is not allowed inside an artifact: it must be a relative path without '..', "
            "'.', empty parts or a leading '/' (a file name or a listing that tries to leave its folder)"
        )
    return text


def join_key(root: str, rel: str) -> str:
    """`root/rel` for a filesystem path or an object-store key, with `rel` checked by `safe_key`."""
    return f"{root.rstrip('/')}/{safe_key(rel)}"


def check_digest(digest: str) -> str:
    """A digest names folders (the store's `<kind>/<digest>`, caches): only 64 lowercase hex digits."""
    if not _DIGEST_RE.match(digest or ""):
        raise DataError(f"digest {digest!r} is not a sha256 (64 lowercase hex digits); the record is damaged")
    return digest


def digest_of(shas: list[tuple[str, str]]) -> str:
    """The artifact digest: sha256 over the sorted (relative path, file sha256) pairs."""
    h = hashlib.sha256()
    for rel, sha in sorted(shas):
        h.update(rel.encode() + b"\0" + sha.encode() + b"\n")
    return h.hexdigest()


def copy_hashing(fin, fout) -> tuple[str, int]:
    """Copy the stream `fin` into `fout` (both binary file-likes), hashing what is written: (sha256, bytes)."""
    h, n = hashlib.sha256(), 0
    while chunk := fin.read(CHUNK):
        fout.write(chunk)
        h.update(chunk)
        n += len(chunk)
    return h.hexdigest(), n


def hash_stream(fin) -> tuple[str, int]:
    """(sha256, bytes) of a binary stream read to its end."""
    h, n = hashlib.sha256(), 0
    while chunk := fin.read(CHUNK):
        h.update(chunk)
        n += len(chunk)
    return h.hexdigest(), n


def fsync_dir(path: str | Path) -> None:
    """Make a folder's entries (names created or renamed in it) durable. A no-op where folders
    cannot be opened (Windows)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory; the files themselves are synced
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every folder under `root` (deepest first) and `root` itself."""
    for dirpath, _dirs, _files in sorted(os.walk(root), key=lambda t: -len(t[0])):
        fsync_dir(dirpath)


def size_problems(recorded: dict, actual: dict[str, int]) -> list[str]:
    """Each file whose size differs from the marker's record, is missing, or was not recorded."""
    problems = []
    for rel, entry in sorted(recorded.items()):
        size = entry[0]
        if rel not in actual:
            problems.append(f"{rel} is missing ({size} bytes were recorded)")
        elif actual[rel] != size:
            problems.append(f"{rel} is {actual[rel]} bytes, {size} were recorded")
    problems += [f"{rel} was not recorded ({actual[rel]} bytes)" for rel in sorted(set(actual) - set(recorded))]
    return problems


def marker_problems(marker: dict, actual: dict[str, int]) -> list[str]:
    """What is wrong with the sizes of `actual` files against a commit marker (per file when the
    marker records them, else the total)."""
    if isinstance(marker.get("files"), dict):
        return size_problems(marker["files"], actual)
    total, recorded = sum(actual.values()), marker.get("size_bytes")
    if recorded is not None and total != recorded:
        return [f"its files hold {total} bytes, {recorded} were recorded"]
    return []


def content_problems(recorded: dict | None, actual: dict[str, tuple[int, str]]) -> list[str]:
    """Each file whose content (sha256) or size differs from the marker's record, by name."""
    if recorded is None:
        return []
    problems = []
    for rel, (size, sha) in sorted(recorded.items()):
        got = actual.get(rel)
        if got is None:
            problems.append(f"{rel} is missing")
        elif got[1] != sha:
            problems.append(
                f"{rel} differs: sha256 {got[1][:12]}… ({got[0]} bytes), {sha[:12]}… ({size} bytes) was recorded"
            )
    problems += [f"{rel} was not recorded" for rel in sorted(set(actual) - set(recorded))]
    return problems


# Files that torch/transformers would unpickle: loading one runs whatever code its author put in it.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def pickle_files(folder: str | Path) -> list[str]:
    """The files under `folder` that hold pickles by their name (pytorch_model.bin, adapter_model.bin,
    training_args.bin, *.pt ...): what `refuse_pickle_weights` refuses."""
    root = Path(folder)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.suffix.lower() in PICKLE_SUFFIXES)


def refuse_pickle_weights(folder: str | Path, where: str) -> None:
    """Only safetensors weights are loaded: a model folder holding pickle files is refused."""
    found = pickle_files(folder)
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise DataError(
            f"{where} holds pickle files ({shown}): raypai loads only safetensors weights, because "
            "unpickling a file runs any code stored in it. Save the model with "
            "`model.save_pretrained(DIR, safe_serialization=True)`, leave out the .bin/.pt files, and "
            "register that folder"
        )


def within(uri: str, root: str) -> bool:
    """Whether `uri` names `root` or something below it (text comparison after dropping `file://`
    and trailing slashes; a '..' part anywhere is never within)."""

    def norm(u: str) -> str:
        u = u[len("file://") :] if u.startswith("file://") else u
        return u.rstrip("/")

    u, r = norm(uri), norm(root)
    if not r or ".." in u.split("/"):
        return False
    return u == r or u.startswith(r + "/")
