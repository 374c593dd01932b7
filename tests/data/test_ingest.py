"""Ingest: formats, stable ids and sources, every malformed row in `rejected` with its reason."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

from raypai.data.ingest import IngestConfig, doc_id, ingest


def test_formats_sources_and_rejected_reasons(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "broken\n{"body": 1}\n{"text": 7}\n'
                                  b'{"text": "bad \xff"}\n\n{"text": "' + b"x" * 50 + b'"}\n')
    (raw / "b.txt").write_bytes(b"First para\r\nline two\r\n\r\n\r\nSecond para\r\n")  # CRLF: universal newlines
    pq.write_table(pa.table({"text": ["row zero", None]}), raw / "c.parquet")
    m = ingest(raw, tmp_path / "out", IngestConfig(max_chars=40))
    rows = pq.read_table(tmp_path / "out" / "part-00001.parquet").to_pylist()
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
    assert one["rows"] == 1 and pq.read_table(tmp_path / "one" / "part-00000.parquet").column("text")[0].as_py() \
        == "First para\nline two\n\n\nSecond para\n"
