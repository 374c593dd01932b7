"""Pretraining throughput and checkpoint stall: raypai (Ray Train + DeepSpeed) vs a bare PyTorch loop.

    .venv/bin/python benchmarks/pretrain.py                 # ≈ 8 min on 2 cores; one JSON line per result
    .venv/bin/python benchmarks/pretrain.py --steps 40 --ckpt-model-hidden 512
    .venv/bin/python benchmarks/pretrain.py --grad-accum 4 --skip-checkpoint   # 4 micro-batches per step, both sides
    .venv/bin/python benchmarks/pretrain.py --only-streaming   # token set 4 × the object store, streamed

Results (baselines measured in the same run):
- `bare_loop`: a single-process PyTorch loop (same model, micro-batch, AdamW, clipping, schedule,
  1 thread) — the per-core ceiling; measured before and after the Ray runs to bracket drift.
- `bare_loops_2_concurrent`: two bare loops at once, one process each with no communication: the
  per-core rate two cores of this machine give two independent trainings (the hardware ceiling of
  a 2-worker run; `vs_concurrent_bare_loops_per_core` compares against it).
- `raypai_workers_1`, `raypai_workers_2`: steady-state tokens/s of raypai's loop (1 thread per
  worker, first 3 steps excluded) for each ZeRO stage in `--zero-stages` (default 0 and 2), its
  per-core ratio to the bare loop (target ≥ 0.9) and the 1 → 2 worker scaling efficiency.
- `checkpoint_stall`: seconds the loop is blocked per checkpoint with asynchronous vs synchronous
  saving (target: async ≤ 10% of sync), on a larger model so the state is worth writing.
- `stream_reads`: milliseconds to read one micro-batch of random blocks from the shard files
  (`TokenShards`, what each worker does) against indexing blocks already in memory.
- `stream_run`: a 2-worker run on a token set `--stream-factor` × Ray's smallest object store
  (Ray restarted with that store): tokens/s against the in-memory bare loop measured just before,
  and the peak memory growth of the driver and of each worker's loop against the token set's size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from raypai.train import ModelConfig, PretrainConfig, build_model, pretrain  # noqa: E402
from raypai.train._faults import ENV as FAULTS_ENV  # noqa: E402
from raypai.train._faults import Faults  # noqa: E402
from raypai.train.data import BlockOrder, TokenShards, load_blocks  # noqa: E402
from raypai.train.model import measure_peak_flops  # noqa: E402
from raypai.train.schedule import lr_multiplier  # noqa: E402
from raypai.train.synthetic import write_token_shards  # noqa: E402


def bare_loop(cfg: PretrainConfig, tokens: np.ndarray, warm: int = 3) -> dict:
    """Tokens/s of the same training step in one process with no Ray, DeepSpeed or logging:
    mean over the steps after warm-up, and from the median step time (robust to other processes'
    bursts on a shared machine)."""
    torch.set_num_threads(cfg.threads_per_worker)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.model.vocab_size, eos_id=0)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: lr_multiplier(
            s, total_steps=cfg.steps, warmup_steps=cfg.warmup_steps, schedule=cfg.schedule, min_ratio=cfg.min_lr_ratio
        ),
    )
    rng = np.random.default_rng(cfg.seed)
    times = []
    for step in range(cfg.steps):
        xs = [
            torch.from_numpy(tokens[rng.integers(0, len(tokens), cfg.micro_batch)]).long()  # (b, T)
            for _ in range(cfg.grad_accum)
        ]
        t0 = time.perf_counter()
        for x in xs:  # gradient accumulation, as DeepSpeed does it: mean of the micro-batch losses
            loss = model(input_ids=x, labels=x).loss / cfg.grad_accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        loss.item()
        if step >= warm:
            times.append(time.perf_counter() - t0)
    per_step = cfg.micro_batch * cfg.grad_accum * tokens.shape[1]
    return {"mean": per_step * len(times) / sum(times), "median": per_step / statistics.median(times)}


def _bare_worker(cfg: PretrainConfig, tokens: np.ndarray, queue) -> None:
    queue.put(bare_loop(cfg, tokens))


def bare_loops_concurrent(cfg: PretrainConfig, tokens: np.ndarray, n: int = 2) -> list[dict]:
    """n bare loops at the same time, one process each (no communication between them): what n
    cores of this machine give n independent single-core trainings (shared caches, memory
    bandwidth, clocks), the hardware ceiling of an n-worker run."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_bare_worker, args=(cfg, tokens, queue)) for _ in range(n)]
    for proc in procs:
        proc.start()
    out = [queue.get() for _ in procs]
    for proc in procs:
        proc.join()
    return out


def raypai_run(cfg: PretrainConfig, shards: Path, work: Path, name: str) -> dict:
    res = pretrain(shards, None, work / f"model-{name}", cfg, name=name, storage_path=work / "store", resume=False)
    return res["metrics"]


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def start_ray(**options) -> None:
    """A Ray of this benchmark's own, never RAY_ADDRESS or raypai's recorded head: 4 logical CPUs
    (2 workers + the Train controller on 2 cores), no dashboard, workers' logs kept off the JSON lines."""
    from raypai.runtime import ensure_ray
    from raypai.settings import Settings

    ensure_ray(Settings.load(), local=True, num_cpus=4, dashboard=False, log_to_driver=False, **options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ckpt-model-hidden", type=int, default=512)
    ap.add_argument("--ckpt-steps", type=int, default=24)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (both sides)")
    ap.add_argument(
        "--zero-stages",
        default="0,2",
        help="ZeRO stages for the throughput runs, comma-separated (0: what strategy='auto' picks when "
        "the state fits per worker, as here; 2: partitioned gradients and optimizer state)",
    )
    ap.add_argument("--ckpt-zero-stage", type=int, default=2, choices=(0, 1, 2))
    ap.add_argument("--skip-checkpoint", action="store_true", help="throughput only, no checkpoint-stall runs")
    ap.add_argument("--only-checkpoint", action="store_true", help="checkpoint-stall runs only")
    ap.add_argument("--deepspeed", default="{}", help="JSON merged over raypai's DeepSpeed config (raypai runs only)")
    ap.add_argument("--skip-streaming", action="store_true", help="no run on a token set larger than the object store")
    ap.add_argument("--only-streaming", action="store_true", help="the streaming reads and run only")
    ap.add_argument("--stream-factor", type=float, default=4.0, help="token set / Ray's smallest object store")
    args = ap.parse_args()

    import ray

    work = Path(tempfile.mkdtemp(prefix="raypai-bench-pretrain-"))
    shards = work / "shards"
    write_token_shards(shards, vocab=2048, block=128, blocks=1024)
    tokens = load_blocks(shards, "train")[1]
    model = ModelConfig(
        layers=4,
        hidden=args.hidden,
        heads=4,
        kv_heads=4,
        intermediate=args.hidden * 8 // 3,
        max_positions=128,
        vocab_size=2048,
    )
    torch.set_num_threads(1)  # the workers' thread count: the peak is per worker
    peak = measure_peak_flops(1.0)
    base = PretrainConfig(
        model=model,
        steps=args.steps,
        warmup_steps=5,
        micro_batch=8,
        grad_accum=args.grad_accum,
        lr=1e-3,
        zero_stage=args.ckpt_zero_stage,
        deepspeed_config=json.loads(args.deepspeed),
        workers=2,
        threads_per_worker=1,
        eval_every=args.steps,
        eval_blocks=8,
        checkpoint_every=10**6,
        log_every=10,
        peak_flops_per_worker=peak,
        memory_budget_gb=8,
    )
    n_params = sum(p.numel() for p in build_model(model, 2048).parameters())
    common = {
        "n_params": n_params,
        "micro_batch": base.micro_batch,
        "grad_accum": base.grad_accum,
        "seq_len": 128,
        "threads_per_worker": 1,
        "steps": args.steps,
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
    }

    if not args.only_streaming:
        start_ray()
        try:
            if not args.only_checkpoint:
                stages = [int(x) for x in args.zero_stages.split(",")]
                throughput(base, stages, common, shards, tokens, work)
            if not args.skip_checkpoint:
                checkpoint_stall(args, base, model, shards, work)
        finally:
            ray.shutdown()
    if not args.skip_streaming and not args.only_checkpoint:
        streaming(args, base, common, tokens, work)


def throughput(
    base: PretrainConfig, stages: list[int], common: dict, shards: Path, tokens: np.ndarray, work: Path
) -> None:
    """Bare loop (before and after), raypai with 1 and 2 workers per ZeRO stage, and the scaling."""
    bare_before = bare_loop(base, tokens)
    runs = {
        (stage, workers): raypai_run(
            replace(base, zero_stage=stage, workers=workers), shards, work, f"z{stage}-w{workers}"
        )
        for stage in stages
        for workers in (1, 2)
    }
    bare_after = bare_loop(base, tokens)
    pair = bare_loops_concurrent(base, tokens)
    bare = {k: statistics.mean([bare_before[k], bare_after[k]]) for k in ("mean", "median")}
    pair_mean = statistics.mean(b["mean"] for b in pair)  # per process (per core)
    emit(
        {
            "bench": "pretrain",
            "result": "bare_loop",
            "tokens_per_s": round(bare["mean"], 1),
            "tokens_per_s_median": round(bare["median"], 1),
            "before": round(bare_before["median"], 1),
            "after": round(bare_after["median"], 1),
            **common,
        }
    )
    emit(
        {
            "bench": "pretrain",
            "result": "bare_loops_2_concurrent",
            "tokens_per_s_per_core": round(pair_mean, 1),
            "per_process": [round(b["mean"], 1) for b in pair],
            "vs_one_bare_loop": round(pair_mean / bare["mean"], 3),
            **common,
        }
    )
    for stage in stages:
        one, two = runs[(stage, 1)], runs[(stage, 2)]
        for workers, m in ((1, one), (2, two)):
            emit(
                {
                    "bench": "pretrain",
                    "result": f"raypai_workers_{workers}",
                    "zero_stage": stage,
                    "deepspeed_overrides": base.deepspeed_config,
                    "tokens_per_s": round(m["tokens_per_s_steady"], 1),
                    "tokens_per_s_median": round(m["tokens_per_s_median"], 1),
                    "vs_bare_loop_per_core": round(m["tokens_per_s_steady"] / workers / bare["mean"], 3),
                    "vs_bare_loop_per_core_median": round(m["tokens_per_s_median"] / workers / bare["median"], 3),
                    "vs_concurrent_bare_loops_per_core": round(m["tokens_per_s_steady"] / workers / pair_mean, 3),
                    "target": 0.9,
                    "mfu": round(m["mfu"], 4),
                    "eval_loss": round(m["eval_loss"], 3),
                    **common,
                }
            )
        emit(
            {
                "bench": "pretrain",
                "result": "scaling_1_to_2_workers",
                "zero_stage": stage,
                "efficiency": round(two["tokens_per_s_steady"] / (2 * one["tokens_per_s_steady"]), 3),
                "efficiency_median": round(two["tokens_per_s_median"] / (2 * one["tokens_per_s_median"]), 3),
                **common,
            }
        )


def checkpoint_stall(args, base: PretrainConfig, model: ModelConfig, shards: Path, work: Path) -> None:
    """Seconds the loop is blocked per checkpoint, synchronous vs asynchronous, on a larger model;
    the asynchronous stall is broken down into its parts (rank 0's)."""
    big = replace(
        base,
        grad_accum=1,
        model=replace(model, hidden=args.ckpt_model_hidden, intermediate=args.ckpt_model_hidden * 8 // 3),
        steps=args.ckpt_steps,
        checkpoint_every=4,
        eval_every=args.ckpt_steps,
    )
    big_params = sum(p.numel() for p in build_model(big.model, 2048).parameters())
    stalls = {
        mode: raypai_run(replace(big, async_checkpoint=mode == "async"), shards, work, f"ckpt-{mode}")
        for mode in ("sync", "async")
    }
    sync_s, async_s = stalls["sync"]["checkpoint_stall_mean_s"], stalls["async"]["checkpoint_stall_mean_s"]
    n = stalls["async"]["checkpoints"]
    parts = {
        f"async_{part}_s": round(stalls["async"][f"checkpoint_stall_{part}_s"] / n, 4)
        for part in ("wait", "snapshot", "poll", "report")
    }
    emit(
        {
            "bench": "pretrain",
            "result": "checkpoint_stall",
            "n_params": big_params,
            "zero_stage": big.zero_stage,
            "state_mb_approx": round(big_params * 16 / 2**20, 1),
            "checkpoints": stalls["sync"]["checkpoints"],
            "sync_stall_s": round(sync_s, 4),
            "async_stall_s": round(async_s, 4),
            "async_over_sync": round(async_s / sync_s, 3),
            "target": 0.10,
            **parts,
            "snapshot_buffer_mb_rank0": round(stalls["async"]["checkpoint_snapshot_buffer_mb"], 1),
            "sync_tokens_per_s": round(stalls["sync"]["tokens_per_s_steady"], 1),
            "async_tokens_per_s": round(stalls["async"]["tokens_per_s_steady"], 1),
            "storage": "local disk (RunConfig.storage_path)",
            "load_avg_1m": os.getloadavg()[0],
        }
    )


def _status_bytes(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def streaming(args, base: PretrainConfig, common: dict, tokens: np.ndarray, work: Path) -> None:
    """Random block reads from shard files vs in memory, then a 2-worker ZeRO-0 run on a token set
    larger than Ray's object store (Ray started with its smallest one), with memory peaks."""
    import ray
    from ray._private.ray_constants import OBJECT_STORE_MINIMUM_MEMORY_BYTES as store_bytes

    block = tokens.shape[1]
    train_blocks = int(args.stream_factor * store_bytes / (block * 4)) + 1
    big = work / "big-shards"
    t0 = time.perf_counter()
    manifest = write_token_shards(
        big, vocab=2048, block=block, blocks=train_blocks + 64, eval_fraction=64.5 / (train_blocks + 64)
    )
    write_s = time.perf_counter() - t0
    token_bytes = manifest["num_tokens"] * 4
    disk = sum(f.stat().st_size for f in big.glob("*.parquet"))

    shards = TokenShards(big, "train")
    order = BlockOrder(len(shards), seed=1)
    batches = [order.indices(s, 0, 0, 2, base.micro_batch, 1) for s in range(300)]
    t0 = time.perf_counter()
    for idx in batches:
        shards.take(idx)
    stream_ms = (time.perf_counter() - t0) / len(batches) * 1e3
    mem_order = BlockOrder(len(tokens), seed=1)
    mem_batches = [mem_order.indices(s, 0, 0, 2, base.micro_batch, 1) for s in range(300)]
    t0 = time.perf_counter()
    for idx in mem_batches:
        np.ascontiguousarray(tokens[idx])
    memory_ms = (time.perf_counter() - t0) / len(mem_batches) * 1e3
    emit(
        {
            "bench": "pretrain",
            "result": "stream_reads",
            "ms_per_micro_batch": round(stream_ms, 3),
            "in_memory_ms_per_micro_batch": round(memory_ms, 4),
            "blocks_per_s": round(base.micro_batch / stream_ms * 1e3),
            "micro_batch": base.micro_batch,
            "block": block,
            "train_blocks": len(shards),
            "token_set_mib": round(token_bytes / 2**20),
            "parquet_mib": round(disk / 2**20),
            "write_s": round(write_s, 1),
            "load_avg_1m": os.getloadavg()[0],
        }
    )

    cfg = replace(base, zero_stage=0, workers=2)
    bare = bare_loop(cfg, tokens)
    trace = work / "stream-trace"
    trace.mkdir()
    os.environ[FAULTS_ENV] = Faults(trace_dir=str(trace)).to_env()  # the workers record their memory peaks
    start_ray(object_store_memory=store_bytes)
    try:
        Path("/proc/self/clear_refs").write_text("5")
        rss0 = _status_bytes("VmRSS")
        m = raypai_run(cfg, big, work, "stream")
        driver_growth = _status_bytes("VmHWM") - rss0
    finally:
        ray.shutdown()
        os.environ.pop(FAULTS_ENV)
    workers = [json.loads((trace / f"memory-rank{r}.json").read_text()) for r in range(2)]
    emit(
        {
            "bench": "pretrain",
            "result": "stream_run",
            "zero_stage": 0,
            "workers": 2,
            "object_store_mib": round(store_bytes / 2**20),
            "token_set_mib": round(token_bytes / 2**20),
            "tokens_per_s": round(m["tokens_per_s_steady"], 1),
            "tokens_per_s_median": round(m["tokens_per_s_median"], 1),
            "bare_loop_in_memory_tokens_per_s": round(bare["mean"], 1),
            "vs_bare_loop_per_core": round(m["tokens_per_s_steady"] / 2 / bare["mean"], 3),
            "driver_peak_growth_mib": round(driver_growth / 2**20, 1),
            "worker_loop_peak_growth_mib": [round((w["peak_rss"] - w["rss_at_start"]) / 2**20, 1) for w in workers],
            "worker_peak_rss_mib": [round(w["peak_rss"] / 2**20) for w in workers],
            "eval_loss": round(m["eval_loss"], 3),
            **common,
        }
    )


if __name__ == "__main__":
    sys.exit(main())
