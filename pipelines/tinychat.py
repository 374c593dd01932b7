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

from raypai import pipeline
from raypai.alignment.config import DPOConfig, GRPOConfig, PPOConfig, RewardModelConfig, SFTConfig
from raypai.alignment.steps import arithmetic_data, dpo, evaluate, grpo, online_dpo, ppo, reward_model, sft
from raypai.data.steps import clean, ingest, source, synth_corpus, tokenize, train_tokenizer
from raypai.errors import ConfigError
from raypai.serving.steps import deploy, register
from raypai.train.steps import pretrain

ALGORITHMS = ("grpo", "ppo", "dpo", "online_dpo")
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
    if algorithm not in ALGORITHMS:
        raise ConfigError(
            [f"algorithm {algorithm!r} is not available in tinychat; choose one of {', '.join(ALGORITHMS)}"],
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
    every = max(1, align_steps // 4)
    if algorithm in ("grpo", "ppo"):
        rm = reward_model(
            sft_model,
            arithmetic_data.named("preference_train_data")(kind="preference", split="train", seed=seed),
            arithmetic_data.named("preference_eval_data")(kind="preference", split="eval", seed=seed),
            config=RewardModelConfig(steps=rm_steps, seed=seed),
        )
        if algorithm == "grpo":
            aligned = grpo(
                sft_model,
                prompts,
                rewards=[EXACT_MATCH],
                reward_model=rm,
                eval_prompts=held_prompts,
                config=GRPOConfig(
                    steps=align_steps,
                    prompts_per_step=16,
                    reward_model_weight=0.2,
                    max_new_tokens=4,
                    eval_every=every,
                    checkpoint_every=every,
                    seed=seed,
                ),
            )
        else:  # the critic starts from the reward model; the reward mixes rule and RM (0.2)
            aligned = ppo(
                sft_model,
                prompts,
                rewards=[EXACT_MATCH],
                reward_model=rm,
                eval_prompts=held_prompts,
                config=PPOConfig(
                    steps=align_steps,
                    reward_model_weight=0.2,
                    max_new_tokens=4,
                    eval_every=every,
                    checkpoint_every=every,
                    seed=seed,
                ),
            )
    elif algorithm == "dpo":
        aligned = dpo(
            sft_model,
            arithmetic_data.named("preference_train_data")(kind="preference", split="train", seed=seed),
            arithmetic_data.named("preference_eval_data")(kind="preference", split="eval", seed=seed),
            config=DPOConfig(steps=align_steps, seed=seed),
        )
    else:
        aligned = online_dpo(
            sft_model,
            prompts,
            arithmetic_data.named("preference_eval_data")(kind="preference", split="eval", seed=seed),
            rewards=[EXACT_MATCH],
            eval_prompts=held_prompts,
            config=DPOConfig(steps=align_steps, online=True, max_new_tokens=4, seed=seed),
        )
    # the demo's metric: held-out exact match = mean exact-match reward of greedy answers
    evaluation = evaluate(
        aligned,
        sft_model,
        held_prompts,
        metric="held_out_reward",
        rewards=[EXACT_MATCH],
        max_new_tokens=4,
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
