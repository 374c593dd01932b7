import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raypai.artifacts import MARKER, ArtifactStore, digest_dir
from raypai.errors import DataError, StoreError


def _make(folder: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        p = folder / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return folder


def test_digest_depends_on_content_and_names_only(tmp_path):
    a = _make(tmp_path / "a", {"x.txt": b"hello", "sub/y.bin": b"\x00\x01"})
    b = _make(tmp_path / "b", {"sub/y.bin": b"\x00\x01", "x.txt": b"hello"})  # other creation order
    os.utime(b / "x.txt", (1, 1))  # other mtime
    assert digest_dir(a) == digest_dir(b)
    (b / "x.txt").write_bytes(b"hellO")
    assert digest_dir(a)[0] != digest_dir(b)[0]
    assert digest_dir(a)[1] == 7


def test_put_is_content_addressed_and_write_once(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    src = _make(tmp_path / "src", {"data.txt": b"abc" * 100})
    a1 = store.put_dir(src, kind="dataset", name="d1", metadata={"rows": 3})
    a2 = store.put_dir(src, kind="dataset", name="d2")
    assert a1.digest == a2.digest and a1.uri == a2.uri and a1.id != a2.id
    assert (Path(a1.uri) / "data.txt").read_bytes() == b"abc" * 100
    assert (Path(a1.uri) / MARKER).exists() and store.exists(a1.uri)
    assert a1.local_path() == Path(a1.uri)


@pytest.mark.parametrize("name", ["../escape", "a/b", "", ".hidden", "x" * 200])
def test_unsafe_names_are_refused(tmp_path, name):
    store = ArtifactStore(str(tmp_path / "store"))
    src = _make(tmp_path / "src", {"f": b"1"})
    with pytest.raises(DataError, match="not allowed"):
        store.put_dir(src, kind="dataset", name=name)


def test_symlink_escaping_the_folder_is_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not ship")
    src = _make(tmp_path / "src", {"ok.txt": b"1"})
    (src / "link").symlink_to(secret)
    with pytest.raises(DataError, match="outside the artifact folder"):
        ArtifactStore(str(tmp_path / "store")).put_dir(src, kind="dataset", name="x")


def test_unknown_kind_and_missing_folder_are_clear_errors(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    with pytest.raises(DataError, match="kind 'weights' is unknown"):
        store.put_dir(tmp_path, kind="weights", name="x")
    with pytest.raises(DataError, match="not a folder"):
        store.put_dir(tmp_path / "nope", kind="dataset", name="x")


def test_a_killed_writer_leaves_no_visible_artifact(tmp_path):
    """Kill a process mid-copy of a 300 MB folder: the final folder must not appear."""
    src = tmp_path / "big"
    src.mkdir()
    block = os.urandom(1 << 20)
    for i in range(300):
        (src / f"part-{i:04d}.bin").write_bytes(block)
    root = tmp_path / "store"
    code = (
        f"from raypai.artifacts import ArtifactStore;"
        f"ArtifactStore({str(root)!r}).put_dir({str(src)!r}, kind='dataset', name='big')"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    staging = root / ".staging"
    deadline = time.time() + 60
    while time.time() < deadline and not (staging.exists() and any(staging.rglob("part-0005.bin"))):
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    digest, _ = digest_dir(src)
    final = root / "dataset" / digest
    assert not final.exists(), "a half-written artifact became visible"
    store = ArtifactStore(str(root))
    assert not store.exists(str(final))
    art = store.put_dir(src, kind="dataset", name="big")  # a retry completes it
    assert store.exists(art.uri) and len(list(Path(art.uri).glob("part-*.bin"))) == 300


def test_register_external_records_sources_without_copying(tmp_path):
    src = _make(tmp_path / "raw", {"a.jsonl": b'{"text": "x"}\n', "b.jsonl": b'{"text": "y"}\n'})
    art = ArtifactStore(str(tmp_path / "store")).register_external(src)
    assert art.kind == "source" and art.uri == str(src) and art.metadata["num_files"] == 2
    assert not (tmp_path / "store" / "source").exists()
    with pytest.raises(DataError, match="no such file"):
        ArtifactStore(str(tmp_path / "store")).register_external(tmp_path / "missing")


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def test_a_truncated_file_under_a_committed_artifact_is_refused_on_read_and_replaced_by_the_next_save(tmp_path):
    """A crash that lost the tail of a file after its marker was written (no fsync) must not leave an
    artifact that reads as whole: the size check names the file, a read refuses it, a save of the same
    content writes it again."""
    from raypai.artifacts import CorruptArtifact

    store = ArtifactStore(str(tmp_path / "store"))
    src = _make(tmp_path / "src", {"a.txt": b"x" * 1000, "sub/b.txt": b"y" * 10})
    art = store.put_dir(src, kind="dataset", name="d")
    assert store.problems(art.uri) == [] and store.open_artifact(art) == Path(art.uri)

    _truncate(Path(art.uri) / "a.txt", 100)
    assert store.problems(art.uri) == ["a.txt is 100 bytes, 1000 were recorded"]
    with pytest.raises(CorruptArtifact, match="a.txt is 100 bytes, 1000 were recorded"):
        store.open_artifact(art)
    (Path(art.uri) / "sub" / "b.txt").unlink()
    (Path(art.uri) / "extra.txt").write_text("?")
    assert store.problems(art.uri) == [
        "a.txt is 100 bytes, 1000 were recorded",
        "sub/b.txt is missing (10 bytes were recorded)",
        "extra.txt was not recorded (1 bytes)",
    ]

    again = store.put_dir(src, kind="dataset", name="d")
    assert again.uri == art.uri and store.problems(art.uri) == []
    assert (Path(art.uri) / "a.txt").read_bytes() == b"x" * 1000 and not (Path(art.uri) / "extra.txt").exists()
    assert not list((tmp_path / "store" / ".staging").iterdir())  # the damaged copy is gone too


def test_verify_hashes_every_file_and_names_the_one_that_differs(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    art = store.put_dir(_make(tmp_path / "src", {"a.txt": b"x" * 50, "sub/b.txt": b"y" * 10}), kind="dataset", name="d")
    assert store.verify(art) == []
    (Path(art.uri) / "sub" / "b.txt").write_bytes(b"z" * 10)  # same size: only the digest sees it
    assert store.problems(art.uri) == []
    problems = store.verify(art)
    assert len(problems) == 1 and problems[0].startswith("sub/b.txt differs: sha256 "), problems
    (Path(art.uri) / "sub" / "b.txt").write_bytes(b"y" * 10)
    assert store.verify(art) == []


def test_a_file_that_changes_while_it_is_saved_is_refused_and_nothing_is_committed(tmp_path, monkeypatch):
    """The copy is hashed as it is written and compared with the digest taken before: a writer that
    changes a file between the two (here: right after the digest pass) cannot commit a folder whose
    digest names other content."""
    import raypai.artifacts as A

    src = _make(tmp_path / "src", {"a.txt": b"before", "b.txt": b"same"})
    digest_pass = A._entries

    def digest_then_a_writer_edits(path):
        out = digest_pass(path)
        (src / "a.txt").write_bytes(b"after!")  # same size: only the hash can tell
        return out

    monkeypatch.setattr(A, "_entries", digest_then_a_writer_edits)
    with pytest.raises(StoreError, match=r"a.txt changed while it was being saved.*Nothing was committed"):
        ArtifactStore(str(tmp_path / "store")).put_dir(src, kind="dataset", name="d")
    assert not list((tmp_path / "store").rglob(MARKER))


def test_files_and_folders_are_fsynced_before_the_rename_that_commits(tmp_path, monkeypatch):
    """Every file (with the marker) and every folder of the staging copy is fsynced before the rename
    makes it visible, and the folder holding it after: a crash leaves it whole or absent."""
    store = ArtifactStore(str(tmp_path / "store"))
    src = _make(tmp_path / "src", {"a.txt": b"1", "sub/b.txt": b"2"})
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(a, b):
        events.append(("rename", str(a)))
        return real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    art = store.put_dir(src, kind="dataset", name="d")
    commit = [i for i, (what, _p) in enumerate(events) if what == "rename"]
    assert len(commit) == 1
    staging = Path(events[commit[0]][1])
    before = {p for what, p in events[: commit[0]] if what == "fsync"}
    expected = {staging / "a.txt", staging / "sub" / "b.txt", staging / MARKER, staging, staging / "sub"}
    assert {str(p) for p in expected} <= before, before
    assert ("fsync", str(Path(art.uri).parent)) in events[commit[0] :]


def test_a_record_whose_digest_is_no_sha256_cannot_name_a_cache_folder(tmp_path):
    from raypai.artifacts import Artifact

    art = Artifact("x", "dataset", "d", "s3://bucket/prefix/dataset/abc", "../../../etc", 1)
    with pytest.raises(DataError, match="is not a sha256"):
        art.local_path(tmp_path / "cache")


@pytest.mark.parametrize("key", ["../x", "a/../../x", "/etc/passwd", "a//b", "./a", "a/.", "C:/x", "a\\..\\b", ""])
def test_keys_that_could_leave_an_artifact_folder_are_refused(key):
    from raypai.integrity import join_key

    with pytest.raises(DataError, match="not allowed inside an artifact"):
        join_key("bucket/prefix/dataset/" + "0" * 64, key)
    assert join_key("bucket/p/", "shards/part-0.parquet") == "bucket/p/shards/part-0.parquet"
