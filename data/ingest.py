"""Ingest: JSONL, Parquet and plain-text files → Parquet parts (doc_id, text, source) plus a
`rejected` table. Nothing is dropped silently.

    from raypai.data import ingest
    stats = ingest("raw/", "out/")            # local folder, or any pyarrow filesystem URI

A file is cut into ranges of about `block_bytes`: JSONL at line ends, plain text at blank lines,
Parquet at row-group boundaries. Each range is read by its own Ray task when this process is
connected to Ray (in this process otherwise), which writes its own part, `part-FFFFF-RRRRR.parquet`
(file FFFFF, range RRRRR). The driver holds the plan and counters, never rows. A row's `source`
(file + line/row/first line) is counted from the start of its file, so ids and output do not
depend on how a file is cut.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from raypai.errors import DataError

DOC_SCHEMA = pa.schema([("doc_id", pa.string()), ("text", pa.string()), ("source", pa.string())])
REJECT_SCHEMA = pa.schema([("source", pa.string()), ("reason", pa.string()), ("raw", pa.string())])
SUFFIXES = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".txt": "text",
    ".md": "text",
}
_CHUNK = 1 << 16  # bytes read at a time while looking for a range boundary


@dataclass(frozen=True)
class IngestConfig:
    text_field: str = "text"
    text_mode: str = "paragraphs"  # plain text: "file" (one doc per file) or "paragraphs" (blank-line blocks)
    max_chars: int = 1_000_000  # longer documents are rejected as oversize
    # Target size of one range (one Ray task, one part). 32 MiB: a worker holds a range's bytes and
    # its rows, a few times this; a 10 GB file becomes ~300 tasks.
    block_bytes: int = 32 << 20


@dataclass(frozen=True)
class _Range:
    """One unit of ingest work: bytes [start, end) of a JSONL/text file, or row groups [start, end)
    of a Parquet file. `first`: line number of the first line (bytes), row number of the first row
    (Parquet)."""

    path: str
    rel: str
    kind: str
    file: int
    k: int
    start: int
    end: int
    first: int = 1

    @property
    def part(self) -> str:
        return f"part-{self.file:05d}-{self.k:05d}.parquet"


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
    files = sorted(
        f.path
        for f in fs.get_file_info(pafs.FileSelector(root, recursive=True))
        if f.type == pafs.FileType.File
        and Path(f.path).suffix.lower() in SUFFIXES
        and not Path(f.path).name.startswith(("_", "."))
    )  # _/. files are metadata, not data
    if not files:
        raise DataError(f"input folder {uri} holds no .jsonl, .parquet or .txt files; put the raw text there")
    return fs, root, files


def _rows_jsonl(data: bytes, rel: str, cfg: IngestConfig, first: int = 1):
    for i, line in enumerate(data.split(b"\n"), start=first):
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
            yield (
                None,
                (src, f"field {cfg.text_field!r} is {type(obj[cfg.text_field]).__name__}, not a string", text[:200]),
            )
        else:
            yield (src, obj[cfg.text_field]), None


def _rows_text(data: bytes, rel: str, cfg: IngestConfig, first: int = 1):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        yield None, (rel, f"invalid UTF-8 at byte {exc.start}; file skipped", data[:200].decode("utf-8", "replace"))
        return
    text = text.replace("\r\n", "\n")  # universal newlines, as open() in text mode reads them
    if cfg.text_mode == "file":
        yield (f"{rel}:1", text), None
        return
    block, start = [], first
    for line_no, line in enumerate(text.split("\n"), start=first):
        if line.strip():
            if not block:
                start = line_no
            block.append(line)
        elif block:
            yield (f"{rel}:{start}", "\n".join(block)), None
            block = []
    if block:
        yield (f"{rel}:{start}", "\n".join(block)), None


def _rows_parquet(fs, r: _Range, cfg: IngestConfig):
    try:
        with fs.open_input_file(r.path) as f:
            table = pq.ParquetFile(f).read_row_groups(range(r.start, r.end), columns=[cfg.text_field])
    except (pa.ArrowInvalid, OSError) as exc:
        yield None, (r.rel, f"unreadable Parquet: {exc}", "")
        return
    for i, text in enumerate(table.column(cfg.text_field).to_pylist(), start=r.first):
        src = f"{r.rel}:row{i}"
        if isinstance(text, str):
            yield (src, text), None
        else:
            yield None, (src, f"field {cfg.text_field!r} is {type(text).__name__}, not a string", str(text)[:200])


# ----------------------------------------------------------------------------- range boundaries


def _lines(f, pos: int, size: int):
    """(end offset, bytes) of each line from byte `pos` on, reading `_CHUNK` bytes at a time."""
    f.seek(pos)
    read_to, buf = pos, b""
    while read_to < size:
        chunk = f.read(min(_CHUNK, size - read_to))
        if not chunk:
            break
        read_to += len(chunk)
        *lines, buf = (buf + chunk).split(b"\n")
        for line in lines:
            pos += len(line) + 1
            yield pos, line
    if buf:
        yield pos + len(buf), buf


def _boundary(f, pos: int, size: int, paragraphs: bool) -> int:
    """Where a range that nominally starts at byte `pos` really starts: the first line start at or
    after `pos` (JSONL), or the end of the first blank line starting there (plain text, so that no
    paragraph straddles two ranges). The range before ends at the same offset."""
    if pos <= 0 or pos >= size:
        return min(max(pos, 0), size)
    f.seek(pos - 1)
    start = pos if f.read(1) == b"\n" else next((end for end, _ in _lines(f, pos, size)), size)
    if not paragraphs:
        return start
    # blank as `_rows_text` sees it: str.strip() of the decoded line (CR and Unicode spaces included)
    return next((end for end, line in _lines(f, start, size) if not line.decode("utf-8", "replace").strip()), size)


def _scan(fs, r: _Range, paragraphs: bool) -> dict:
    """Phase 1 of a byte range: its aligned [start, end), its newlines (to number the next range's
    lines), and its first invalid UTF-8 byte (plain text: one bad byte rejects the whole file)."""
    with fs.open_input_file(r.path) as f:
        size = f.size()
        start, end = _boundary(f, r.start, size, paragraphs), _boundary(f, r.end, size, paragraphs)
        f.seek(start)
        data = f.read(max(end - start, 0))
    bad = None
    if r.kind == "text":
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = start + exc.start
    return {"start": start, "end": max(start, end), "newlines": data.count(b"\n"), "bad_utf8": bad}


def _ingest_range(fs, r: _Range, out: str, cfg: IngestConfig) -> dict:
    """Phase 2: read one range, write its part (and its rejected rows); return its counts."""
    if r.kind == "parquet":
        rows = _rows_parquet(fs, r, cfg)
    else:
        with fs.open_input_file(r.path) as f:
            f.seek(r.start)
            data = f.read(r.end - r.start)
        rows = (_rows_jsonl if r.kind == "jsonl" else _rows_text)(data, r.rel, cfg, r.first)
    ids, texts, sources, rejected = [], [], [], []
    for ok, bad in rows:
        if bad:
            rejected.append(bad)
        elif len(ok[1]) > cfg.max_chars:
            rejected.append((ok[0], f"oversize: {len(ok[1])} chars > max_chars={cfg.max_chars}", ok[1][:200]))
        else:
            ids.append(doc_id(ok[0]))
            texts.append(ok[1])
            sources.append(ok[0])
    pq.write_table(pa.table([ids, texts, sources], schema=DOC_SCHEMA), f"{out}/{r.part}")
    if rejected:
        _write_rejected(rejected, f"{out}/_rejected/{r.file:05d}-{r.k:05d}.parquet")
    return {"file": r.part, "source": r.rel, "rows": len(ids), "rejected": len(rejected), "range": [r.start, r.end]}


def _write_rejected(rows: list[tuple], path: str) -> None:
    pq.write_table(pa.table(list(zip(*rows)), schema=REJECT_SCHEMA), path)


def _merge_rejected(out: str) -> int:
    """Stream the pieces of `_rejected/` into `rejected.parquet`, in file and range order (one piece
    in memory at a time); return the row count."""
    pieces, n = sorted(Path(out, "_rejected").glob("*.parquet")), 0
    with pq.ParquetWriter(f"{out}/rejected.parquet", REJECT_SCHEMA) as w:
        for p in pieces:
            t = pq.read_table(p)
            w.write_table(t)
            n += t.num_rows
    shutil.rmtree(Path(out, "_rejected"))
    return n


def _map(fn, calls: list[tuple]) -> list:
    """fn(*args) for each call: Ray tasks when this process is connected to Ray, else in turn here."""
    if not ray.is_initialized():
        return [fn(*args) for args in calls]
    task = ray.remote(num_cpus=1, max_retries=2)(fn)  # ranges are idempotent: a retry rewrites the part
    return ray.get([task.remote(*args) for args in calls])


# ----------------------------------------------------------------------------- plan and run


def _plan(fs, root: str, files: list[str], cfg: IngestConfig) -> tuple[list[_Range], list[tuple]]:
    """Nominal ranges of every file (Parquet: from its footer) and file-level rejections."""
    ranges, rejected = [], []
    for n, path in enumerate(files):
        rel = path[len(root.rstrip("/")) + 1 :] if path.startswith(root) else Path(path).name
        kind = SUFFIXES[Path(path).suffix.lower()]
        if kind == "parquet":
            try:
                with fs.open_input_file(path) as f:
                    meta = pq.ParquetFile(f).metadata
            except (pa.ArrowInvalid, OSError) as exc:
                rejected.append((n, (rel, f"unreadable Parquet: {exc}", "")))
                continue
            if cfg.text_field not in meta.schema.names:
                rejected.append(
                    (n, (rel, f"Parquet file has no column {cfg.text_field!r} (columns: {meta.schema.names})", ""))
                )
                continue
            k, g0, size, row = 0, 0, 0, 0
            for g in range(meta.num_row_groups):  # whole row groups, about block_bytes (uncompressed) each
                size += meta.row_group(g).total_byte_size
                if size >= cfg.block_bytes or g == meta.num_row_groups - 1:
                    ranges.append(_Range(path, rel, kind, n, k, g0, g + 1, row))
                    row += sum(meta.row_group(i).num_rows for i in range(g0, g + 1))
                    k, g0, size = k + 1, g + 1, 0
            continue
        size = fs.get_file_info(path).size
        cuts = 1 if kind == "text" and cfg.text_mode == "file" else max(1, -(-size // cfg.block_bytes))
        ranges += [
            _Range(path, rel, kind, n, k, k * cfg.block_bytes, size if k == cuts - 1 else (k + 1) * cfg.block_bytes)
            for k in range(cuts)
        ]
    return ranges, rejected


def _align(fs, ranges: list[_Range], cfg: IngestConfig) -> tuple[list[_Range], list[tuple]]:
    """Phase 1 over the files cut in several byte ranges: aligned bounds and first line numbers
    (a running sum of newlines); a text file with invalid UTF-8 becomes one rejection, as whole."""
    multi = {r.file for r in ranges if r.k > 0 and r.kind != "parquet"}
    todo = [r for r in ranges if r.file in multi]
    scans = _map(_scan, [(fs, r, r.kind == "text" and cfg.text_mode == "paragraphs") for r in todo])
    aligned, rejected, line, bad = {}, [], {}, {}
    for r, s in zip(todo, scans):
        first = line.get(r.file, 1)
        line[r.file] = first + s["newlines"]
        if s["bad_utf8"] is not None and r.file not in bad:  # ranges in order: the first bad byte wins
            bad[r.file] = s["bad_utf8"]
        if s["end"] > s["start"]:
            aligned[r] = replace(r, start=s["start"], end=s["end"], first=first)
    for n, at in bad.items():
        r = next(r for r in todo if r.file == n)
        with fs.open_input_file(r.path) as f:
            head = f.read(200).decode("utf-8", "replace")
        rejected.append((n, (r.rel, f"invalid UTF-8 at byte {at}; file skipped", head)))
    out = [
        aligned[r] if r in aligned else r for r in ranges if r.file not in bad and (r.file not in multi or r in aligned)
    ]
    return out, rejected


def ingest(input_uri: str | Path, out_dir: str | Path, config: IngestConfig | None = None) -> dict:
    """Write `part-FFFFF-RRRRR.parquet` (one per range of each input file) and `rejected.parquet`;
    return the manifest (counts, parts, files)."""
    cfg = config or IngestConfig()
    if cfg.text_mode not in ("file", "paragraphs"):
        raise DataError(f"text_mode {cfg.text_mode!r} is unknown; use 'file' or 'paragraphs'")
    if not isinstance(cfg.block_bytes, int) or cfg.block_bytes < 1:
        raise DataError(
            f"block_bytes must be a positive number of bytes (got {cfg.block_bytes!r}); the default is 32 MiB"
        )
    input_uri = str(input_uri)
    fs, root, files = list_inputs(input_uri)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*.parquet"):  # a previous ingest into this folder
        old.unlink()
    shutil.rmtree(out / "_rejected", ignore_errors=True)
    (out / "_rejected").mkdir()
    ranges, file_rejects = _plan(fs, root, files, cfg)
    ranges, more = _align(fs, ranges, cfg)
    for n, row in file_rejects + more:
        _write_rejected([row], str(out / "_rejected" / f"{n:05d}-00000.parquet"))
    parts = _map(_ingest_range, [(fs, r, str(out), cfg) for r in ranges])
    n_rejected = _map(_merge_rejected, [(str(out),)])[0]
    rel = [p[len(root.rstrip("/")) + 1 :] if p.startswith(root) else Path(p).name for p in files]
    manifest = {
        "kind": "raw_dataset",
        "input": input_uri,
        "files": rel,
        "parts": parts,
        "rows": sum(p["rows"] for p in parts),
        "rejected": n_rejected,
        "schema": DOC_SCHEMA.names,
        "block_bytes": cfg.block_bytes,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest
