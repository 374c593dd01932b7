"""What every alignment driver does before and after its loop: check the inputs before any actor
starts (`rl_inputs`), place the roles, export the trained model and shut the roles down (`Run`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import ray

from raypai.alignment.models import check_causal_lm, check_prompts, format_and_limit
from raypai.alignment.placement import Placement
from raypai.alignment.ranks import RankGroup, failures, rendezvous
from raypai.alignment.rewards import resolve
from raypai.errors import ConfigError


class RankFailure(RuntimeError):
    """A run ended because one of a role's ranks died or failed (the message names it)."""


@dataclass
class RLInputs:
    fmt: object  # raypai.chat.ChatFormat of the policy's tokenizer
    trunc: object  # raypai.alignment.models' truncation policy and counter
    reward_fns: list  # resolved (fn, weight) pairs
    use_rm: bool  # a reward model is scored in
    pad_id: int


def check_lora(model_dir: str, cfg) -> None:
    """A LoRA config checked against the model before any actor starts: its target modules exist,
    the base is not quantized to 4 bits (QLoRA is not supported)."""
    spec = cfg.lora()
    if spec is None:
        return
    from transformers import AutoConfig

    from raypai.alignment.lora import check

    problems = check(AutoConfig.from_pretrained(model_dir), spec, what=f"model {model_dir}")
    if problems:
        raise ConfigError(problems, what="LoRA")


def check_plan(algo: str, model_dir: str, cfg, reward_model_dir: str | None = None) -> None:
    """The run's memory plan (`raypai.alignment.plan`), before any actor starts: a ConfigError naming
    the role that does not fit its ranks' memory and the config changes that would make it fit."""
    from raypai.alignment.plan import check

    check(algo, model_dir, cfg, reward_model_dir=reward_model_dir)


def sync_path(cfg) -> dict:
    """`start_sync`'s keywords: `shared` (a LoRA trainer hands its replicas the adapters alone, a few
    MB at most, through the object store, each replica merging them into weights of its own; None:
    per replica) and `transport` for replicas on other nodes (`Sampling.weight_transport`)."""
    return {"shared": False if cfg.lora() else None, "transport": getattr(cfg, "weight_transport", "object_store")}


class BaseOf:
    """A LoRA run's reference: the policy's own base weights with the adapters off (`Trainer.base_*`),
    called like a Reference actor (`ref.logprobs.remote(batch)`), with no second copy of the model."""

    def __init__(self, policy):
        self.logprobs = policy.base_logprobs
        self.logprobs_on = policy.base_logprobs_on
        self.pair_logprobs_on = policy.base_pair_logprobs_on


def rl_inputs(
    algo: str,
    model_dir: str,
    cfg,
    train: list,
    held_out: list,
    *,
    rewards=None,
    reward_model_dir: str | None = None,
) -> RLInputs:
    """The checks of a run that samples from prompts (GRPO, PPO, online DPO), all before any actor
    starts: a causal LM, a reward, training and held-out prompts that fit with `max_new_tokens`."""
    check_causal_lm(model_dir)
    reward_fns = resolve(rewards)
    use_rm = bool(reward_model_dir and getattr(cfg, "reward_model_weight", 0.0))
    if not reward_fns and not use_rm:
        fix = "and/or a reward model with reward_model_weight > 0" if algo != "online DPO" else "to rank them"
        raise ConfigError(
            [f"{algo} needs a reward: pass rewards=['my_pkg.rewards:fn'] (or callables) {fix}"], what=f"{algo} inputs"
        )
    if not train or not held_out:
        raise ConfigError(
            [
                f"{algo} needs training and held-out prompts (got {len(train or [])} and {len(held_out or [])}): "
                "pass prompt examples, e.g. raypai.alignment.data.load('prompts.jsonl', 'prompt')"
            ],
            what=f"{algo} inputs",
        )
    check_lora(model_dir, cfg)
    fmt, trunc = format_and_limit(model_dir, cfg)
    check_prompts(fmt, train, trunc, cfg.max_new_tokens, "training prompt")
    check_prompts(fmt, held_out, trunc, cfg.max_new_tokens, "held-out prompt")
    return RLInputs(fmt, trunc, reward_fns, use_rm, fmt.tok.pad_token_id)


def resume_state(
    algo: str, checkpoint_dir: str | None, rng, policy, rollouts: list, critic=None, **sync
) -> tuple[int, dict]:
    """Restore a run from `checkpoint_dir` when it holds one (every role, the driver's RNG; the
    replicas get the restored weights). Returns the step to continue from (0: a fresh run) and the
    `extra` the checkpoint was saved with (`checkpoint.save_run`), with `sync_setup_seconds` added.
    Every RL loop passes here before its first step, and the weight sync is set up now, while the
    roles are idle: the sync learns where the trainer and the replicas run
    (`sync.locate`), and a first round hands the replicas the trainer's weights (the restored ones
    on a resume), so the shared buffer is made and mapped (live replicas bind to the trainer's pages)
    here and not inside step 1's `sync_seconds`, which was 100× a later step's (a mapping and page
    faults, against a version check or a copy into mapped pages)."""
    from raypai.alignment.checkpoint import load_run_state
    from raypai.alignment.sync import locate, sync_weights

    locate([policy, *rollouts])
    start, extra = 0, {}
    if checkpoint_dir:
        start, extra = load_run_state(checkpoint_dir, rng=rng, policy=policy, rollouts=rollouts, critic=critic)
    setup = sync_weights(policy, rollouts, **sync)["sync_seconds"]  # `sync_path`'s keywords
    if start:
        print(f"[raypai.{algo}] resumed from {checkpoint_dir} at step {start}", flush=True)
    return start, {**extra, "sync_setup_seconds": setup}


def sync_dtype(cfg, model_dir: str) -> str | None:
    """The dtype a trainer hands its weights to the rollout replicas in: theirs (bf16 in a bf16 run,
    `Resources.precision`), None for the trainer's own fp32."""
    return "bfloat16" if cfg.dtype(model_dir) == "bfloat16" else None


class Run:
    """A driver's roles, from placement to shutdown:

        with Run("grpo", specs, colocate=..., logger=logger) as run:
            policy = run.place_policy(model_dir, cfg, ...)
            ...
            return run.finish(policy, out_dir, "grpo", cfg, summary, lineage)

    `finish` exports the trained model (an HF folder with raypai.json: algorithm, config, metrics,
    lineage); leaving the block shuts every role down, then logs the summary (once the run ended
    without an error)."""

    def __init__(
        self, run_name: str, specs: dict, *, colocate: tuple = (), logger=None, gpus: float = 0, placement="colocated"
    ):
        self.placement = Placement(run_name, specs, colocate=colocate, gpus=gpus, placement=placement)
        self.logger = logger
        self.summary: dict | None = None
        self.groups: list[RankGroup] = []

    def place(self, role: str, cls, *args, **kwargs) -> list:
        return self.placement.place(role, cls, *args, **kwargs)

    def place_ranks(self, role: str, cls, *args, timeout_s: float = 60.0, **kwargs):
        """`role` as its spec's `replicas` ranks of `cls` (each told its rank and where the ranks
        meet): one actor handle for one rank, else a RankGroup called like one. Each rank works with
        its own bundle's CPUs (`threads`)."""
        n = self.placement.specs[role].replicas
        if n == 1:
            [actor] = self.place(role, cls, *args, **kwargs)
            return actor
        name = f"{self.placement.run_name}/{role}"
        rv, store = rendezvous(name, n, timeout_s)
        if "threads" in kwargs:
            kwargs["threads"] = max(1, int(self.placement.specs[role].cpus))
        actors = self.place(role, cls, *args, rendezvous=rv, per_replica=lambda i: {"rank": i}, **kwargs)
        group = RankGroup(name, actors, store)
        self.groups.append(group)
        return group

    def place_trained(self, role: str, model_dir: str, lr: float, cfg, **kwargs):
        """A trained role (the policy, the critic, a reward model): a Trainer of `cfg`'s ZeRO stage,
        seed, LoRA and scale settings, as `cfg.ranks` ranks."""
        from raypai.alignment.roles import Trainer

        return self.place_ranks(
            role,
            Trainer,
            model_dir,
            lr,
            cfg.zero_stage,
            cfg.seed,
            lora=cfg.lora(),
            micro_batch=cfg.micro_batch,
            activation_checkpointing=cfg.activation_checkpointing,
            offload_optimizer=cfg.offload_optimizer,
            timeout_s=cfg.collective_timeout_s,
            compute_dtype=cfg.dtype(model_dir),
            **kwargs,
        )

    def place_policy(self, model_dir: str, cfg, **kwargs):
        """The policy's Trainer, with the config's learning rate, ZeRO stage and seed."""
        return self.place_trained("policy", model_dir, cfg.lr_of(cfg.lr), cfg, **kwargs)

    def place_reference(self, model_dir: str, cfg, policy, **kwargs):
        """The frozen reference: a Reference actor (`cfg.reference_ranks` of them, each scoring a
        share of the rows), or with LoRA the policy's base (`BaseOf`)."""
        from raypai.alignment.roles import Reference

        if cfg.lora():
            return BaseOf(policy)
        if cfg.reference_zero3:
            kwargs["zero3"] = True
        kwargs.setdefault("dtype", cfg.dtype(model_dir))
        return self.place_ranks("reference", Reference, model_dir, timeout_s=cfg.collective_timeout_s, **kwargs)

    def place_sampling(
        self, model_dir: str, cfg, inputs: RLInputs, reward_model_dir: str | None, *, device: str, **rollout
    ) -> tuple[list, object]:
        """The rollout replicas (each its own sampling seed, so they draw different samples) and the
        Reward actor (rule rewards, and the reward model when `inputs.use_rm`)."""
        from raypai.alignment.roles import Rollout

        rollouts = self.place(
            "rollout",
            Rollout,
            model_dir,
            engine=cfg.rollout_engine,
            compiled=cfg.compile_rollout,
            device=device,
            dtype=cfg.dtype(model_dir),
            gpu_share=self.placement.share["rollout"],  # of each of its GPUs
            # a replica over several GPUs (rollout_tensor_parallel): the bundles of its engine's workers
            per_replica=lambda i: {"seed": cfg.seed + i, **self.placement.tensor_parallel("rollout", i)},
            **rollout,
        )
        rm = reward_model_dir if inputs.use_rm else None
        reward = self.place_reward(cfg, inputs.reward_fns, rm, cfg.reward_model_weight)
        return rollouts, reward

    def place_reward(self, cfg, *args):
        """The Reward role: `cfg.reward_ranks` ranks, each scoring a share of the rows."""
        from raypai.alignment.roles import Reward

        return self.place_ranks("reward", Reward, *args, timeout_s=cfg.collective_timeout_s)

    def finish(self, trained, out_dir: str, algorithm: str, cfg, summary: dict, lineage: dict | None) -> dict:
        """Export the trained model (and with LoRA its adapter, to `out_dir` + "-adapter"); the summary
        gains the trainable and total parameter counts and each model role's ranks (`ranks_policy`, ...)."""
        summary = {**summary, **ray.get(trained.param_counts.remote())}
        # the ranks of each role (rollout replicas are not ranks of one group: `rollout_replicas`)
        summary.update({f"ranks_{r}": s.replicas for r, s in self.placement.specs.items() if r != "rollout"})
        meta = {"algorithm": algorithm, "config": asdict(cfg), "metrics": summary, "lineage": lineage or {}}
        ray.get(trained.export.remote(out_dir, meta))
        self.summary = summary
        return summary

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        found = failures(self.groups) if exc_type is not None and self.groups else []
        self.placement.shutdown()
        if found:
            raise RankFailure(
                f"run {self.placement.run_name!r} failed: " + "; ".join(found) + ". Re-run it with the same "
                "checkpoint_dir to resume from its last checkpoint (a rank that keeps failing: see its log "
                "in the Ray dashboard)"
            ) from exc
        if exc_type is None and self.logger is not None and self.summary is not None:
            self.logger.log_metrics(self.summary)
