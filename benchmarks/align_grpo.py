"""GRPO throughput and time split: raypai (policy, rollout, reference, reward as Ray actors) vs
TRL's single-process `GRPOTrainer`, same tiny model, prompts, group size, lengths and CPU, same run.

    .venv/bin/python benchmarks/align_grpo.py                  # ≈ 3-4 min on 2 cores; one JSON line per result
    .venv/bin/python benchmarks/align_grpo.py --steps 20 --prompts 8 --group 8
    .venv/bin/python benchmarks/align_grpo.py --quality        # before/after figures of every algorithm (≈ 5 min)

Both sides start from the same SFT'd tiny Llama (so completions end with the chat end token), use
the exact-answer rule reward, β = 0 (no reference pass, TRL's default), μ = 1, the `dapo` token-mean
loss, `prompts × group` completions of at most `--max-new-tokens` tokens per optimizer step.
raypai's actors run 1 torch thread each; TRL runs once per `--trl-threads` value (1 = per-core
comparison; 2 = TRL owning both cores).
samples/s is steady state: the first step (DeepSpeed/TRL warm-up) is excluded on both sides.
`raypai_grpo_async` repeats raypai with `async_rollout=True` (the next batch is generated while this
one trains: one step off-policy, the ratio taken against the sampling weights' log-probs).
`raypai_beta` repeats raypai with β = 0.04 so the reference actor works every step.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

SPLIT = ("time_rollout", "time_reference", "time_reward", "time_train", "time_sync")


def emit(row: dict) -> None:
    print(json.dumps(row, default=float), flush=True)


class Steps:
    """A RunLogger stand-in that keeps the per-step metrics of a raypai run."""

    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step=None):
        if step is not None:
            self.rows.append(metrics)


def run_raypai(sft_dir: str, out: Path, args, beta: float, name: str, async_rollout: bool = False) -> dict:
    from raypai.alignment import GRPOConfig, run_grpo
    from raypai.alignment.tasks import arithmetic as ar

    train, held = ar.split()
    log = Steps()
    cfg = GRPOConfig(steps=args.steps, prompts_per_step=args.prompts, group_size=args.group, lr=5e-4, beta=beta,
                     aggregation="dapo", max_new_tokens=args.max_new_tokens, eval_every=10**6, seed=args.seed,
                     async_rollout=async_rollout)
    summary = run_grpo(sft_dir, str(out / name), train, held, cfg, run_name=name, logger=log)
    steady = log.rows[1:]
    seconds = sum(r["step_seconds"] for r in steady)
    row = {"result": name, "samples_per_s": sum(r["samples"] for r in steady) / seconds,
           "step_seconds": seconds / len(steady), "response_length": sum(r["response_length"] for r in steady) / len(steady),
           "reward_mean": summary["mean_reward_mean"], "sync_seconds": sum(r["sync_seconds"] for r in steady) / len(steady),
           "sync_bytes": summary["sync_bytes"], "async_rollout": async_rollout,
           "clip_fraction": sum(r["clip_fraction"] for r in steady) / len(steady)}
    row.update({k: sum(r[k] for r in steady) / len(steady) for k in SPLIT})
    return row


def run_trl(sft_dir: str, out: Path, args, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from raypai.alignment._tensors import END, chat_prompt
    from raypai.alignment.tasks import arithmetic as ar

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(sft_dir)
    model = AutoModelForCausalLM.from_pretrained(sft_dir)
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids(END), tok.eos_token_id]  # same stop tokens
    train, _ = ar.split()
    data = Dataset.from_list([{"prompt": chat_prompt(tok, p.prompt), "answer": p.answer} for p in train])

    class Timed(GRPOTrainer):
        """Splits TRL's step into generation+scoring and the rest (the update)."""
        gen_seconds: list = []

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self.gen_seconds.append(time.perf_counter() - t0)

    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    cfg = GRPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=args.prompts * args.group,
                     num_generations=args.group, steps_per_generation=1, gradient_accumulation_steps=1,
                     max_completion_length=args.max_new_tokens, learning_rate=5e-4, beta=0.0, loss_type="dapo",
                     num_iterations=1, temperature=1.0, max_steps=args.steps, use_cpu=True, bf16=False,
                     report_to=[], logging_steps=1, save_strategy="no", seed=args.seed, disable_tqdm=True)
    trainer = Timed(model=model, reward_funcs=ar.exact_match_reward, args=cfg, train_dataset=data,
                    processing_class=tok, callbacks=[Clock()])
    trainer.train()
    seconds = stamps[-1] - stamps[0]
    steady = args.steps - 1
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    gen = sum(Timed.gen_seconds[1:]) / steady
    return {"result": f"trl_grpo_trainer_{threads}thread", "samples_per_s": steady * args.prompts * args.group / seconds,
            "step_seconds": seconds / steady, "response_length": sum(lengths) / len(lengths),
            "reward_mean": sum(rewards) / len(rewards), "time_generate_and_score": gen,
            "time_update": seconds / steady - gen}


def quality(sft_dir: str, base_dir: str, out: Path, args) -> None:
    """Before/after figures of every algorithm on held-out data, from one real run each."""
    from raypai.alignment import (DPOConfig, GRPOConfig, PPOConfig, RewardModelConfig, run_dpo, run_grpo, run_ppo,
                                  train_reward_model)
    from raypai.alignment.tasks import arithmetic as ar

    train, held = ar.split()
    rm = train_reward_model(sft_dir, str(out / "rm"), ar.preference_pairs(train, 0, 3), ar.preference_pairs(train, 7, 1),
                            RewardModelConfig(steps=300, lr=2e-3, batch_size=32), run_name="q-rm")
    emit({"result": "quality_reward_model", "held_out_pair_accuracy_before": rm["rm_eval_accuracy_before"],
          "held_out_pair_accuracy_after": rm["rm_eval_accuracy"]})
    d = run_dpo(sft_dir, str(out / "dpo"), ar.preference_pairs(train, 0, 1), ar.preference_pairs(held, 7, 1),
                DPOConfig(steps=40, lr=5e-4), run_name="q-dpo")
    emit({"result": "quality_dpo", **d})
    o = run_dpo(sft_dir, str(out / "odpo"), [], ar.preference_pairs(held, 7, 1),
                DPOConfig(steps=40, batch_size=16, lr=5e-4, online=True, num_samples=4, max_new_tokens=3),
                problems=train, held_out=held, run_name="q-odpo")
    emit({"result": "quality_online_dpo", **o})
    g = run_grpo(sft_dir, str(out / "grpo"), train, held, GRPOConfig(steps=60, prompts_per_step=16, group_size=8,
                 lr=5e-4, aggregation="dapo", max_new_tokens=3, eval_every=20), run_name="q-grpo")
    emit({"result": "quality_grpo", **{k: g[k] for k in ("eval_accuracy_before", "eval_accuracy_after",
                                                          "mean_reward_mean", "samples_per_s")}})
    p = run_ppo(sft_dir, str(out / "ppo"), train, held, PPOConfig(steps=40, prompts_per_step=16, max_new_tokens=3,
                eval_every=20), reward_model_dir=str(out / "rm"), run_name="q-ppo")
    emit({"result": "quality_ppo", **{k: p[k] for k in ("eval_accuracy_before", "eval_accuracy_after",
                                                         "mean_reward_mean", "mean_value_loss", "samples_per_s")}})
    p = run_ppo(sft_dir, str(out / "ppo_rule"), train, held, PPOConfig(steps=40, prompts_per_step=16, max_new_tokens=3,
                eval_every=20), run_name="q-ppo-rule")
    emit({"result": "quality_ppo_rule_only", **{k: p[k] for k in ("eval_accuracy_before", "eval_accuracy_after",
                                                                   "mean_reward_mean", "mean_value_loss")}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--sft-steps", type=int, default=450)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-threads", default="1,2", help="torch thread counts to run TRL with (raypai: 1 per actor)")
    ap.add_argument("--quality", action="store_true", help="before/after accuracy of every algorithm instead")
    args = ap.parse_args()

    import ray

    from raypai.alignment import SFTConfig, run_sft
    from raypai.alignment.evaluate import accuracy
    from raypai.alignment.tasks import arithmetic as ar
    from raypai.alignment.tasks.tiny import build_tiny_model

    out = Path(tempfile.mkdtemp(prefix="align-bench-"))
    base = build_tiny_model(out / "base", seed=args.seed)
    train, held = ar.split()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        t0 = time.perf_counter()
        s = run_sft(base, str(out / "sft"), ar.sft_rows(train), ar.sft_rows(held),
                    SFTConfig(steps=args.sft_steps, lr=3e-3, seed=args.seed), run_name="bench-sft")
        emit({"result": "quality_sft", **s, "held_out_accuracy_base": accuracy(base, held),
              "held_out_accuracy_sft": accuracy(out / "sft", held), "seconds": time.perf_counter() - t0})
        if args.quality:
            quality(str(out / "sft"), base, out, args)
            return
        common = {"steps": args.steps, "prompts": args.prompts, "group": args.group,
                  "max_new_tokens": args.max_new_tokens, "cpus": os.cpu_count()}
        emit({**run_raypai(str(out / "sft"), out, args, 0.0, "raypai_grpo"), **common})
        emit({**run_raypai(str(out / "sft"), out, args, 0.0, "raypai_grpo_async", async_rollout=True), **common})
        for threads in map(int, args.trl_threads.split(",")):
            emit({**run_trl(str(out / "sft"), out, args, threads), **common, "trl_threads": threads})
        emit({**run_raypai(str(out / "sft"), out, args, 0.04, "raypai_grpo_beta"), **common})
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
