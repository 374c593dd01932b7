"""tinychat: raw text → cleaned data → tokenizer → token shards → pretrained model → SFT → reward
model → GRPO (or PPO, DPO, online DPO) → evaluation → registry → a deployed, OpenAI-compatible endpoint — with
lineage from every answer back to the raw files.

    make demo                                              # everything below, from a bare machine
    ray start --head --num-cpus 8                          # a Ray that outlives the driver (keeps the endpoint up)
    RAY_ADDRESS=auto raypai run pipelines/tinychat.py      # or: python -m raypai.pipelines.tinychat
    RAY_ADDRESS=auto raypai run pipelines/tinychat.py --param algorithm=dpo --param pretrain_steps=400
    raypai submit pipelines/tinychat.py --address http://HEAD:8265   # on a cluster, through the Ray Jobs API
    raypai lineage --deployment tinychat
"""

from __future__ import annotations

import dataclasses
import functools

from raypai import pipeline
from raypai.alignment.algorithms import ALGORITHMS
from raypai.alignment.config import RewardModelConfig, SFTConfig, from_dict
from raypai.alignment.steps import arithmetic_data, evaluate, reward_model, sft
from raypai.data.steps import clean, ingest, source, synth_corpus, tokenize, train_tokenizer
from raypai.errors import ConfigError
from raypai.serving.steps import deploy, register
from raypai.train.steps import pretrain

# the algorithms that align the SFT model (the registry's rows whose step saves an aligned model)
ALIGNERS = [name for name, a in ALGORITHMS.items() if a.artifact == "aligned_model"]
EXACT_MATCH = "raypai.alignment.tasks.arithmetic:exact_match_reward"  # the demo's reward, by import path


@pipeline(name="tinychat")
def tinychat(
    raw_dir: str = "",
    docs: int = 3000,
    vocab_size: int = 2048,
    block_size: int = 128,
    layers: int = 2,
    hidden: int = 128,
    pretrain_steps: int = 200,
    workers: int = 2,
    sft_steps: int = 600,
    sft_lr: float = 1e-3,
    ptx_coef: float = 1.0,
    rm_steps: int = 300,
    align_steps: int = 40,
    algorithm: str = "grpo",
    name: str = "tinychat",
    seed: int = 0,
    require_improvement: bool = True,
):
    if algorithm not in ALIGNERS:
        raise ConfigError(
            [f"algorithm {algorithm!r} is not available in tinychat; choose one of {', '.join(ALIGNERS)}"],
            what="tinychat parameters",
        )
    raw = source(raw_dir) if raw_dir else synth_corpus(docs=docs, seed=seed)
    dataset = clean(ingest(raw))
    tokenizer = train_tokenizer(dataset, vocab_size=vocab_size)
    shards = tokenize(dataset, tokenizer, block_size=block_size)
    base = pretrain(
        shards,
        tokenizer,
        steps=pretrain_steps,
        layers=layers,
        hidden=hidden,
        intermediate=hidden * 2,
        heads=4,
        kv_heads=2,
        workers=workers,
        zero_stage=2,
        checkpoint_every=max(10, pretrain_steps // 4),
        eval_every=max(10, pretrain_steps // 4),
        seed=seed,
        register_as=f"{name}-base",
    )
    # the arithmetic task as datasets (recorded, so lineage reaches the alignment data too)
    data = {
        f"{kind}_{split}": arithmetic_data.named(f"{kind}_{split}_data")(kind=kind, split=split, seed=seed)
        for kind in ("sft", "prompt")
        for split in ("train", "eval")
    }
    sft_train, sft_eval, prompts, held_prompts = (
        data["sft_train"],
        data["sft_eval"],
        data["prompt_train"],
        data["prompt_eval"],
    )
    # pretraining blocks mixed into SFT (ptx) keep it from erasing what pretraining learned
    sft_model = sft(
        base,
        sft_train,
        sft_eval,
        config=SFTConfig(steps=sft_steps, lr=sft_lr, ptx_coef=ptx_coef, seed=seed),
        ptx_shards=shards,
    )
    algo = ALGORITHMS[algorithm]
    every = max(1, align_steps // 4)
    # the demo's settings, each given to the algorithms whose config has the field: 4 new tokens
    # hold the answer; the reward mixes the exact-match rule and a trained reward model (0.2), which
    # also starts PPO's critic
    demo = {
        "steps": align_steps,
        "seed": seed,
        "prompts_per_step": 16,
        "reward_model_weight": 0.2,
        "max_new_tokens": 4,
        "eval_every": every,
        "checkpoint_every": every,
    }
    fields = {f.name for f in dataclasses.fields(algo.config)}
    config = from_dict(algorithm, {k: v for k, v in demo.items() if k in fields})

    @functools.cache  # one dataset node per split, however many inputs read it
    def preferences(split: str):
        return arithmetic_data.named(f"preference_{split}_data")(kind="preference", split=split, seed=seed)

    step = algo.load_step()
    if algo.data == "preference":
        aligned = step(sft_model, preferences("train"), preferences("eval"), config=config)
    else:
        inputs = {"rewards": [EXACT_MATCH], "eval_prompts": held_prompts}
        if algo.reward_model:
            inputs["reward_model"] = reward_model(
                sft_model,
                preferences("train"),
                preferences("eval"),
                config=RewardModelConfig(steps=rm_steps, seed=seed),
            )
        if algo.eval_pairs:
            inputs["eval_pairs"] = preferences("eval")
        aligned = step(sft_model, prompts, config=config, **inputs)
    # the demo's metric: held-out exact match = mean exact-match reward of greedy answers
    evaluation = evaluate(
        aligned,
        sft_model,
        held_prompts,
        metric="held_out_reward",
        rewards=[EXACT_MATCH],
        max_new_tokens=demo["max_new_tokens"],
        shards=shards,
    )
    registered = register(aligned, name=name, evaluation=evaluation)
    # deployed only when the aligned model beats the SFT one on held-out exact match (unless told otherwise)
    return deploy(registered, name=name, require_promoted=require_improvement)


def main() -> None:
    """`python -m raypai.pipelines.tinychat [--param k=v ...]`: run, then print how to use the result."""
    import sys

    from raypai.cli.main import finish_run, parse_params
    from raypai.cli.render import Progress
    from raypai.pipelines._demo_summary import demo_token, print_summary
    from raypai.runner import Runner
    from raypai.settings import Settings

    params = parse_params([a for a in sys.argv[1:] if a not in ("--param", "-p")])
    settings = Settings.load()
    result = Runner(settings, progress=Progress()).run(tinychat.build(**params), source_file=__file__)
    try:
        finish_run(result)
    finally:
        if result.ok:
            print_summary(settings, result, token=demo_token(settings, result))


if __name__ == "__main__":
    main()
