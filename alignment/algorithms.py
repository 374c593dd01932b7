"""The alignment algorithms, in one table that the CLI (`raypai align`), the pipeline steps, the
configs (`from_dict`) and the pipelines read: adding an algorithm is a row here, its config, its
driver and its step.

    from raypai.alignment.algorithms import ALGORITHMS, run
    ALGORITHMS["grpo"].config                   # GRPOConfig
    run("grpo", "sft/", "grpo/", train, held, GRPOConfig(), rewards=["my_pkg.rewards:accuracy"])

Drivers and steps are named by import path ("module:function") and imported when used, so the table
(and every pipeline definition that reads it) imports no torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from raypai.alignment.config import DPOConfig, GRPOConfig, PPOConfig, RewardModelConfig, SFTConfig
from raypai.errors import ConfigError


@dataclass(frozen=True)
class Algorithm:
    config: type  # its config class (`raypai.alignment.config`)
    data: str  # what it trains on: sft | preference | prompt (`raypai.alignment.data.KINDS`)
    driver: str  # "module:function" that runs it: (model_dir, out_dir, train, held_out, cfg, **inputs) -> metrics
    step: str  # "module:function" of its pipeline step
    artifact: str  # name of the model artifact its step saves
    rewards: bool = False  # scores its samples with reward functions (`rewards=['pkg.mod:fn']`)
    reward_model: bool = False  # can add a trained reward model to them (`reward_model_dir`)
    eval_pairs: bool = False  # measured on held-out preference pairs besides its held-out prompts
    checkpoints: bool = False  # checkpoints as it goes and resumes from them (`checkpoint_dir`)
    implies: dict = field(default_factory=dict)  # config values its name sets (online DPO: online=True)

    def load_driver(self):
        return _load(self.driver)

    def load_step(self):
        return _load(self.step)


# in the order a pipeline meets them: SFT, the reward model, then the aligners (GRPO, the demo's, first)
ALGORITHMS = {
    "sft": Algorithm(
        config=SFTConfig,
        data="sft",
        driver="raypai.alignment.sft:run_sft",
        step="raypai.alignment.steps:sft",
        artifact="sft_model",
        checkpoints=True,
    ),
    "reward_model": Algorithm(
        config=RewardModelConfig,
        data="preference",
        driver="raypai.alignment.reward_model:train_reward_model",
        step="raypai.alignment.steps:reward_model",
        artifact="reward_model",
        checkpoints=True,
    ),
    "grpo": Algorithm(
        config=GRPOConfig,
        data="prompt",
        driver="raypai.alignment.grpo:run_grpo",
        step="raypai.alignment.steps:grpo",
        artifact="aligned_model",
        rewards=True,
        reward_model=True,
        checkpoints=True,
    ),
    "ppo": Algorithm(
        config=PPOConfig,
        data="prompt",
        driver="raypai.alignment.ppo:run_ppo",
        step="raypai.alignment.steps:ppo",
        artifact="aligned_model",
        rewards=True,
        reward_model=True,
        checkpoints=True,
    ),
    "dpo": Algorithm(
        config=DPOConfig,
        data="preference",
        driver="raypai.alignment.dpo:run_dpo",
        step="raypai.alignment.steps:dpo",
        artifact="aligned_model",
        checkpoints=True,
    ),
    "online_dpo": Algorithm(
        config=DPOConfig,
        data="prompt",
        driver="raypai.alignment.online_dpo:run_online_dpo",
        step="raypai.alignment.steps:online_dpo",
        artifact="aligned_model",
        rewards=True,
        eval_pairs=True,
        checkpoints=True,
        implies={"online": True},
    ),
}


def get(name: str, *, what: str = "alignment algorithm") -> Algorithm:
    """The table's row for `name`, or a ConfigError listing the valid names."""
    if name not in ALGORITHMS:
        raise ConfigError([f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}"], what=what)
    return ALGORITHMS[name]


def run(
    name: str,
    model_dir: str,
    out_dir: str,
    train: list,
    held_out: list,
    cfg,
    *,
    rewards=None,
    reward_model_dir: str | None = None,
    eval_pairs: list | None = None,
    checkpoint_dir: str | None = None,
    **options,
) -> dict:
    """Run algorithm `name`'s driver on `train`/`held_out` (examples of its data kind) and return its
    metrics. Of `rewards`, `reward_model_dir`, `eval_pairs` and `checkpoint_dir` it is handed those
    its row says it takes; `options` (run_name, logger, lineage, SFT's ptx_blocks) go to it as given."""
    algo = get(name)
    if algo.rewards:
        options["rewards"] = list(rewards or [])
    if algo.reward_model:
        options["reward_model_dir"] = reward_model_dir
    if algo.eval_pairs:
        options["eval_pairs"] = eval_pairs
    if algo.checkpoints:
        options["checkpoint_dir"] = checkpoint_dir
    return algo.load_driver()(model_dir, out_dir, train, held_out, cfg, **options)


def _load(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


__all__ = ["ALGORITHMS", "Algorithm", "get", "run"]
