"""Tokenization into token shards: Ray tasks (1 and 2 workers) vs the same tasks in one process vs
raypai's earlier single-process implementation (the reference kept in tests/data/test_tokenize_dist.py).

    .venv/bin/python benchmarks/data_tokenize.py                 # ≈ 1 min on 2 cores; one JSON line per result
    .venv/bin/python benchmarks/data_tokenize.py --docs 240000 --task-bytes 8388608   # the RESULTS.md run, ≈ 3 min

Each system runs in a fresh subprocess on the same dataset and tokenizer (baselines measured in the
same run). Per result: seconds of the first tokenize call (Ray's worker processes start during it)
and of a second one (workers warm), tokens/s of each, the driver's peak RSS growth over its RSS
just before the first call (`driver_peak_rss_growth_mb`) and the manifest's `content_sha256`
(all systems must agree: the same blocks in the same order).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ROOT = Path(__file__).resolve().parents[1]


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def _one(args) -> dict:
    """Run one system here; return its figures."""
    from raypai.data.tokenizer import tokenize

    ds, tok, out = Path(args.dataset), Path(args.tokenizer), Path(args.out)
    if args.system.startswith("ray"):
        from raypai.runtime import ensure_ray
        from raypai.settings import Settings

        ensure_ray(Settings.load(), local=True, num_cpus=args.workers, dashboard=False, log_to_driver=False)
    run = tokenize
    if args.system == "reference":
        sys.path.insert(0, str(ROOT / "tests" / "data"))
        from test_tokenize_dist import ref_tokenize as run
    kwargs = dict(block_size=128, shard_blocks=4096)
    if args.system != "reference":
        kwargs["task_bytes"] = args.task_bytes
    from transformers import PreTrainedTokenizerFast  # imports paid before the measurement, by every system

    PreTrainedTokenizerFast.from_pretrained(str(tok))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (ru_maxrss would carry the parent's peak across exec)
    before = _status_mb("VmRSS")
    t0 = time.perf_counter()
    m = run(ds, tok, out, **kwargs)
    secs = time.perf_counter() - t0
    peak = _status_mb("VmHWM")
    t0 = time.perf_counter()
    run(ds, tok, Path(f"{out}-again"), **kwargs)  # a second call: Ray's workers already started and warm
    warm = time.perf_counter() - t0
    tokens = m["num_tokens"] + m["num_eval_blocks"] * 128
    return {
        "system": args.system,
        "workers": args.workers,
        "seconds": round(secs, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / secs),
        "seconds_second_call": round(warm, 2),
        "tokens_per_s_second_call": round(tokens / warm),
        "driver_peak_rss_growth_mb": round(peak - before, 1),
        "content_sha256": m["content_sha256"][:16],
        "work": m.get("work"),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=60_000)
    p.add_argument("--task-bytes", type=int, default=2 << 20)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    for hidden in ("--dataset", "--tokenizer", "--out"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.system:
        print(json.dumps(_one(args)))
        return
    sys.path.insert(0, str(ROOT / "tests" / "data"))
    from test_tokenize_dist import make_dataset

    from raypai.data.tokenizer import train_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    ds = make_dataset(tmp / "ds", docs=args.docs)
    train_tokenizer(ds, tmp / "tok", vocab_size=2048, sample_bytes=4 << 20)
    digests = set()
    for system, workers in (("reference", 1), ("tasks_in_process", 1), ("ray_tasks", 1), ("ray_tasks", 2)):
        cmd = [
            sys.executable,
            __file__,
            "--system",
            system,
            "--workers",
            str(workers),
            "--task-bytes",
            str(args.task_bytes),
            "--dataset",
            str(ds),
            "--tokenizer",
            str(tmp / "tok"),
            "--out",
            str(tmp / f"out-{system}-{workers}"),
        ]
        line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        result = json.loads(line)
        digests.add(result["content_sha256"])
        print(json.dumps({**result, "docs": args.docs}), flush=True)
    print(json.dumps({"same_blocks_everywhere": len(digests) == 1}))


if __name__ == "__main__":
    main()
