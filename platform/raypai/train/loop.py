"""The per-worker training function Ray Train runs: one DeepSpeed engine per worker.

Each worker: build the model from the config (same seed → same initial weights everywhere),
wrap it in DeepSpeed (ZeRO stage from the plan), resume from the latest checkpoint if Ray Train
hands one over, then for each optimizer step read its blocks from `BlockOrder`, accumulate
gradients over `grad_accum` micro-batches, step, and on rank 0 log metrics. Checkpoints are
reported every `checkpoint_every` steps; the last report carries the Hugging Face export.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np


def ds_config(cfg) -> dict:
    """DeepSpeed config generated from the `PretrainConfig`; `cfg.deepspeed_config` is merged over
    it key by key (one level deep), so a manual config can override any part."""
    conf = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "zero_allow_untested_optimizer": True,  # a plain torch AdamW: DeepSpeed's fused Adam needs a compiler/GPU
        "steps_per_print": 10**9,
        # raypai's tag is always the same ("state"), so DeepSpeed's cross-rank tag check (two
        # all-reduces inside every save) would only add to the checkpoint stall
        "checkpoint": {"tag_validation": "Ignore"},
        "bf16": {"enabled": bool(cfg.use_gpu)},  # fp32 on CPU: gloo has no bf16 all-reduce fast path
    }
    for k, v in cfg.deepspeed_config.items():
        conf[k] = {**conf[k], **v} if isinstance(v, dict) and isinstance(conf.get(k), dict) else v
    return conf


def _fault_drill(cfg, step: int, rank: int, world: int, run_dir: str) -> None:
    """Fault injection for tests and drills: the last worker's process dies once at this step,
    after the latest checkpoint is registered (an async upload still in flight when the process
    dies is legitimately lost, which would make the drill's outcome depend on machine load)."""
    if step != cfg.kill_worker_at_step or rank != world - 1 or not cfg.trace_dir:
        return
    marker = Path(cfg.trace_dir) / f"killed-at-{step}"
    if marker.exists():
        return
    from raypai.train.checkpoint import is_registered

    boundary = step - step % cfg.checkpoint_every
    deadline = time.monotonic() + 120
    while boundary and not is_registered(run_dir, boundary) and time.monotonic() < deadline:
        time.sleep(0.2)
    marker.write_text(str(step))
    os._exit(1)


def train_loop(loop_cfg: dict) -> None:
    import deepspeed
    import ray
    import ray.train
    import torch

    from raypai.train import checkpoint
    from raypai.train.config import PretrainConfig
    from raypai.train.data import BlockOrder
    from raypai.train.metrics import StragglerDetector, mfu
    from raypai.train.model import build_model, measure_peak_flops
    from raypai.train.schedule import lr_multiplier

    cfg = PretrainConfig.from_dict(loop_cfg["config"])
    plan = loop_cfg["plan"]
    torch.set_num_threads(cfg.threads_per_worker)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    logger = loop_cfg.get("logger") if rank == 0 else None
    progress = loop_cfg.get("progress") if rank == 0 else None
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)

    # Zero-copy views of the blocks the driver put in the node's shared-memory object store.
    (train_ids, train_tokens), eval_tokens = ray.get(loop_cfg["train_ref"]), ray.get(loop_cfg["eval_ref"])
    seq_len = train_tokens.shape[1]
    model = build_model(cfg.model, plan["vocab_size"], pad_id=plan["pad_id"], eos_id=plan["eos_id"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(
        s, total_steps=cfg.steps, warmup_steps=cfg.warmup_steps, schedule=cfg.schedule, min_ratio=cfg.min_lr_ratio))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config(cfg), dist_init_required=False)
    order = BlockOrder(len(train_tokens), cfg.seed)

    start_step = 0
    if (ckpt := ray.train.get_checkpoint()) is not None:
        start_step = checkpoint.restore(engine, ckpt, rank)
        if rank == 0:
            print(f"[raypai.train] resumed from checkpoint at step {start_step}", flush=True)

    peak = cfg.peak_flops_per_worker or measure_peak_flops()
    fpt = plan["flops_per_token"]
    trace = Path(cfg.trace_dir) / f"rank{rank}.jsonl" if cfg.trace_dir else None
    stragglers = StragglerDetector(world, ratio=cfg.straggler_ratio)
    tokens_per_step = cfg.micro_batch * cfg.grad_accum * seq_len * world
    window_losses, window_time, stall_total, stalls = [], 0.0, 0.0, []
    steady_times, warm = [], start_step + min(3, max(0, cfg.steps - start_step - 1))  # seconds per step
    metrics: dict = {}
    saver = checkpoint.AsyncCheckpointer(engine, rank) if cfg.async_checkpoint else None

    loop_start = time.perf_counter()  # for the progress line's percentage and time left
    for step in range(start_step, cfg.steps):
        _fault_drill(cfg, step, rank, world, loop_cfg.get("run_dir", ""))
        t0 = time.perf_counter()
        for micro in range(cfg.grad_accum):
            idx = order.indices(step, micro, rank, world, cfg.micro_batch, cfg.grad_accum)
            if trace is not None:
                with open(trace, "a") as f:
                    f.write(json.dumps({"step": step, "micro": micro, "blocks": train_ids[idx].tolist()}) + "\n")
            x = torch.from_numpy(train_tokens[idx]).long()  # (micro_batch, seq_len)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
            window_losses.append(loss.item())
        step_time = time.perf_counter() - t0
        window_time += step_time
        if step >= warm:
            steady_times.append(step_time)
        done = step + 1
        if progress is not None:
            progress(done, cfg.steps, "steps")  # the run display's line for this step (throttled)
        metrics = {"step": done, "lr": scheduler.get_last_lr()[0]}
        if done % cfg.log_every == 0 or done == cfg.steps:
            metrics.update(_window_metrics(engine, window_losses, step_time, world, stragglers, verbose=rank == 0))
            n_window = len(window_losses) // cfg.grad_accum
            metrics["tokens_per_s"] = tokens_per_step * n_window / window_time
            metrics["mfu"] = mfu(metrics["tokens_per_s"], fpt, peak * world)
            window_losses, window_time = [], 0.0
            if rank == 0:
                left = (time.perf_counter() - loop_start) / (done - start_step) * (cfg.steps - done)
                print(f"[raypai.train] step {done}/{cfg.steps} loss {metrics['loss']:.4f} lr {metrics['lr']:.2e} "
                      f"tok/s {metrics['tokens_per_s']:.0f} mfu {metrics['mfu']:.3f} "
                      f"[{_bar(done / cfg.steps)}] {100 * done / cfg.steps:.0f}% ~{left:.0f}s left", flush=True)
        if done % cfg.eval_every == 0 or done == cfg.steps:
            metrics.update(_evaluate(engine, eval_tokens, cfg, rank, world))
        if logger is not None and len(metrics) > 2:
            logger.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=done)
        if saver is not None:
            stall_total += saver.poll()  # reports the previous snapshot once every worker wrote it
        if done % cfg.checkpoint_every == 0 and done < cfg.steps:
            if saver is not None:
                stall = saver.save(metrics, next_step=done)
            else:
                stall = checkpoint.save(engine, metrics, next_step=done, rank=rank)
            stall_total += stall
            stalls.append(stall)
            if logger is not None:
                logger.log_metrics({"checkpoint_stall_s": stall}, step=done)

    if saver is not None:
        stall_total += saver.flush()
    # stall: every second the loop waited on checkpointing (snapshots, polls, reports, final flush)
    final = {**metrics, "checkpoint_stall_s": stall_total, "checkpoints": len(stalls),
             "checkpoint_stall_mean_s": stall_total / len(stalls) if stalls else 0.0,
             "checkpoint_stall_first_s": stalls[0] if stalls else 0.0,  # the first snapshot also allocates buffers
             # after warm-up: mean, and median (robust to other processes' bursts on a shared machine)
             "tokens_per_s_steady": tokens_per_step * len(steady_times) / sum(steady_times) if steady_times else 0.0,
             "tokens_per_s_median": tokens_per_step / float(np.median(steady_times)) if steady_times else 0.0}
    if saver is not None:  # where the asynchronous stall went: waiting on a write, snapshot copies, polls, reports
        final.update({f"checkpoint_stall_{part}_s": v for part, v in saver.stall.items()})
        final["checkpoint_snapshot_buffer_mb"] = saver.buffers.nbytes / 2**20
    checkpoint.save(engine, final, next_step=cfg.steps, rank=rank, final=True)


def _bar(fraction: float, width: int = 20) -> str:
    """A text progress bar: `#####...............` (log lines from a Ray worker cannot redraw in place)."""
    filled = round(fraction * width)
    return "#" * filled + "." * (width - filled)


def _window_metrics(engine, losses: list[float], step_time: float, world: int, stragglers, *,
                    verbose: bool) -> dict:
    """Mean loss over the log window on all workers, grad norm, and each worker's last step time."""
    import torch
    import torch.distributed as dist

    loss_t = torch.tensor([float(np.mean(losses))])
    dist.all_reduce(loss_t)
    times = [None] * world
    dist.all_gather_object(times, step_time)
    gn = engine.get_global_grad_norm()
    out = {"loss": loss_t.item() / world, "grad_norm": float(gn) if gn is not None else 0.0,
           **{f"step_time_s.rank{r}": t for r, t in enumerate(times)}}
    for r in stragglers.observe(times):
        out["straggler_rank"] = r
        if not verbose:
            continue
        others = [t for i, t in enumerate(times) if i != r]
        print(f"[raypai.train] WARNING straggler: worker {r} step time {times[r]:.3f}s is "
              f"{times[r] / np.median(others):.1f}x its peers' median for {stragglers.patience} log intervals",
              flush=True)
    return out


def _evaluate(engine, eval_tokens, cfg, rank: int, world: int) -> dict:
    """Mean next-token loss on the held-out blocks (each worker takes every world-th block)."""
    import torch
    import torch.distributed as dist

    engine.eval()
    mine = eval_tokens[rank::world][: max(1, cfg.eval_blocks // world)]
    total = torch.zeros(2)  # (sum of loss × blocks, blocks)
    with torch.no_grad():
        for i in range(0, len(mine), cfg.micro_batch):
            x = torch.tensor(mine[i:i + cfg.micro_batch], dtype=torch.long)  # a copy: the shared view is read-only
            total += torch.tensor([engine(input_ids=x, labels=x).loss.item() * len(x), len(x)])
    engine.train()
    dist.all_reduce(total)
    eval_loss = (total[0] / total[1]).item()
    return {"eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50.0))}
