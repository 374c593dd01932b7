"""The per-worker training function Ray Train runs: one DeepSpeed engine per worker.

Each worker: build the model from the config (same seed → same initial weights everywhere; at
ZeRO-3 under `deepspeed.zero.Init`, so each worker only holds its partition of the weights),
wrap it in DeepSpeed (ZeRO stage from the plan), resume from the latest checkpoint if Ray Train
hands one over, then for each optimizer step read its blocks from the shard files in `BlockOrder`'s order
(`Prefetcher`: the next micro-batch is decoded while this one trains), accumulate
gradients over `grad_accum` micro-batches, step, and on rank 0 log metrics. Checkpoints are
reported every `checkpoint_every` steps; the last report carries the Hugging Face export.
"""

from __future__ import annotations

import math
import random
import time

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
    if cfg.zero_stage == 3:
        zero = conf["zero_optimization"]
        # every parameter partitioned, however small: DeepSpeed's default keeps those under 1e5
        # elements whole on every rank (norms, and all of a small model's weights), which saves a
        # gather per module and pass but leaves them unsharded
        zero["stage3_param_persistence_threshold"] = 0
        if not cfg.use_gpu:
            # each module's weights released right after its use, and gathered again in the backward
            # (ZeRO-3's 1.5× traffic, as `strategy` assumes). DeepSpeed's defaults prefetch up to 5e7
            # elements ahead and keep those reused within 1e9: every weight of a model below those
            # sizes then stays gathered from its forward to its backward, and after an evaluation (no
            # backward) until the next step: the whole model on every worker, which is what ZeRO-3
            # on CPU workers, chosen for memory, is there to avoid
            zero["stage3_prefetch_bucket_size"] = 0
            zero["stage3_max_reuse_distance"] = 0
    for k, v in cfg.deepspeed_config.items():
        conf[k] = {**conf[k], **v} if isinstance(v, dict) and isinstance(conf.get(k), dict) else v
    return conf


def train_loop(loop_cfg: dict) -> None:
    import ray.train
    import torch

    from raypai.checkpoint_io import guard_engine
    from raypai.train import checkpoint
    from raypai.train._deepspeed import import_deepspeed
    from raypai.train.clipping import clip, take_clipping
    from raypai.train.config import PretrainConfig
    from raypai.train.data import BlockOrder, Prefetcher, TokenShards
    from raypai.train.metrics import StragglerDetector, mfu
    from raypai.train.model import build_model, local_param_count, measure_peak_flops
    from raypai.train.schedule import lr_multiplier

    deepspeed = import_deepspeed()
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

    faults = loop_cfg["faults"]  # private test hooks (raypai.train._faults); inert unless a test set them
    fs, run_dir = loop_cfg["storage"]
    # Blocks are read from the shard files on demand: only row groups this worker needs are decoded.
    train = TokenShards(loop_cfg["shards"], "train")
    eval_tokens = _eval_blocks(TokenShards(loop_cfg["shards"], "eval"), cfg, rank, world)
    seq_len = train.block_size
    conf = ds_config(cfg)
    # DeepSpeed adopts the process group Ray Train set up (zero.Init, at ZeRO-3, needs it before the model)
    deepspeed.init_distributed(dist_backend="nccl" if cfg.use_gpu else "gloo", dist_init_required=False)
    model = build_model(cfg.model, plan["vocab_size"], pad_id=plan["pad_id"], eos_id=plan["eos_id"], ds_config=conf)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_multiplier(
            s, total_steps=cfg.steps, warmup_steps=cfg.warmup_steps, schedule=cfg.schedule, min_ratio=cfg.min_lr_ratio
        ),
    )
    max_norm = take_clipping(conf)  # fp32 ZeRO 0: raypai clips, so the norm is known (raypai.train.clipping)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=conf, dist_init_required=False
    )
    guard_engine(engine)  # checkpoints are read with weights_only=True (raypai.checkpoint_io)
    order = BlockOrder(len(train), cfg.seed)

    start_step, finished = 0, None
    ckpt = ray.train.get_checkpoint()  # this run's latest (a restarted worker group or driver)
    if ckpt is None:
        ckpt = loop_cfg.get("resume_from")  # else an earlier run's (`resume_from`), if any
    if ckpt is not None:
        start_step, finished = checkpoint.restore(engine, ckpt, rank)
        if rank == 0:
            print(f"[raypai.train] resumed from checkpoint at step {start_step}", flush=True)
    if finished is not None and start_step >= cfg.steps:
        # the run had finished (called again by name, or restarted after its final report): no step
        # to train; report the final checkpoint again with the metrics it finished on
        checkpoint.save(engine, finished, next_step=start_step, rank=rank, final=True)
        return

    peak = cfg.peak_flops_per_worker or measure_peak_flops()
    fpt = plan["flops_per_token"]
    stragglers = StragglerDetector(world, ratio=cfg.straggler_ratio)
    tokens_per_step = cfg.micro_batch * cfg.grad_accum * seq_len * world
    window_losses, window_time, stall_total, stalls = [], 0.0, 0.0, []
    steady_times, warm = [], start_step + min(3, max(0, cfg.steps - start_step - 1))  # seconds per step
    metrics: dict = {}
    saver = checkpoint.AsyncCheckpointer(engine, rank) if cfg.async_checkpoint else None
    blocks = Prefetcher(train, order, rank=rank, world=world, micro_batch=cfg.micro_batch, accum=cfg.grad_accum)
    rss_at_start = faults.reset_memory_peak()

    loop_start = time.perf_counter()  # for the progress line's percentage and time left
    for step in range(start_step, cfg.steps):
        boundary = step - step % cfg.checkpoint_every  # the checkpoint a restart at this step resumes from
        faults.maybe_kill(step, rank, world, lambda: not boundary or checkpoint.is_registered(fs, run_dir, boundary))
        t0 = time.perf_counter()
        for micro in range(cfg.grad_accum):
            block_ids, tokens = blocks.get(step, micro)
            faults.record_blocks(rank, step, micro, block_ids)
            x = torch.from_numpy(tokens).long().to(engine.device)  # (micro_batch, seq_len), on the worker's GPU if any
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            clip(engine, max_norm)  # at the accumulation boundary only, like the step
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
                print(
                    f"[raypai.train] step {done}/{cfg.steps} loss {metrics['loss']:.4f} lr {metrics['lr']:.2e} "
                    f"tok/s {metrics['tokens_per_s']:.0f} mfu {metrics['mfu']:.3f} "
                    f"[{_bar(done / cfg.steps)}] {100 * done / cfg.steps:.0f}% ~{left:.0f}s left",
                    flush=True,
                )
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

    blocks.close()
    if saver is not None:
        stall_total += saver.flush()
    # stall: every second the loop waited on checkpointing (snapshots, polls, reports, final flush)
    final = {
        **metrics,
        "checkpoint_stall_s": stall_total,
        "checkpoints": len(stalls),
        "checkpoint_stall_mean_s": stall_total / len(stalls) if stalls else 0.0,
        "checkpoint_stall_first_s": stalls[0] if stalls else 0.0,  # the first snapshot also allocates buffers
        # after warm-up: mean, and median (robust to other processes' bursts on a shared machine)
        "tokens_per_s_steady": tokens_per_step * len(steady_times) / sum(steady_times) if steady_times else 0.0,
        "tokens_per_s_median": tokens_per_step / float(np.median(steady_times)) if steady_times else 0.0,
    }
    if saver is not None:  # where the asynchronous stall went: waiting on a write, snapshot copies, polls, reports
        final.update({f"checkpoint_stall_{part}_s": v for part, v in saver.stall.items()})
        final["checkpoint_snapshot_buffer_mb"] = saver.buffers.nbytes / 2**20
    faults.record_memory(rank, rss_at_start, param_elements=local_param_count(engine.module))
    checkpoint.save(engine, final, next_step=cfg.steps, rank=rank, final=True)


def _bar(fraction: float, width: int = 20) -> str:
    """A text progress bar: `#####...............` (log lines from a Ray worker cannot redraw in place)."""
    filled = round(fraction * width)
    return "#" * filled + "." * (width - filled)


def _window_metrics(engine, losses: list[float], step_time: float, world: int, stragglers, *, verbose: bool) -> dict:
    """Mean loss over the log window on all workers, grad norm, and each worker's last step time."""
    import torch
    import torch.distributed as dist

    from raypai.train.clipping import grad_norm

    loss_t = torch.tensor([float(np.mean(losses))], device=engine.device)  # NCCL reduces device tensors only
    dist.all_reduce(loss_t)
    times = [None] * world
    dist.all_gather_object(times, step_time)
    out = {
        "loss": loss_t.item() / world,
        "grad_norm": grad_norm(engine),
        **{f"step_time_s.rank{r}": t for r, t in enumerate(times)},
    }
    for r in stragglers.observe(times):
        out["straggler_rank"] = r
        if not verbose:
            continue
        others = [t for i, t in enumerate(times) if i != r]
        print(
            f"[raypai.train] WARNING straggler: worker {r} step time {times[r]:.3f}s is "
            f"{times[r] / np.median(others):.1f}x its peers' median for {stragglers.patience} log intervals",
            flush=True,
        )
    return out


def _eval_blocks(shards, cfg, rank: int, world: int) -> np.ndarray:
    """This worker's held-out blocks (B, T), read once: every world-th block, eval_blocks in all."""
    mine = np.arange(rank, len(shards), world)[: max(1, cfg.eval_blocks // world)]
    return shards.take(mine)[1]


def _evaluate(engine, mine: np.ndarray, cfg, rank: int, world: int) -> dict:
    """Mean next-token loss on this worker's held-out blocks `mine` (B, T), averaged over workers."""
    import torch
    import torch.distributed as dist

    engine.eval()
    total = torch.zeros(2, device=engine.device)  # (sum of loss × blocks, blocks)
    with torch.no_grad():
        for i in range(0, len(mine), cfg.micro_batch):
            x = torch.from_numpy(mine[i : i + cfg.micro_batch]).long().to(engine.device)  # (b, T)
            total += torch.tensor([engine(input_ids=x, labels=x).loss.item() * len(x), len(x)], device=engine.device)
    engine.train()
    dist.all_reduce(total)
    eval_loss = (total[0] / total[1]).item()
    return {"eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50.0))}
