"""`raypai align` and `raypai model import`: alignment on the user's own model, data and rewards.

    raypai model import ./Qwen2-0.5B-Instruct --name qwen-base          # an HF folder → artifact store + registry
    raypai align sft --model models:/qwen-base@base --data chats.jsonl --out sft_model/
    raypai align dpo --model sft_model/ --data prefs.jsonl --eval-data prefs_eval.jsonl --out dpo_model/
    raypai align grpo --model sft_model/ --data prompts.jsonl --reward my_pkg.rewards:accuracy=1 \\
        --reward my_pkg.rewards:brevity=0.1 --config grpo.yaml --out grpo_model/   # re-run resumes from OUT.ckpt/

ALGO is a name in raypai.alignment.algorithms.ALGORITHMS; --config holds the fields of its config
class (SFTConfig, RewardModelConfig, DPOConfig, GRPOConfig, PPOConfig in raypai.alignment.config). The data, the model folder, the reward import
paths and the config are all checked before Ray starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from raypai.alignment import algorithms as A

model_app = typer.Typer(
    help="Bring existing Hugging Face models into the artifact store and registry.", no_args_is_help=True
)


def align_command(
    algo: str = typer.Argument(..., help=" | ".join(A.ALGORITHMS)),
    model: str = typer.Option(..., "--model", help="HF model folder or models:/NAME@ALIAS"),
    data: str = typer.Option(..., "--data", help="JSONL/Parquet file or folder, or a save_to_disk folder"),
    out: Path = typer.Option(..., "--out", help="where the aligned model is written"),
    eval_data: Optional[str] = typer.Option(None, "--eval-data", help="held-out data (default: a split)"),
    reward: List[str] = typer.Option([], "--reward", help="pkg.mod:fn[=weight], repeatable"),
    reward_model: Optional[str] = typer.Option(None, "--reward-model", help="reward model folder"),
    pairs: Optional[str] = typer.Option(None, "--eval-pairs", help="online_dpo: held-out preference pairs"),
    config: Optional[Path] = typer.Option(None, help="YAML/JSON with the algorithm's options"),
    eval_fraction: float = typer.Option(0.1, help="held out when --eval-data is not given"),
):
    """Align a model on your data (policy, reference, reward, critic as Ray actors)."""
    from raypai.alignment import config as C
    from raypai.alignment import data as D
    from raypai.alignment.models import resolve_model
    from raypai.alignment.rewards import resolve
    from raypai.errors import ConfigError
    from raypai.settings import Settings

    # everything is validated before Ray starts
    entry = A.get(algo, what="raypai align")
    cfg = C.from_dict(algo, _read_config(config) if config else {})
    given = {"--reward": reward, "--reward-model": reward_model, "--eval-pairs": pairs}
    takes = {"--reward": entry.rewards, "--reward-model": entry.reward_model, "--eval-pairs": entry.eval_pairs}
    unused = [f"{algo} takes no {flag}; leave it out" for flag, value in given.items() if value and not takes[flag]]
    if unused:
        raise ConfigError(unused, what="raypai align")
    if entry.eval_pairs and not pairs:
        raise ConfigError([f"{algo} needs --eval-pairs (held-out preference pairs to measure)"], what="raypai align")
    settings = Settings.load()
    model_dir = resolve_model(model, settings.mlflow_tracking_uri, cache_dir=settings.home / "cache" / "models")
    train = D.load(data, entry.data)
    held = D.load(eval_data, entry.data) if eval_data else None
    if held is None:
        train, held = D.split(train, eval_fraction, cfg.seed)
    rewards = resolve(reward)
    eval_pairs = D.load(pairs, "preference") if pairs else None

    import ray

    from raypai.runtime import ensure_ray

    ensure_ray(settings)  # joins raypai's recorded Ray head when one runs, else a local Ray
    try:
        res = A.run(
            algo,
            model_dir,
            str(out),
            train,
            held,
            cfg,
            rewards=rewards,
            reward_model_dir=reward_model,
            eval_pairs=eval_pairs,
            checkpoint_dir=f"{out}.ckpt",  # a re-run resumes from it
        )
    finally:
        ray.shutdown()
    typer.echo(json.dumps(res, indent=1, default=str))


@model_app.command("import")
def import_command(
    path: Path = typer.Argument(..., help="an HF causal-LM folder (config.json, weights, tokenizer)"),
    name: str = typer.Option(..., "--name", help="registered model name"),
    alias: str = typer.Option("base", help="registry alias set on the new version"),
):
    """Copy an HF model folder into the artifact store and register it (a lineage root)."""
    from raypai.alignment.models import check_causal_lm
    from raypai.alignment.steps import model_import
    from raypai.cli.render import Progress
    from raypai.runner import Runner
    from raypai.settings import Settings

    check_causal_lm(path, "imported")  # before Ray starts
    result = Runner(Settings.load(), progress=Progress()).run(
        model_import.build(path=str(path.absolute()), name=name, alias=alias)
    )
    if not result.ok:
        raise typer.Exit(1)
    art = result.result
    typer.echo(
        json.dumps(
            {
                "model": name,
                "alias": alias,
                "artifact_id": art.id,
                "digest": art.digest,
                "uri": f"models:/{name}@{alias}",
            },
            indent=1,
        )
    )


def _read_config(path: Path) -> dict:
    """A YAML or JSON options file as a dict; one clear error when it is neither or not a mapping."""
    import yaml

    from raypai.errors import ConfigError

    text = path.read_text()
    try:
        values = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            [f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'} ({exc})"], what="--config file"
        ) from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(
            [f"{path}: expected a mapping of options (e.g. `steps: 100`), got a {type(values).__name__}"],
            what="--config file",
        )
    return values
