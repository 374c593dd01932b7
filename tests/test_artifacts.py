import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raypai.artifacts import MARKER, ArtifactStore, digest_dir
from raypai.errors import DataError


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
