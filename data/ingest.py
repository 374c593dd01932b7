"""Ingest: JSONL, Parquet and plain-text files → one Parquet part per input file (doc_id, text,
source) plus a `rejected` table. Nothing is dropped silently.

    from raypai.data import ingest
    stats = ingest("raw/", "out/")            # local folder, or any pyarrow filesystem URI
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raypai.errors import DataError

DOC_SCHEMA = pa.schema([("doc_id", pa.string()), ("text", pa.string()), ("source", pa.string())])
REJECT_SCHEMA = pa.schema([("source", pa.string()), ("reason", pa.string()), ("raw", pa.string())])
SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".txt": "text",
            ".md": "text"}


@dataclass(frozen=True)
class IngestConfig:
    text_field: str = "text"
    text_mode: str = "paragraphs"  # plain text: "file" (one doc per file) or "paragraphs" (blank-line blocks)
    max_chars: int = 1_000_000  # longer documents are rejected as oversize


def doc_id(source: str) -> str:
    """Stable id from where the row came from (file + line/row/block), the same on every machine."""
    return hashlib.sha1(source.encode()).hexdigest()[:16]


def list_inputs(uri: str | Path) -> tuple[pafs.FileSystem, str, list[str]]:
    uri = str(uri)
    if "://" in uri:
        fs, root = pafs.FileSystem.from_uri(uri)
    else:
        fs, root = pafs.LocalFileSystem(), str(Path(uri).absolute())
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"input {uri} does not exist; pass a folder (or file) of .jsonl/.parquet/.txt files")
    if info.type == pafs.FileType.File:
        return fs, str(Path(root).parent), [root]
    files = sorted(f.path for f in fs.get_file_info(pafs.FileSelector(root, recursive=True))
                   if f.type == pafs.FileType.File and Path(f.path).suffix.lower() in SUFFIXES
                   and not Path(f.path).name.startswith(("_", ".")))  # _/. files are metadata, not data
    if not files:
        raise DataError(f"input folder {uri} holds no .jsonl, .parquet or .txt files; put the raw text there")
    return fs, root, files


def _rows_jsonl(data: bytes, rel: str, cfg: IngestConfig):
    for i, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        src = f"{rel}:{i}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield None, (src, f"invalid UTF-8 at byte {exc.start}", line[:200].decode("utf-8", "replace"))
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            yield None, (src, f"broken JSON: {exc.msg}", text[:200])
            continue
        if not isinstance(obj, dict) or cfg.text_field not in obj:
            yield None, (src, f"missing field {cfg.text_field!r}", text[:200])
        elif not isinstance(obj[cfg.text_field], str):
            yield None, (src, f"field {cfg.text_field!r} is {type(obj[cfg.text_field]).__name__}, not a string", text[:200])
        else:
            yield (src, obj[cfg.text_field]), None


def _rows_text(data: bytes, rel: str, cfg: IngestConfig):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        yield None, (rel, f"invalid UTF-8 at byte {exc.start}; file skipped", data[:200].decode("utf-8", "replace"))
        return
    text = text.replace("\r\n", "\n")  # universal newlines, as open() in text mode reads them
    if cfg.text_mode == "file":
        yield (f"{rel}:1", text), None
        return
    line_no, block, start = 0, [], 1
    for line_no, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            if not block:
                start = line_no
            block.append(line)
        elif block:
            yield (f"{rel}:{start}", "\n".join(block)), None
            block = []
    if block:
        yield (f"{rel}:{start}", "\n".join(block)), None


def _rows_parquet(path: str, fs, rel: str, cfg: IngestConfig):
    try:
        table = pq.read_table(path, filesystem=fs)
    except (pa.ArrowInvalid, OSError) as exc:
        yield None, (rel, f"unreadable Parquet: {exc}", "")
        return
    if cfg.text_field not in table.column_names:
        yield None, (rel, f"Parquet file has no column {cfg.text_field!r} (columns: {table.column_names})", "")
        return
    for i, text in enumerate(table.column(cfg.text_field).to_pylist()):
        src = f"{rel}:row{i}"
        if isinstance(text, str):
            yield (src, text), None
        else:
            yield None, (src, f"field {cfg.text_field!r} is {type(text).__name__}, not a string", str(text)[:200])


def ingest(input_uri: str | Path, out_dir: str | Path, config: IngestConfig | None = None) -> dict:
    """Write `part-NNNNN.parquet` (one per input file) and `rejected.parquet`; return counts."""
    cfg = config or IngestConfig()
    if cfg.text_mode not in ("file", "paragraphs"):
        raise DataError(f"text_mode {cfg.text_mode!r} is unknown; use 'file' or 'paragraphs'")
    input_uri = str(input_uri)
    fs, root, files = list_inputs(input_uri)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rejected: list[tuple] = []
    parts, total = [], 0
    for n, path in enumerate(files):
        rel = path[len(root.rstrip("/")) + 1:] if path.startswith(root) else Path(path).name
        kind = SUFFIXES[Path(path).suffix.lower()]
        if kind == "parquet":
            rows = _rows_parquet(path, fs, rel, cfg)
        else:
            with fs.open_input_stream(path) as f:
                data = f.read()
            rows = (_rows_jsonl if kind == "jsonl" else _rows_text)(data, rel, cfg)
        ids, texts, sources = [], [], []
        for ok, bad in rows:
            if bad:
                rejected.append(bad)
            elif len(ok[1]) > cfg.max_chars:
                rejected.append((ok[0], f"oversize: {len(ok[1])} chars > max_chars={cfg.max_chars}", ok[1][:200]))
            else:
                ids.append(doc_id(ok[0]))
                texts.append(ok[1])
                sources.append(ok[0])
        name = f"part-{n:05d}.parquet"
        pq.write_table(pa.table([ids, texts, sources], schema=DOC_SCHEMA), out / name)
        parts.append({"file": name, "source": rel, "rows": len(ids)})
        total += len(ids)
    pq.write_table(pa.table(list(zip(*rejected)) if rejected else [[], [], []], schema=REJECT_SCHEMA),
                   out / "rejected.parquet")
    manifest = {"kind": "raw_dataset", "input": input_uri, "files": [p["source"] for p in parts], "parts": parts,
                "rows": total, "rejected": len(rejected), "schema": DOC_SCHEMA.names}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest
