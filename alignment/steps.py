"""Pipeline steps for alignment on the user's own model, data and rewards:
alignment_data, arithmetic_data, sft, reward_model, dpo, online_dpo, grpo, ppo, evaluate.

    data = alignment_data("chats.jsonl", kind="sft")          # the user's files → a dataset artifact (lineage)
    prefs = alignment_data("prefs.jsonl", kind="preference")
    sft_model = sft(base, data, config=SFTConfig(steps=200))
    aligned = dpo(sft_model, prefs, config=DPOConfig(beta=0.1))
    report = evaluate(aligned, sft_model, prompts, metric="held_out_reward", rewards=["my_pkg.rewards:accuracy"])

Model steps take model Artifacts (HF folders), dataset Artifacts and the algorithm's typed config
(a dataclass or a plain dict of its fields) and return a model Artifact whose metadata holds the
run's metrics and parent ids. Without `eval_data`, a seeded `eval_fraction` of the data is held out.
With LoRA (`lora_r` > 0 in the config) a model step has a second output, "adapter" (`step["adapter"]`
in a pipeline): the LoRA adapter, whose base is the step's input model; the step's own output stays
the merged model.

    adapter = import_adapter(path="dpo-adapter/", base_model=base, register_as="qwen-dpo")  # a PEFT folder
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from raypai import Artifact, StepContext, pipeline, step
from raypai.alignment import algorithms as A
from raypai.alignment import config as C
from raypai.alignment import data as D

ROWS_FILE = "rows.jsonl"


def _cfg(algo: str, value):
    """The algorithm's config from a dataclass (checked when it was built), a dict of its fields, or
    None (defaults); with the values the algorithm's name implies (online DPO: online=True)."""
    if value is None or isinstance(value, dict):
        return C.from_dict(algo, value or {})
    entry = A.get(algo)
    if not isinstance(value, entry.config):
        from raypai.errors import ConfigError

        raise ConfigError(
            [f"the {algo} step takes a {entry.config.__name__} or a dict of its fields (got {type(value).__name__})"],
            what=f"{algo} step",
        )
    if any(getattr(value, k) != v for k, v in entry.implies.items()):
        value = dataclasses.replace(value, **entry.implies)
    return value


def _examples(data: Artifact, eval_data: Artifact | None, kind: str, eval_fraction: float, seed: int):
    train = D.load(data, kind, name=f"dataset {data.name}")
    if eval_data is not None:
        return train, D.load(eval_data, kind, name=f"dataset {eval_data.name}")
    return D.split(train, eval_fraction, seed)


def _train(ctx: StepContext, algo: str, model: Artifact, train, held, cfg, parents: dict, **inputs):
    """What every model step does: run the algorithm's driver (`algorithms.run`) on `model` into the
    step's output folder, then log the metrics and save the model artifact, its lineage `parents`.
    With LoRA (`lora_r` > 0) the step has two outputs: "output", the merged model (what the next step
    or a deploy takes, as without LoRA), and "adapter", the adapter itself (PEFT format) with `model`
    as its base; each names the other in its metadata."""
    entry = A.get(algo)
    lineage = {k: a.id for k, a in parents.items() if a is not None}
    out = ctx.output_dir(algo)
    metrics = A.run(
        algo,
        str(model.local_path()),
        str(out),
        train,
        held,
        cfg,
        run_name=f"{algo}-{ctx.step_run_id[:8]}",
        logger=_StepLogger(ctx, cfg.steps),
        lineage=lineage,
        checkpoint_dir=str(ctx.work_dir("checkpoints")) if entry.checkpoints else None,
        **inputs,
    )
    ctx.log_metrics(metrics)
    meta = {"metrics": metrics, "parents": lineage}
    spec = cfg.lora()
    if spec is None:
        return ctx.save(out, kind="model", name=entry.artifact, metadata=meta)
    from raypai.alignment.lora import adapter_folder

    role = next(k for k, a in parents.items() if a is model)
    adapter = ctx.save(
        adapter_folder(out),
        kind="model",
        name=f"{entry.artifact}_adapter",
        metadata={
            "lora_adapter": {"r": spec.r, "alpha": spec.alpha, "target_modules": list(spec.target_modules)},
            "base_model": model.id,  # the adapter applies to this artifact's weights
            "metrics": metrics,
            "parents": {role: model.id},
        },
    )
    merged = ctx.save(out, kind="model", name=entry.artifact, metadata={**meta, "adapter": adapter.id})
    return {"output": merged, "adapter": adapter}


def _on_examples(ctx: StepContext, algo: str, model: Artifact, model_role: str, data, eval_data, config, eval_fraction):
    """A model step that trains on rows of the algorithm's data kind (SFT, reward model, DPO)."""
    cfg = _cfg(algo, config)
    train, held = _examples(data, eval_data, A.get(algo).data, eval_fraction, cfg.seed)
    return _train(ctx, algo, model, train, held, cfg, {model_role: model, "data": data, "eval_data": eval_data})


def _on_prompts(
    ctx: StepContext,
    algo: str,
    sft_model: Artifact,
    prompts: Artifact,
    eval_prompts: Artifact | None,
    config,
    eval_fraction: float,
    *,
    rewards: list[str] | None,
    reward_model: Artifact | None = None,
    eval_pairs: Artifact | None = None,
) -> Artifact | dict:
    """A model step that samples from prompt rows, scored by `rewards` (online DPO, GRPO, PPO)."""
    cfg = _cfg(algo, config)
    if reward_model is None and getattr(cfg, "reward_model_weight", 0):
        cfg = dataclasses.replace(cfg, reward_model_weight=0.0)  # no reward model to weigh
    train, held = _examples(prompts, eval_prompts, "prompt", eval_fraction, cfg.seed)
    inputs = {
        "rewards": list(rewards or []),
        "reward_model_dir": str(reward_model.local_path()) if reward_model else None,
        "eval_pairs": D.load(eval_pairs, "preference", name=f"dataset {eval_pairs.name}") if eval_pairs else None,
    }
    parents = {
        "sft_model": sft_model,
        "reward_model": reward_model,
        "prompts": prompts,
        "eval_pairs": eval_pairs,
        "eval_prompts": eval_prompts,
    }
    return _train(ctx, algo, sft_model, train, held, cfg, parents, **inputs)


class _StepLogger:
    """The step's MLflow logger that also moves the run display's summary line (`ctx.progress`)
    whenever the driver loop logs a step's metrics. The loops log their summary (no step) once,
    after the last step: the line then says total/total, not the last step logged (e.g. 580/600
    with metrics every 20 steps)."""

    def __init__(self, ctx: StepContext, total: int):
        self.logger, self.report, self.total = ctx.logger, ctx.progress_reporter(), total

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        if self.logger is not None:
            self.logger.log_metrics(metrics, step=step)
        self.report(self.total if step is None else step, self.total, "steps")


@step(cpus=0.25, paths=("path",))  # by content: an edited file re-runs this step and what it feeds
def alignment_data(ctx: StepContext, path: str, kind: str = "sft", name: str = "") -> Artifact:
    """The user's alignment data (JSONL/Parquet file or folder, any pyarrow filesystem URI, or a
    `datasets.save_to_disk` folder), validated as `kind` (sft | preference | prompt) and committed as
    a dataset artifact whose lineage reaches the source files."""
    if kind not in D.KINDS:
        from raypai.errors import ConfigError

        raise ConfigError([f"kind {kind!r} is unknown; choose one of {', '.join(D.KINDS)}"], what="alignment_data")
    rows = D.load_rows(path)
    D.KINDS[kind](rows, path)  # validated now: a bad row fails this step, naming it
    if "://" not in path and Path(path).exists():
        ctx.register_source(path)
    out = ctx.output_dir("data")
    (out / ROWS_FILE).write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    meta = {"kind": kind, "rows": len(rows), "columns": sorted(rows[0]), "source": path}
    (out / "manifest.json").write_text(json.dumps(meta, indent=1))
    ctx.log_metrics({"rows": len(rows)})
    return ctx.save(out, kind="dataset", name=name or f"{kind}_data", metadata=meta)


@step(cpus=0.25)
def arithmetic_data(
    ctx: StepContext, kind: str = "sft", split: str = "train", chat: bool = True, seed: int = 0
) -> Artifact:
    """The demo's single-digit addition task as a dataset artifact (sft | preference | prompt rows;
    the held-out split never overlaps the training one)."""
    from raypai.alignment.tasks import arithmetic as ar

    train, held = ar.split(seed=seed)
    items = train if split == "train" else held
    rows = {
        "sft": lambda: ar.sft_rows(items, chat),
        "prompt": lambda: ar.prompt_rows(items, chat),
        "preference": lambda: ar.preference_rows(
            items, seed + (0 if split == "train" else 7), 3 if split == "train" else 1, chat
        ),
    }[kind]()
    out = ctx.output_dir("data")
    ar.write_jsonl(rows, out / ROWS_FILE)
    meta = {
        "kind": kind,
        "rows": len(rows),
        "columns": sorted(rows[0]),
        "source": "raypai arithmetic task",
        "split": split,
    }
    (out / "manifest.json").write_text(json.dumps(meta, indent=1))
    return ctx.save(out, kind="dataset", name=f"arithmetic_{kind}_{split}", metadata=meta)


@step(cpus=0.5)
def sft(
    ctx: StepContext,
    base_model: Artifact,
    data: Artifact,
    eval_data: Artifact | None = None,
    config: C.SFTConfig | dict | None = None,
    eval_fraction: float = 0.1,
    ptx_shards: Artifact | None = None,
) -> Artifact | dict:
    """SFT on `data` (messages or prompt/completion rows). `ptx_shards` (token shards) with
    config.ptx_coef > 0 mixes pretraining blocks into every step so SFT keeps what pretraining learned."""
    cfg = _cfg("sft", config)
    train, held = _examples(data, eval_data, "sft", eval_fraction, cfg.seed)
    blocks = None
    if ptx_shards is not None and cfg.ptx_coef > 0:
        from raypai.train.data import load_blocks

        _, blocks = load_blocks(ptx_shards.local_path(), "train")
    parents = {"base_model": base_model, "data": data, "eval_data": eval_data, "ptx_shards": ptx_shards}
    return _train(ctx, "sft", base_model, train, held, cfg, parents, ptx_blocks=blocks)


@step(cpus=0.5)
def reward_model(
    ctx: StepContext,
    sft_model: Artifact,
    data: Artifact,
    eval_data: Artifact | None = None,
    config: C.RewardModelConfig | dict | None = None,
    eval_fraction: float = 0.1,
) -> Artifact | dict:
    """A Bradley–Terry reward model (scalar head on the SFT model) from preference rows."""
    return _on_examples(ctx, "reward_model", sft_model, "sft_model", data, eval_data, config, eval_fraction)


@step(cpus=0.5)
def dpo(
    ctx: StepContext,
    sft_model: Artifact,
    data: Artifact,
    eval_data: Artifact | None = None,
    config: C.DPOConfig | dict | None = None,
    eval_fraction: float = 0.1,
) -> Artifact | dict:
    """Offline DPO (sigmoid / IPO / hinge, label smoothing) on preference rows."""
    return _on_examples(ctx, "dpo", sft_model, "sft_model", data, eval_data, config, eval_fraction)


@step(cpus=0.5, import_paths=("rewards",))  # an edited reward function re-runs the step
def online_dpo(
    ctx: StepContext,
    sft_model: Artifact,
    prompts: Artifact,
    eval_pairs: Artifact,
    rewards: list[str] | None = None,
    eval_prompts: Artifact | None = None,
    config: C.DPOConfig | dict | None = None,
    eval_fraction: float = 0.1,
) -> Artifact | dict:
    """Online DPO: `num_samples` completions per prompt ranked by `rewards` (import paths), best vs
    worst; preference accuracy measured on `eval_pairs`."""
    return _on_prompts(
        ctx,
        "online_dpo",
        sft_model,
        prompts,
        eval_prompts,
        config,
        eval_fraction,
        rewards=rewards,
        eval_pairs=eval_pairs,
    )


@step(cpus=0.5, import_paths=("rewards",))  # an edited reward function re-runs the step
def grpo(
    ctx: StepContext,
    sft_model: Artifact,
    prompts: Artifact,
    rewards: list[str] | None = None,
    reward_model: Artifact | None = None,
    eval_prompts: Artifact | None = None,
    config: C.GRPOConfig | dict | None = None,
    eval_fraction: float = 0.1,
) -> Artifact | dict:
    """GRPO on prompt rows with `rewards` (import paths 'pkg.mod:fn[=weight]'; extra columns of the
    rows reach them) plus the reward model, weighted by config.reward_model_weight, when given."""
    return _on_prompts(
        ctx, "grpo", sft_model, prompts, eval_prompts, config, eval_fraction, rewards=rewards, reward_model=reward_model
    )


@step(cpus=0.5, import_paths=("rewards",))  # an edited reward function re-runs the step
def ppo(
    ctx: StepContext,
    sft_model: Artifact,
    prompts: Artifact,
    rewards: list[str] | None = None,
    reward_model: Artifact | None = None,
    eval_prompts: Artifact | None = None,
    config: C.PPOConfig | dict | None = None,
    eval_fraction: float = 0.1,
) -> Artifact | dict:
    """PPO with a critic (initialised from the reward model when given), `rewards` and the reward model."""
    return _on_prompts(
        ctx, "ppo", sft_model, prompts, eval_prompts, config, eval_fraction, rewards=rewards, reward_model=reward_model
    )


@step(cpus=0.5, import_paths=("rewards",))  # an edited reward function re-runs the step
def evaluate(
    ctx: StepContext,
    candidate: Artifact,
    baseline: Artifact,
    data: Artifact,
    metric: str = "held_out_reward",
    rewards: list[str] | None = None,
    reward_model: Artifact | None = None,
    max_new_tokens: int = C.MAX_NEW_TOKENS,
    min_delta: float = 0.0,
    shards: Artifact | None = None,
) -> dict:
    """Candidate vs baseline on held-out `data` in the metric the user names — held_out_reward
    (prompt rows + `rewards`), response_nll (SFT rows), rm_win_rate (prompt rows + `reward_model`),
    perplexity (`shards`). Returns {metric, candidate, baseline, improved, ...}; `improved` gates
    registration aliases and deployment. With `shards`, held-out perplexity of both is reported too."""
    from raypai.alignment import evaluate as E
    from raypai.alignment.rewards import resolve
    from raypai.errors import ConfigError

    if metric not in E.METRICS:
        raise ConfigError([f"metric {metric!r} is unknown; choose one of {', '.join(E.METRICS)}"], what="evaluate")
    cand, base = candidate.local_path(), baseline.local_path()
    res: dict = {"metric": metric}
    if metric == "held_out_reward":
        fns = resolve(rewards)
        if not fns:
            raise ConfigError(["metric held_out_reward needs rewards=['pkg.mod:fn']"], what="evaluate")
        prompts = D.load(data, "prompt", name=f"dataset {data.name}")
        res.update(
            candidate=E.held_out_reward(cand, prompts, fns, max_new_tokens),
            baseline=E.held_out_reward(base, prompts, fns, max_new_tokens),
        )
    elif metric == "response_nll":
        ex = D.load(data, "sft", name=f"dataset {data.name}")
        res.update(candidate=E.response_nll(cand, ex), baseline=E.response_nll(base, ex))
    elif metric == "rm_win_rate":
        if reward_model is None:
            raise ConfigError(["metric rm_win_rate needs reward_model=<reward model artifact>"], what="evaluate")
        prompts = D.load(data, "prompt", name=f"dataset {data.name}")
        res.update(
            candidate=E.rm_win_rate(cand, base, reward_model.local_path(), prompts, max_new_tokens), baseline=0.5
        )
    if shards is not None:
        res.update(
            ppl_candidate=E.perplexity(cand, shards.local_path()), ppl_baseline=E.perplexity(base, shards.local_path())
        )
        if metric == "perplexity":
            res.update(candidate=res["ppl_candidate"], baseline=res["ppl_baseline"])
    elif metric == "perplexity":
        raise ConfigError(["metric perplexity needs shards=<token shards artifact>"], what="evaluate")
    res["improved"] = E.decide(metric, res["candidate"], res["baseline"], min_delta)
    ctx.log_metrics({k: float(v) for k, v in res.items() if isinstance(v, (int, float, bool))})
    return res


@step(cpus=0.25, paths=("path",))  # re-exported weights in the same folder: a new model artifact
def import_model(ctx: StepContext, path: str, name: str = "", register_as: str = "", alias: str = "base") -> Artifact:
    """An existing HF causal-LM folder (weights + tokenizer) → a model artifact whose lineage root is
    the source folder, registered in the MLflow registry as `register_as` (with `alias`) when given,
    so it can be aligned, evaluated and deployed like a model trained here."""
    from raypai.alignment.models import check_causal_lm

    check_causal_lm(path, "imported")
    src = ctx.register_source(path, name=name or None)
    art = ctx.save(path, kind="model", name=name or Path(path).name, metadata={"imported_from": str(path)})
    if register_as:
        version = ctx.register_model(art, register_as, {"source": src}, alias=alias or None)
        ctx.log_metrics({"registered_version": version})
    return art


@step(cpus=0.25, paths=("path",))
def import_adapter(
    ctx: StepContext,
    path: str,
    base_model: Artifact,
    base_uri: str = "",
    name: str = "",
    register_as: str = "",
    alias: str = "adapter",
    merge: bool = False,
) -> Artifact | dict:
    """A LoRA adapter folder (PEFT format) → a model artifact whose lineage has `base_model` (the
    registered base it applies to) and the source folder; checked against the base first (a folder
    that is no PEFT adapter, or whose tensors do not fit the base's layers, is refused). Registered as
    `register_as` when given, tagged with its base (`raypai.tracking.ADAPTER_OF_TAG`: `base_uri`, the
    base's registry version as models:/NAME/VERSION, else its artifact id). `merge`: the
    base with the adapter merged in is saved too, and it is what is registered: a plain HF folder
    that raypai serves (an adapter alone is not deployed). Returns the adapter, or with `merge`
    {"output": merged model, "adapter": adapter}."""
    from raypai.alignment import adapters
    from raypai.errors import ConfigError
    from raypai.tracking import ADAPTER_OF_TAG

    base_dir = base_model.local_path()
    base_uri = base_uri or f"artifact:{base_model.id}"
    problems = adapters.check(path, base_dir, base_uri)
    if problems:
        raise ConfigError(problems, what="adapter")
    src = ctx.register_source(path, name=name or None)
    meta = {
        "lora_adapter": adapters.spec_of(path),
        "base_model": base_model.id,  # the adapter applies to this artifact's weights
        "base_uri": base_uri,
        "imported_from": str(path),
    }
    adapter = ctx.save(path, kind="model", name=name or Path(path).name, metadata=meta)
    if not merge:
        if register_as:
            inputs = {"source": src, "base_model": base_model}
            tags = {ADAPTER_OF_TAG: base_uri}
            version = ctx.register_model(adapter, register_as, inputs, alias=alias or None, local_dir=path, tags=tags)
            ctx.log_metrics({"registered_version": version})
        return adapter
    out = ctx.output_dir("merged")
    adapters.merge(path, base_dir, out)
    merged = ctx.save(
        out,
        kind="model",
        name=f"{name or Path(path).name}-merged",
        metadata={"merged_from": {"adapter": adapter.id, "base_model": base_model.id}, "adapter": adapter.id},
    )
    if register_as:
        inputs = {"source": src, "adapter": adapter, "base_model": base_model}
        version = ctx.register_model(merged, register_as, inputs, alias=alias or None, local_dir=out)
        ctx.log_metrics({"registered_version": version})
    return {"output": merged, "adapter": adapter}


@pipeline(name="adapter-import")
def adapter_import(
    path: str, base_model: Artifact, base_uri: str, name: str, alias: str = "adapter", merge: bool = False
):
    """`raypai model import ADAPTER_DIR --base models:/NAME@ALIAS --name N [--merge]` as a one-step pipeline."""
    return import_adapter(
        path=path, base_model=base_model, base_uri=base_uri, name=name, register_as=name, alias=alias, merge=merge
    )


@pipeline(name="model-import")
def model_import(path: str, name: str, alias: str = "base"):
    """`raypai model import DIR --name NAME` as a one-step pipeline (so the import is a recorded run)."""
    return import_model(path=path, name=name, register_as=name, alias=alias)
