"""`raypai align ALGO MODEL_DIR OUT_DIR --config cfg.yaml`: run one alignment algorithm on the
arithmetic task from an HF model folder.

    raypai align sft base_model/ sft_model/ --config sft.yaml
    raypai align grpo sft_model/ grpo_model/ --config grpo.yaml   # re-run to resume from grpo_model.ckpt/

The config file holds the fields of the algorithm's config class (SFTConfig, RewardModelConfig,
DPOConfig, GRPOConfig, PPOConfig in raypai.alignment.config); unknown or invalid fields are all
reported before anything starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer


def align_command(algo: str = typer.Argument(..., help="sft | reward_model | dpo | online_dpo | grpo | ppo"),
                  model_dir: Path = typer.Argument(..., help="HF model folder to start from"),
                  out_dir: Path = typer.Argument(..., help="where the aligned model is written"),
                  config: Optional[Path] = typer.Option(None, help="YAML/JSON with the algorithm's options")):
    """Align a model on the arithmetic demo task (policy, reference and reward as Ray actors)."""
    import ray
    import yaml

    from raypai.alignment import config as C
    from raypai.alignment.dpo import run_dpo
    from raypai.alignment.grpo import run_grpo
    from raypai.alignment.ppo import run_ppo
    from raypai.alignment.reward_model import train_reward_model
    from raypai.alignment.sft import run_sft
    from raypai.alignment.tasks import arithmetic as ar
    from raypai.settings import Settings

    cfg = C.from_dict(algo, yaml.safe_load(config.read_text()) or {} if config else {})  # validated before Ray starts
    train, held = ar.split(seed=cfg.seed)
    model, out = str(model_dir), str(out_dir)
    settings = Settings.load()
    if settings.ray_address:
        ray.init(address=settings.ray_address)
    else:  # logical CPUs: the roles are small and share the cores (as the pipeline runner does)
        ray.init(address="local", num_cpus=settings.ray_num_cpus or max(8, os.cpu_count() or 1), include_dashboard=False)
    try:
        if algo == "sft":
            res = run_sft(model, out, ar.sft_rows(train), ar.sft_rows(held), cfg)
        elif algo == "reward_model":
            res = train_reward_model(model, out, ar.preference_pairs(train, cfg.seed, 1),
                                     ar.preference_pairs(train, cfg.seed + 7, 1), cfg)
        elif algo == "grpo":
            res = run_grpo(model, out, train, held, cfg, checkpoint_dir=out + ".ckpt")
        elif algo == "ppo":
            res = run_ppo(model, out, train, held, cfg, checkpoint_dir=out + ".ckpt")
        else:  # dpo, online_dpo (the config knows which)
            res = run_dpo(model, out, ar.preference_pairs(train, cfg.seed, 1), ar.preference_pairs(held, cfg.seed + 1),
                          cfg, problems=train, held_out=held)
    finally:
        ray.shutdown()
    typer.echo(json.dumps(res, indent=1))
