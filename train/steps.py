"""The `pretrain` pipeline step: token shards (+ tokenizer) → HF model artifact, registered in MLflow.

from raypai.train.steps import pretrain
base = pretrain(shards, tokenizer, steps=200, register_as="tinychat-base")   # inside a @pipeline
"""

from __future__ import annotations

from raypai import Artifact, StepContext, step
from raypai.train import _fs
from raypai.train.config import PretrainConfig
from raypai.train.trainer import pretrain as run_pretrain


def step_config(
    shards: Artifact,
    *,
    steps: int,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    options: dict | None,
    **fields,
) -> PretrainConfig:
    """The step's flat parameters plus `options` (any other PretrainConfig field, and `model: {...}`
    for the rest of ModelConfig) as one validated config."""
    options = dict(options or {})
    model = {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "intermediate": intermediate,
        "max_positions": max(256, int(shards.metadata.get("block_size", 0))),
        **options.pop("model", {}),
    }
    raw = {"steps": steps, "warmup_steps": min(20, steps // 10), **fields, **options, "model": model}
    return PretrainConfig.from_dict(raw)


@step(cpus=0.5)
def pretrain(
    ctx: StepContext,
    shards: Artifact,
    tokenizer: Artifact,
    steps: int = 200,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 344,
    lr: float = 3e-3,
    micro_batch: int = 8,
    grad_accum: int = 1,
    zero_stage: int = 2,
    strategy: str = "manual",
    workers: int = 2,
    checkpoint_every: int = 50,
    eval_every: int = 50,
    seed: int = 0,
    register_as: str = "",
    options: dict | None = None,
) -> Artifact:
    """Pretrain a Llama-style model with Ray Train + DeepSpeed; register it if `register_as` is set.
    `options`: further PretrainConfig fields (e.g. {"async_checkpoint": False, "max_failures": 2})."""
    cfg = step_config(
        shards,
        steps=steps,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        options=options,
        lr=lr,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        zero_stage=zero_stage,
        strategy=strategy,
        workers=workers,
        checkpoint_every=checkpoint_every,
        eval_every=eval_every,
        seed=seed,
    )
    # Same code, inputs and config (the runner's cache key) → same Ray Train run name, so a retried
    # or resumed step continues from the checkpoints of the attempt before it instead of starting over.
    out = ctx.output_dir("model")
    lineage = {
        "token_shards": {"artifact_id": shards.id, "digest": shards.digest},
        "tokenizer": {"artifact_id": tokenizer.id, "digest": tokenizer.digest},
        "pipeline": ctx.pipeline,
        "pipeline_run": ctx.run_id,
        "step_run": ctx.step_run_id,
    }
    ctx.progress(f"pretraining {cfg.steps} steps on {cfg.workers} Ray Train workers")
    # Train workers read their blocks from the shard files: the local folder of a local store, else
    # the artifact's URI (workers on other nodes read row groups from the object store, no copy)
    shards_at = shards.uri if _fs.is_remote(shards.uri) else ctx.artifacts.open_artifact(shards)
    res = run_pretrain(
        shards_at,
        ctx.artifacts.open_artifact(tokenizer),
        out,
        cfg,
        name=f"pretrain-{ctx.work_key()}",
        storage_path=ctx.settings.home / "train",
        logger=ctx.logger,
        lineage=lineage,
        progress=ctx.progress_reporter(),
    )
    m, info = res["metrics"], res["info"]
    ctx.log_metrics(
        {
            "final_loss": m.get("loss", 0.0),
            "final_eval_loss": m.get("eval_loss", 0.0),
            "n_params": info["n_params"],
            "train_seconds": res["seconds"],
        }
    )
    art = ctx.save(
        out,
        kind="model",
        name="base_model",
        metadata={
            "n_params": info["n_params"],
            "eval_loss": m.get("eval_loss"),
            "eval_ppl": m.get("eval_ppl"),
            "unigram_entropy_nats": info["unigram_entropy_nats"],
            "zero_stage": info["zero_stage"],
            "steps": cfg.steps,
        },
    )
    if register_as:
        version = ctx.register_model(art, register_as, {"shards": shards, "tokenizer": tokenizer}, local_dir=out)
        ctx.log_metrics({"registered_version": version})
    return art
