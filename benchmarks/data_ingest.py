"""Ingest of one big JSONL file: one Ray task per range (1 and 2 CPUs) vs the same ranges in one
process vs the whole file as one range in one process (what ingest did before files were cut).

    .venv/bin/python benchmarks/data_ingest.py              # ≈ 2 min on 2 cores; one JSON line per result
    .venv/bin/python benchmarks/data_ingest.py --mb 256     # a bigger file

Each system runs in a fresh subprocess on the same file (baselines measured in the same run). Per
result: seconds, rows/s, parts written, the driver's peak RSS growth over its RSS just before the
call (`driver_peak_rss_growth_mb`), and a digest of every part's rows in order (all systems must
agree: the same rows, ids and sources).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
SYSTEMS = {  # name: (Ray CPUs or 0 for none, block_bytes or 0 for the default)
    "one-range-in-process": (0, 1 << 40),
    "ranges-in-process": (0, 0),
    "ranges-ray-1cpu": (1, 0),
    "ranges-ray-2cpu": (2, 0),
}


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def _make_file(path: Path, mb: int) -> None:
    """Distinct JSONL lines of synthetic prose (the synth corpus's clean paragraphs, numbered)."""
    import random

    from raypai.data.synth import prose

    rng = random.Random(0)
    paras = [prose(rng, 8) for _ in range(2000)]
    with open(path, "w") as f:
        i = 0
        while f.tell() < mb << 20:
            f.write(json.dumps({"text": f"{i} {paras[i % len(paras)]}"}) + "\n")
            i += 1


def _one(args) -> dict:
    import pyarrow.parquet as pq

    from raypai.data.ingest import IngestConfig, ingest

    cpus, block = SYSTEMS[args.system]
    if cpus:
        from raypai.runtime import ensure_ray
        from raypai.settings import Settings

        ensure_ray(Settings.load(), local=True, num_cpus=cpus, dashboard=False, log_to_driver=False)
    cfg = IngestConfig(block_bytes=block) if block else IngestConfig(block_bytes=args.block_mb << 20)
    base = _status_mb("VmRSS")
    t0 = time.perf_counter()
    m = ingest(args.input, args.out, cfg)
    secs = time.perf_counter() - t0
    peak = _status_mb("VmHWM")
    digest = hashlib.sha256()
    for p in m["parts"]:
        t = pq.read_table(Path(args.out) / p["file"], columns=["doc_id", "source"])
        for i, src in zip(t.column("doc_id").to_pylist(), t.column("source").to_pylist()):  # row by row
            digest.update(f"{i} {src}\n".encode())
    return {
        "system": args.system,
        "mb": args.mb,
        "rows": m["rows"],
        "parts": len(m["parts"]),
        "seconds": round(secs, 2),
        "rows_per_s": round(m["rows"] / secs),
        "driver_rss_before_mb": round(base, 1),
        "driver_peak_rss_growth_mb": round(peak - base, 1),
        "rows_digest": digest.hexdigest()[:16],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=128)
    ap.add_argument("--block-mb", type=int, default=32)
    ap.add_argument("--system", choices=list(SYSTEMS))
    ap.add_argument("--input")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.system:  # child: one system
        print(json.dumps(_one(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / "in" / "big.jsonl"
        big.parent.mkdir()
        _make_file(big, args.mb)
        for name in SYSTEMS:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--system",
                    name,
                    "--mb",
                    str(args.mb),
                    "--block-mb",
                    str(args.block_mb),
                    "--input",
                    str(big.parent),
                    "--out",
                    str(Path(tmp) / name),
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
