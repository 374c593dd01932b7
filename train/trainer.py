"""Driver side of pretraining: validate, plan the strategy, run Ray Train's TorchTrainer, export.

from raypai.train import pretrain, PretrainConfig
result = pretrain("shards/", "tokenizer/", "out/model", PretrainConfig(steps=200), name="run-1",
                  storage_path=".raypai/train")
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace
from pathlib import Path

import pyarrow.fs as pafs

from raypai.errors import TrainError
from raypai.train import _fs, checkpoint, strategy
from raypai.train._faults import Faults
from raypai.train.config import PretrainConfig
from raypai.train.data import read_manifest
from raypai.train.export import export_model
from raypai.train.loop import train_loop
from raypai.train.model import build_model, flops_per_token, param_count

# Ray Train's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (Ray's default
# 2 s) and each poll takes at most one report off a worker's one-slot result queue: every
# checkpoint reported while the previous one still waits there blocks its worker until a poll,
# and the end of training is noticed one to two polls late. A poll is one small actor call per
# worker; how long a hung worker may take before it is declared dead is a separate timeout
# (RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S), so polling faster detects nothing less reliably.
# A value the user exported wins.
CONTROLLER_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
CONTROLLER_POLL_S = 0.2


@contextlib.contextmanager
def _controller_poll_interval():
    """Set `CONTROLLER_POLL_ENV` for the Ray Train run started inside (Ray Train forwards it from
    this process to its controller) unless the user set it; restore the environment after."""
    if CONTROLLER_POLL_ENV in os.environ:
        yield
        return
    os.environ[CONTROLLER_POLL_ENV] = str(CONTROLLER_POLL_S)
    try:
        yield
    finally:
        os.environ.pop(CONTROLLER_POLL_ENV, None)


def _tokenizer_info(tokenizer_dir: str | Path | None) -> tuple[int | None, int | None]:
    if not tokenizer_dir:
        return None, None
    from transformers import PreTrainedTokenizerFast

    if not Path(tokenizer_dir, "tokenizer.json").exists():
        raise TrainError(f"tokenizer_dir={tokenizer_dir} holds no tokenizer.json; pass the tokenizer artifact folder")
    tok = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    return len(tok), tok.pad_token_id


def plan(shards_dir: str | Path, cfg: PretrainConfig, tokenizer_dir: str | Path | None = None):
    """Check config, data, tokenizer and memory before any worker starts; return (config, plan).
    With `strategy="auto"` the returned config carries the chosen ZeRO stage and batch split."""
    cfg = cfg.validate()
    manifest = read_manifest(shards_dir)
    vocab, seq_len = manifest.vocab_size, manifest.block_size
    tok_vocab, pad_id = _tokenizer_info(tokenizer_dir)
    if tok_vocab is not None and tok_vocab != vocab:
        raise TrainError(
            f"vocab mismatch: token shards {shards_dir} were made with a {vocab}-token vocabulary but "
            f"the tokenizer in {tokenizer_dir} has {tok_vocab}; re-tokenize with this tokenizer"
        )
    if cfg.model.vocab_size and cfg.model.vocab_size != vocab:
        raise TrainError(
            f"vocab mismatch: model.vocab_size={cfg.model.vocab_size} but the token shards use {vocab}; "
            "leave model.vocab_size at 0 to take it from the token shards"
        )
    if seq_len > cfg.model.max_positions:
        raise TrainError(
            f"blocks of {seq_len} tokens exceed model.max_positions={cfg.model.max_positions}; "
            "raise model.max_positions or tokenize with a smaller block_size"
        )
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=vocab))
    model = build_model(cfg.model, vocab, weights=False)  # shape and size only: on the meta device
    n_params = param_count(model)
    hf = model.config  # the real shape, also when the model comes from init_from (its config.json)
    shape = strategy.ModelShape.of(hf)
    if cfg.strategy == "auto":
        cfg, est = strategy.choose(n_params, cfg, seq_len, shape)
        print(
            f"[raypai.train] strategy=auto chose ZeRO-{cfg.zero_stage}, micro-batch {cfg.micro_batch}, "
            f"accumulation {cfg.grad_accum}: {est.describe()}",
            flush=True,
        )
    else:
        est = strategy.check_fits(n_params, cfg, seq_len, shape)
    info = {
        "n_params": n_params,
        "seq_len": seq_len,
        "vocab_size": vocab,
        "pad_id": pad_id,
        "eos_id": manifest.eos_id,
        "train_blocks": manifest.num_blocks,
        "eval_blocks": manifest.num_eval_blocks,
        "flops_per_token": flops_per_token(n_params, hf.num_hidden_layers, hf.hidden_size, seq_len),
        "memory_estimate_gb": round(est.total_gb, 4),
        "memory": est.as_dict(),
        "zero_stage": cfg.zero_stage,
        "micro_batch": cfg.micro_batch,
        "grad_accum": cfg.grad_accum,
        "global_batch": cfg.global_batch,
        "unigram_entropy_nats": manifest.unigram_entropy_nats,
        "tokenizer_digest": manifest.tokenizer_digest,
    }
    return cfg, info


def pretrain(
    shards_dir: str | Path,
    tokenizer_dir: str | Path | None,
    out_dir: str | Path,
    cfg: PretrainConfig,
    *,
    name: str,
    storage_path: str | Path,
    logger=None,
    resume: bool = True,
    lineage: dict | None = None,
    progress=None,
) -> dict:
    """Train on the running Ray cluster and export the final model as an HF folder in `out_dir`.

    `shards_dir`: a local folder every worker can read (one node, or a shared filesystem) or a URI
    (`s3://...`); workers read their blocks from the shard files themselves. `storage_path`: where
    checkpoints go, a local folder or a URI pyarrow knows (`s3://bucket/prefix`; credentials and
    `AWS_ENDPOINT_URL` from the environment). A second call with the same `name` and
    `storage_path` (a restarted driver) continues from the run's latest checkpoint; `resume=False`
    starts over. `logger`: any picklable object with `log_metrics(dict, step=)` and
    `log_params(dict)` (raypai's `RunLogger`), used on rank 0. `progress`: a picklable
    `progress(done, total, unit)` (a step's `ctx.progress_reporter()`), called on rank 0.
    Returns {"metrics", "info", "config", "seconds", "checkpoint_path"}.
    """
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    faults = Faults.from_env()  # private test hooks (raypai.train._faults), none in normal use
    cfg, info = plan(shards_dir, cfg, tokenizer_dir)
    resume_ckpt = checkpoint.checkpoint_from_path(cfg.resume_from) if cfg.resume_from else None
    fs, root = _fs.resolve(storage_path)
    run_dir = f"{root}/{name}"
    shown_dir = _fs.join(storage_path, name) if _fs.is_remote(storage_path) else run_dir
    if not resume and fs.get_file_info(run_dir).type == pafs.FileType.Directory:
        fs.delete_dir(run_dir)
    if logger is not None:
        logger.log_params({"pretrain": cfg.to_dict(), "plan": info})
    print(
        f"[raypai.train] {name}: {info['n_params'] / 1e6:.2f}M params, ZeRO-{cfg.zero_stage}, {cfg.workers} workers "
        f"× micro-batch {cfg.micro_batch} × accum {cfg.grad_accum}, {cfg.steps} steps; "
        f"est. {info['memory_estimate_gb']:.3f} GB/worker",
        flush=True,
    )
    t0 = time.time()
    if resume and not cfg.resume_from and (done := _finished_checkpoint(fs, run_dir, storage_path, name, cfg.steps)):
        ckpt_path, metrics = done
        print(f"[raypai.train] {name}: already finished (final checkpoint {ckpt_path}); exporting it", flush=True)
        return _export(
            checkpoint.checkpoint_from_path(ckpt_path),
            metrics,
            ckpt_path,
            out_dir,
            cfg,
            info,
            tokenizer_dir=tokenizer_dir,
            lineage=lineage,
            t0=t0,
        )
    shards = shards_dir if _fs.is_remote(shards_dir) else str(Path(shards_dir).absolute())
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "config": cfg.to_dict(),
            "plan": info,
            "logger": logger,
            "progress": progress,
            "shards": shards,
            "storage": (fs, run_dir),
            "faults": faults,
            # the loop's starting point when this run has no checkpoint of its own yet (Ray Train v2
            # refuses TorchTrainer's `resume_from_checkpoint`: its migration passes it this way)
            "resume_from": resume_ckpt,
        },
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.workers, use_gpu=cfg.use_gpu, resources_per_worker={"CPU": cfg.cpus_per_worker}
        ),
        # a local folder stays Ray's default local storage; a URI's filesystem travels pickled to the
        # controller and workers (its endpoint included; credentials from their environment)
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=root,
            storage_filesystem=fs if _fs.is_remote(storage_path) else None,
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
        ),
    )
    try:
        with _controller_poll_interval():
            result = trainer.fit()
    except Exception as exc:  # noqa: BLE001 - Ray wraps worker errors; keep the cause readable
        last = str(exc).strip().splitlines()[-1][:500] if str(exc).strip() else type(exc).__name__
        raise TrainError(
            f"training run {name!r} failed after {cfg.max_failures} restart(s): {last}; its "
            f"checkpoints stay in {shown_dir}, and calling pretrain again with name={name!r} resumes "
            "from the latest one"
        ) from exc
    if result.checkpoint is None:
        raise TrainError(f"training run {name!r} finished without a final checkpoint")
    ckpt_path = result.checkpoint.path
    if _fs.is_remote(storage_path):  # Ray gives the path inside the bucket; callers get a URI back
        ckpt_path = _fs.join(storage_path, name, Path(ckpt_path).name)
    return _export(
        result.checkpoint,
        dict(result.metrics or {}),
        ckpt_path,
        out_dir,
        cfg,
        info,
        tokenizer_dir=tokenizer_dir,
        lineage=lineage,
        t0=t0,
    )


def _export(
    ckpt, metrics: dict, ckpt_path, out_dir, cfg: PretrainConfig, info: dict, *, tokenizer_dir, lineage, t0: float
) -> dict:
    """Export the final checkpoint `ckpt` (a `ray.train.Checkpoint`) to `out_dir`; `pretrain`'s result."""
    with ckpt.as_directory() as d:
        export_model(
            Path(d) / "hf",
            out_dir,
            tokenizer_dir=tokenizer_dir,
            eos_id=info["eos_id"],
            pad_id=info["pad_id"],
            training=cfg.to_dict(),
            plan=info,
            metrics=metrics,
            lineage=lineage or {},
        )
    return {
        "metrics": metrics,
        "info": info,
        "config": cfg.to_dict(),
        "seconds": time.time() - t0,
        "checkpoint_path": ckpt_path,
    }


def _finished_checkpoint(fs, run_dir: str, storage_path, name: str, steps: int):
    """(checkpoint path, metrics) of run `name` when it already finished `steps` steps: its newest
    checkpoint is a final one (it holds `metrics.json`), at or past `steps`, and Ray Train has
    registered it (so it is complete and what a restarted worker group would load). Otherwise None.
    Starting a worker group for such a run would only load that checkpoint and report it again."""
    latest = checkpoint.latest_checkpoint(storage_path, name)
    if latest is None:
        return None
    folder = f"{run_dir}/{Path(str(latest)).name}"
    position = _fs.read_json(fs, f"{folder}/{checkpoint.DATA_POSITION}") or {}
    metrics = _fs.read_json(fs, f"{folder}/{checkpoint.FINAL_METRICS}")
    next_step = position.get("next_step", -1)
    if metrics is None or next_step < steps or not checkpoint.is_registered(fs, run_dir, next_step):
        return None
    return str(latest), metrics
