"""finetune: what most users do first — an existing HF model → SFT on their chat data → DPO, or GRPO,
PPO or online DPO with their reward → evaluate → register → deploy, with lineage from the served
model back to the imported weights and the dataset files.

    python -m raypai.pipelines.finetune                       # a self-contained run: tiny Qwen2-style model + example files
    raypai run pipelines/finetune.py --param model_dir=./my-model --param sft_data=chats.jsonl \\
        --param pref_data=prefs.jsonl --param eval_prompts=held_out.jsonl \\
        --param rewards='["my_pkg.rewards:accuracy"]' --param algorithm=dpo
    raypai lineage --deployment finetune

Data formats (docs/alignment.md): SFT `messages` or `prompt`/`completion`; preference
`prompt`/`chosen`/`rejected`; prompt-only `prompt` + columns for the rewards (e.g. `answer`).
"""

from __future__ import annotations

from raypai import pipeline
from raypai.alignment.algorithms import ALGORITHMS
from raypai.alignment.config import MAX_NEW_TOKENS
from raypai.alignment.steps import alignment_data, evaluate, import_model, sft
from raypai.errors import ConfigError
from raypai.serving.steps import deploy, register

EXAMPLE_REWARD = "raypai.alignment.tasks.arithmetic:exact_match_reward"
# the algorithms that align the SFT model (the registry's rows whose step saves an aligned model)
ALIGNERS = [name for name, a in ALGORITHMS.items() if a.artifact == "aligned_model"]


@pipeline(name="finetune")
def finetune(
    model_dir: str,
    sft_data: str,
    eval_prompts: str,
    pref_data: str = "",
    prompt_data: str = "",
    algorithm: str = "dpo",
    rewards: list | None = None,
    name: str = "finetune",
    sft_config: dict | None = None,
    align_config: dict | None = None,
    metric: str = "held_out_reward",
    max_new_tokens: int = MAX_NEW_TOKENS,  # of the evaluation's greedy answers
    require_improvement: bool = True,
):
    if algorithm not in ALIGNERS:
        raise ConfigError(
            [
                f"algorithm {algorithm!r}: finetune runs one of {', '.join(ALIGNERS)}, on pref_data (preference "
                "rows) or prompt_data with rewards, as the algorithm trains"
            ],
            what="finetune parameters",
        )
    algo = ALGORITHMS[algorithm]
    problems = []
    if (algo.data == "preference" or algo.eval_pairs) and not pref_data:
        problems.append(f"algorithm {algorithm!r} needs pref_data=<preference file>")
    if algo.data == "prompt" and not (prompt_data and rewards):
        problems.append(f"algorithm {algorithm!r} needs prompt_data=<prompt file> and rewards=['pkg.mod:fn']")
    if problems:
        raise ConfigError(problems, what="finetune parameters")
    if metric in ("held_out_reward",) and not rewards:
        raise ConfigError(
            [
                "metric 'held_out_reward' needs rewards=['pkg.mod:fn']; or pick metric='response_nll' "
                "with eval_prompts holding SFT rows"
            ],
            what="finetune parameters",
        )
    base = import_model(path=model_dir, name=f"{name}-base", register_as=f"{name}-base")
    chats = alignment_data.named("sft_data")(sft_data, kind="sft", name="sft_data")
    sft_model = sft(base, chats, config=sft_config or {})
    step = algo.load_step()
    if algo.data == "preference" or algo.eval_pairs:
        prefs = alignment_data.named("preference_data")(pref_data, kind="preference", name="preference_data")
    if algo.data == "preference":
        aligned = step(sft_model, prefs, config=align_config or {})
    else:
        prompts = alignment_data.named("prompt_data")(prompt_data, kind="prompt", name="prompt_data")
        pairs = {"eval_pairs": prefs} if algo.eval_pairs else {}
        aligned = step(sft_model, prompts, rewards=rewards, config=align_config or {}, **pairs)
    held = alignment_data.named("eval_data")(
        eval_prompts, kind="sft" if metric == "response_nll" else "prompt", name="eval_data"
    )
    report = evaluate(aligned, sft_model, held, metric=metric, rewards=rewards, max_new_tokens=max_new_tokens)
    # deployed only when the evaluation says the aligned model beats the SFT one (unless told otherwise)
    return deploy(register(aligned, name=name, evaluation=report), name=name, require_promoted=require_improvement)


def example_inputs(folder) -> dict:
    """A tiny Qwen2-style model (ChatML template) and example files in the formats above, written to
    `folder` (no downloads): multi-turn chats with a system turn, preference pairs, prompts + answers."""
    from pathlib import Path

    from raypai.alignment.tasks import arithmetic as ar
    from raypai.alignment.tasks.tiny import build_tiny_model

    folder = Path(folder)
    train, held = ar.split()
    system = {"role": "system", "content": "Answer with the number only."}
    chats = [{"messages": [system, *r["messages"]]} for r in ar.sft_rows(train)]
    chats += [
        {"messages": [system, *a["messages"], *b["messages"]]}
        for a, b in zip(ar.sft_rows(train[:20]), ar.sft_rows(train[20:40]))
    ]  # multi-turn: two sums in one conversation
    return {
        "model_dir": build_tiny_model(folder / "model", family="qwen2", hidden=64),
        "sft_data": ar.write_jsonl(chats, folder / "chats.jsonl"),
        "pref_data": ar.write_jsonl(ar.preference_rows(train, 0, 1), folder / "prefs.jsonl"),
        "prompt_data": ar.write_jsonl(ar.prompt_rows(train), folder / "prompts.jsonl"),
        "eval_prompts": ar.write_jsonl(ar.prompt_rows(held), folder / "held_out_prompts.jsonl"),
        "rewards": [EXAMPLE_REWARD],
    }


def main() -> None:
    """`python -m raypai.pipelines.finetune [--param k=v ...]`: the example inputs under RAYPAI_HOME, then the run."""
    import sys

    from raypai.cli.main import finish_run, parse_params
    from raypai.cli.render import Progress
    from raypai.runner import Runner
    from raypai.settings import Settings

    settings = Settings.load()
    params = {
        **example_inputs(settings.home / "examples" / "finetune"),
        "sft_config": {"steps": 300, "lr": 3e-3},
        "align_config": {"steps": 30},
        **parse_params([a for a in sys.argv[1:] if a not in ("--param", "-p")]),
    }
    finish_run(Runner(settings, progress=Progress()).run(finetune.build(**params), source_file=__file__))


if __name__ == "__main__":
    main()
