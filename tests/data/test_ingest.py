"""Ingest: formats, stable ids and sources, every malformed row in `rejected` with its reason."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypai.data.ingest import IngestConfig, doc_id, ingest


def test_formats_sources_and_rejected_reasons(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_bytes(
        b'{"text": "fine"}\n{"text": "broken\n{"body": 1}\n{"text": 7}\n'
        b'{"text": "bad \xff"}\n\n{"text": "' + b"x" * 50 + b'"}\n'
    )
    (raw / "b.txt").write_bytes(b"First para\r\nline two\r\n\r\n\r\nSecond para\r\n")  # CRLF: universal newlines
    pq.write_table(pa.table({"text": ["row zero", None]}), raw / "c.parquet")
    m = ingest(raw, tmp_path / "out", IngestConfig(max_chars=40))
    rows = pq.read_table(tmp_path / "out" / "part-00001-00000.parquet").to_pylist()
    assert [(r["source"], r["text"]) for r in rows] == [("b.txt:1", "First para\nline two"), ("b.txt:5", "Second para")]
    assert rows[0]["doc_id"] == doc_id("b.txt:1")  # from the source alone: the same on every machine
    rejected = {r["source"]: r["reason"] for r in pq.read_table(tmp_path / "out" / "rejected.parquet").to_pylist()}
    assert rejected.keys() == {"a.jsonl:2", "a.jsonl:3", "a.jsonl:4", "a.jsonl:5", "a.jsonl:7", "c.parquet:row1"}
    assert rejected["a.jsonl:2"].startswith("broken JSON") and "missing field" in rejected["a.jsonl:3"]
    assert "not a string" in rejected["a.jsonl:4"] and "invalid UTF-8" in rejected["a.jsonl:5"]
    assert rejected["a.jsonl:7"].startswith("oversize") and "not a string" in rejected["c.parquet:row1"]
    assert m["rows"] == 4 and m["rejected"] == 6  # "fine", two paragraphs, "row zero"
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["files"] == ["a.jsonl", "b.txt", "c.parquet"]
    one = ingest(raw / "b.txt", tmp_path / "one", IngestConfig(text_mode="file"))
    assert (
        one["rows"] == 1
        and pq.read_table(tmp_path / "one" / "part-00000-00000.parquet").column("text")[0].as_py()
        == "First para\nline two\n\n\nSecond para\n"
    )


def _mixed_corpus(raw):
    """Files whose every kind of boundary a range cut can land on: JSONL with blank, broken,
    non-UTF-8 and over-long lines; text with CRLF, runs of blank lines, lines of only spaces, CR or
    a no-break space, a paragraph longer than a range; Parquet of many row groups; a text file with
    a bad byte past its first range (the whole file is one rejection)."""
    raw.mkdir()
    lines = [b'{"text": "doc %d %s"}' % (i, b"y" * (i * 7 % 40)) for i in range(40)]
    lines[5], lines[9], lines[13] = b'{"text": "broken', b"", b'{"text": "bad \xff"}'
    lines[20] = b'{"text": "' + b"long " * 30 + b'"}'
    (raw / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    paras = [f"para {i} first line\r\nsecond line {'z' * (i % 5)}" for i in range(25)]
    paras[7] = "\r\n".join(f"a long paragraph, line {j}" for j in range(12))
    seps = ["\r\n\r\n", "\n\n\n", "\n   \n", "\n\r\n", "\n\u00a0\n"]
    (raw / "b.txt").write_bytes("".join(p + seps[i % 5] for i, p in enumerate(paras)).encode())
    pq.write_table(
        pa.table({"text": [f"row {i}" if i % 11 else None for i in range(50)]}), raw / "c.parquet", row_group_size=4
    )
    (raw / "d.txt").write_bytes(b"fine paragraph\n\n" * 12 + b"bad \xfe byte\n\nmore\n")
    return raw


def _ingested(out, manifest):
    rows = [r for p in manifest["parts"] for r in pq.read_table(out / p["file"]).to_pylist()]
    return rows, pq.read_table(out / "rejected.parquet").to_pylist()


def _check_split_invariance(tmp_path):
    raw = _mixed_corpus(tmp_path / "raw")
    whole = ingest(raw, tmp_path / "whole", IngestConfig(max_chars=100))
    assert [p["source"] for p in whole["parts"]] == ["a.jsonl", "b.txt", "c.parquet", "d.txt"]  # one range per file
    rows, rejected = _ingested(tmp_path / "whole", whole)
    assert len(rows) == whole["rows"] > 90 and len(rejected) == whole["rejected"]
    assert {r["source"] for r in rejected} == {"a.jsonl:6", "a.jsonl:14", "a.jsonl:21", "b.txt:24", "d.txt"} | {
        f"c.parquet:row{i}" for i in range(0, 50, 11)
    }
    for block in (16, 57, 200):
        cut = ingest(raw, tmp_path / f"cut{block}", IngestConfig(max_chars=100, block_bytes=block))
        per_file = {s: sum(p["source"] == s for p in cut["parts"]) for s in ("a.jsonl", "b.txt", "c.parquet")}
        assert min(per_file.values()) > 1, per_file  # every file really was cut in several ranges
        if block == 16:  # JSONL is cut at any line end (its lines are ≥ 16 bytes), not only at blank lines
            assert per_file["a.jsonl"] >= 35, per_file
        assert _ingested(tmp_path / f"cut{block}", cut) == (rows, rejected), f"block_bytes={block}"
        assert (cut["rows"], cut["rejected"], cut["files"]) == (whole["rows"], whole["rejected"], whole["files"])


def test_output_does_not_depend_on_how_files_are_cut(tmp_path):
    """Same rows, ids, sources, order and rejections whether a file is one range or dozens (in-process)."""
    import ray

    assert not ray.is_initialized()
    _check_split_invariance(tmp_path)


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ranges_are_ray_tasks_that_write_their_own_parts(tmp_path, ray_local):
    """Connected to Ray, each range is a Ray task that writes its own part: the same output."""
    _check_split_invariance(tmp_path)
