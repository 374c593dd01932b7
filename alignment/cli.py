"""`raypai align` and `raypai model import`: alignment on the user's own model, data and rewards.

    raypai model import ./Qwen2-0.5B-Instruct --name qwen-base          # an HF folder → artifact store + registry
    raypai model import dpo-adapter/ --base models:/qwen-base@base --name qwen-dpo [--merge]  # a LoRA adapter on it
    raypai align sft --model models:/qwen-base@base --data chats.jsonl --out sft_model/
    raypai align dpo --model sft_model/ --data prefs.jsonl --eval-data prefs_eval.jsonl --out dpo_model/
    raypai align grpo --model sft_model/ --data prompts.jsonl --reward my_pkg.rewards:accuracy=1 \\
        --reward my_pkg.rewards:brevity=0.1 --config grpo.yaml --out grpo_model/   # re-run resumes from OUT.ckpt/
    raypai align grpo --model sft_model/ --config grpo.yaml --plan   # the memory plan per role and rank; no Ray

ALGO is a name in raypai.alignment.algorithms.ALGORITHMS; --config holds the fields of its config
class (SFTConfig, RewardModelConfig, DPOConfig, GRPOConfig, PPOConfig in raypai.alignment.config). The data, the model folder, the reward import
paths and the config are all checked before Ray starts. With LoRA (`lora_r: 16` in --config) the
merged model goes to --out and the adapter beside it, to --out + "-adapter" (dpo_model/ and
dpo_model-adapter/); the printed summary counts the trainable and total parameters. `--plan` prints
the run's memory plan (`raypai.alignment.plan`, docs/scaling.md) and exits 0 when it fits, 2 with the
config changes that would fit when it does not; it needs neither --data nor --out and starts nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from raypai import exits
from raypai.alignment import algorithms as A

model_app = typer.Typer(
    help="Bring existing Hugging Face models into the artifact store and registry.", no_args_is_help=True
)


def align_command(
    algo: str = typer.Argument(..., help=" | ".join(A.ALGORITHMS)),
    model: str = typer.Option(..., "--model", help="HF model folder or models:/NAME@ALIAS"),
    data: Optional[str] = typer.Option(
        None, "--data", help="JSONL/Parquet file or folder, or a save_to_disk folder (required unless --plan)"
    ),
    out: Optional[Path] = typer.Option(
        None, "--out", help="where the aligned model is written (required unless --plan)"
    ),
    eval_data: Optional[str] = typer.Option(None, "--eval-data", help="held-out data (default: a split)"),
    reward: List[str] = typer.Option([], "--reward", help="pkg.mod:fn[=weight], repeatable"),
    reward_model: Optional[str] = typer.Option(None, "--reward-model", help="reward model folder"),
    pairs: Optional[str] = typer.Option(None, "--eval-pairs", help="online_dpo: held-out preference pairs"),
    config: Optional[Path] = typer.Option(None, help="YAML/JSON with the algorithm's options"),
    eval_fraction: float = typer.Option(0.1, help="held out when --eval-data is not given"),
    plan: Annotated[
        bool, typer.Option("--plan", help="print the memory plan per role and rank, and exit (2 if it does not fit)")
    ] = False,
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
    if not plan:  # a plan needs the model and the config only
        needs = [f"raypai align needs {flag}" for flag, value in (("--data", data), ("--out", out)) if value is None]
        if entry.eval_pairs and not pairs:
            needs.append(f"{algo} needs --eval-pairs (held-out preference pairs to measure)")
        if needs:
            raise ConfigError(needs, what="raypai align")
    settings = Settings.load()
    model_dir = resolve_model(model, settings.mlflow_tracking_uri, cache_dir=settings.home / "cache" / "models")
    if plan:
        _print_plan(algo, model_dir, cfg, reward_model)
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
    written = {"model": str(out)}
    if cfg.lora():  # the merged model in --out, the adapter beside it (trainable_params/total_params in res)
        from raypai.alignment.lora import adapter_folder

        written["adapter"] = adapter_folder(out)
    typer.echo(json.dumps({**written, **res}, indent=1, default=str))


def _print_plan(algo: str, model_dir: str, cfg, reward_model: str | None):
    """`--plan`: the memory plan printed; exit 0 when it fits, REFUSED (its fixes printed) when not."""
    from raypai.alignment.models import check_causal_lm
    from raypai.alignment.plan import plan

    check_causal_lm(model_dir)
    p = plan(algo, model_dir, cfg, reward_model_dir=reward_model)
    typer.echo(p.table())
    raise typer.Exit(exits.OK if p.fits else exits.REFUSED)


@model_app.command("import")
def import_command(
    path: Path = typer.Argument(..., help="an HF causal-LM folder, or with --base a LoRA adapter (PEFT) folder"),
    name: str = typer.Option(..., "--name", help="registered model name"),
    alias: Optional[str] = typer.Option(
        None, help="registry alias set on the new version (default: base; with --base: adapter; with --merge: merged)"
    ),
    base: Optional[str] = typer.Option(
        None, "--base", help="models:/NAME@ALIAS: PATH is a LoRA adapter of this registered model"
    ),
    merge: bool = typer.Option(
        False, "--merge", help="with --base: register the base with the adapter merged in (servable)"
    ),
):
    """Copy an HF model folder into the artifact store and register it (a lineage root); with --base,
    a LoRA adapter on a registered base model (its lineage reaches the base), or with --merge the
    merged model that raypai serves."""
    from raypai.alignment import adapters
    from raypai.alignment.models import check_causal_lm
    from raypai.alignment.steps import adapter_import, model_import
    from raypai.cli.render import Progress
    from raypai.errors import ConfigError
    from raypai.runner import Runner
    from raypai.settings import Settings

    settings = Settings.load()
    what = "raypai model import"
    if base is None:  # everything is checked before Ray starts
        if merge:
            raise ConfigError(
                ["--merge merges a LoRA adapter into its base: pass --base models:/NAME@ALIAS"], what=what
            )
        if adapters.is_adapter(path):
            raise ConfigError(
                [
                    f"{str(path)!r} is a LoRA adapter, not a model: pass --base models:/NAME@ALIAS, the registered "
                    "model it was trained on"
                ],
                what=what,
            )
        check_causal_lm(path, "imported")
        alias = alias or "base"
        dag = model_import.build(path=str(path.absolute()), name=name, alias=alias)
    else:
        alias = alias or ("merged" if merge else "adapter")
        base_art, pinned = _adapter_base(path, base, settings)
        dag = adapter_import.build(
            path=str(path.absolute()), base_model=base_art, base_uri=pinned, name=name, alias=alias, merge=merge
        )
    result = Runner(settings, progress=Progress()).run(dag)
    if not result.ok:
        raise typer.Exit(1)
    art = result.result
    shown = {
        "model": name,
        "alias": alias,
        "artifact_id": art.id,
        "digest": art.digest,
        "uri": f"models:/{name}@{alias}",
    }
    if base is not None:
        shown.update(base=pinned, merged=merge, kind="merged model" if merge else "lora adapter")
    typer.echo(json.dumps(shown, indent=1))


def _adapter_base(path: Path, base: str, settings) -> tuple:
    """The registered base of an adapter: (its model artifact, its version as models:/NAME/VERSION).
    One ConfigError when `base` is not a model registered by raypai, or `path` is not a LoRA adapter
    whose tensors fit the base's layers."""
    from raypai.alignment import adapters
    from raypai.alignment.models import _split_uri
    from raypai.errors import ConfigError, NotFoundError
    from raypai.runtime import tracker
    from raypai.store import MetadataStore
    from raypai.tracking import ADAPTER_OF_TAG, ARTIFACT_TAG

    def refuse(problem: str):
        return ConfigError([problem], what="raypai model import --base")

    if not base.startswith("models:/"):
        raise refuse(f"--base {base!r} is not a registered model: pass models:/NAME@ALIAS")
    name, _, ref = _split_uri(base)
    registry = tracker(settings)
    try:
        version, tags = registry.resolve_model(name, ref)
    except NotFoundError:
        raise refuse(
            f"the adapter's base {base} is not registered: register the base model first "
            f"(`raypai model import BASE_DIR --name {name}`), then its adapters on it"
        ) from None
    pinned = f"models:/{name}/{version}"
    if tags.get(ADAPTER_OF_TAG):
        raise refuse(
            f"--base {base} is itself a LoRA adapter (on {tags[ADAPTER_OF_TAG]}): pass the model it applies to"
        )
    try:
        artifact = MetadataStore(settings.database_url).get_artifact(tags.get(ARTIFACT_TAG) or "")
    except NotFoundError:
        raise refuse(
            f"the adapter's base {base} was registered outside raypai (its version has no {ARTIFACT_TAG} tag, or "
            "this raypai home does not hold that artifact): import its folder with `raypai model import BASE_DIR "
            f"--name {name}` and pass that as --base"
        ) from None
    base_dir = registry.download_model(name, version, cache_dir=settings.home / "cache" / "models")
    problems = adapters.check(path, base_dir, pinned)
    if problems:
        raise ConfigError(problems, what="raypai model import --base")
    return artifact, pinned


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
