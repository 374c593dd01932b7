"""`raypai train`: pretrain a causal LM from token shards on Ray Train + DeepSpeed.

raypai train SHARDS_DIR OUT_DIR --tokenizer TOKENIZER_DIR --config pretrain.yaml --name run-1
raypai train SHARDS_DIR OUT_DIR --steps 200 --workers 2 --zero-stage 2     # flags override the file
raypai train SHARDS_DIR OUT_DIR --config pretrain.yaml --name run-1        # again: resumes run-1
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from raypai import exits


def train_command(
    shards_dir: Path = typer.Argument(..., help="token-shards folder (manifest.json + shard-*.parquet)"),
    out_dir: Path = typer.Argument(..., help="where the Hugging Face model folder is written"),
    tokenizer: Optional[Path] = typer.Option(None, help="tokenizer folder, copied next to the model"),
    config: Optional[Path] = typer.Option(None, help="YAML/JSON PretrainConfig (model: {...} for the architecture)"),
    name: str = typer.Option("raypai-pretrain", help="run name; the same name resumes from its latest checkpoint"),
    steps: Optional[int] = typer.Option(None, help="override config.steps"),
    workers: Optional[int] = typer.Option(None, help="override config.workers"),
    zero_stage: Optional[int] = typer.Option(None, help="override config.zero_stage (0-3)"),
    strategy: Optional[str] = typer.Option(None, help="'auto' picks ZeRO stage and micro-batch from the memory budget"),
    fresh: bool = typer.Option(False, help="discard this run name's checkpoints and start over"),
):
    """Pretrain a causal LM on Ray Train + DeepSpeed and export an HF folder."""
    import ray

    from raypai.errors import RaypaiError
    from raypai.runtime import ensure_ray
    from raypai.settings import Settings
    from raypai.train import PretrainConfig, pretrain

    try:
        raw = PretrainConfig.load(str(config)).to_dict() if config else {}
        overrides = {"steps": steps, "workers": workers, "zero_stage": zero_stage, "strategy": strategy}
        raw.update({k: v for k, v in overrides.items() if v is not None})
        cfg = PretrainConfig.from_dict(raw)
        settings = Settings.load()
        ensure_ray(settings)
        res = pretrain(
            shards_dir, tokenizer, out_dir, cfg, name=name, storage_path=settings.home / "train", resume=not fresh
        )
    except RaypaiError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(exits.REFUSED) from exc
    finally:
        if ray.is_initialized():
            ray.shutdown()
    shown = {k: v for k, v in res["metrics"].items() if "rank" not in k}
    typer.echo(json.dumps(shown, indent=1, default=str))
    typer.echo(f"model written to {out_dir} ({res['info']['n_params'] / 1e6:.2f}M params, {res['seconds']:.0f}s)")
