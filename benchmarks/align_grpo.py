"""Alignment throughput: raypai (policy, rollout, reference, reward as Ray actors) vs TRL's
single-process trainers, same model, prompts, lengths and CPU, in one run.

    .venv/bin/python benchmarks/align_grpo.py                    # ≈ 10 min on 2 cores; one JSON line per run, then summaries
    .venv/bin/python benchmarks/align_grpo.py --steps 3 --batches 1x8 --rounds 1   # smoke run
    .venv/bin/python benchmarks/align_grpo.py --only dpo

GRPO workload (issue #14): a random-init Llama (vocab 512, hidden 128, 4 layers: 0.79 M parameters)
with raypai's tokenizer and chat template, 64 chat prompts `a+b=` (a, b in 0..49), `--batches`
prompts × group per step (default 1x8 and 8x8), at most 16 new tokens (a random model rarely stops
early, so ≈ 15 on average), β = 0, lr 1e-6, the token-mean (`dapo`) loss, 20 steps; samples/s over
steps 2..20 (step 1 is warm-up on both sides). The reward is the exact-answer rule.
- `raypai_grpo_sync{R}r`: rollout, reward and update one after another (the roles share the cores:
  the working role gets every thread, see docs/alignment.md), with R colocated rollout replicas
  splitting each batch (`--sync-rollout-replicas`, default 1 and 2);
- `raypai_grpo_async`: the next batch is generated while this one trains (one step off-policy);
- `trl_grpo_{N}t`: TRL `GRPOTrainer`, fp32, no gradient checkpointing, same stop tokens, with N
  torch threads (`--trl-threads`, default 1 and 2: on small models one thread can be TRL's fastest
  setting; the baseline is the best of them).
Per-phase split for both: raypai's rollout/reward/train/sync seconds per step, TRL's
generate-and-score vs the rest of its step.

DPO: the same model on preference pairs built from the same sums (chosen = the right answer,
rejected = a wrong one), batch 8 pairs, β 0.1, `--dpo-steps` steps (default 100); pairs/s after the first step,
raypai `run_dpo` (reference log-probs computed once by the Reference actor) vs TRL `DPOTrainer`
(fp32, its reference model in the same process, `precompute_ref_log_probs` on).
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

SPLIT = ("time_rollout", "time_reference", "time_reward", "time_train", "time_sync", "update_seconds")


def emit(row: dict) -> None:
    print(json.dumps(row, default=float), flush=True)


class Steps:
    """A RunLogger stand-in that keeps the per-step metrics of a raypai run."""

    def __init__(self):
        self.rows, self.stamps = [], []

    def log_metrics(self, metrics, step=None):
        if step is not None:
            self.rows.append(metrics)
            self.stamps.append(time.perf_counter())


def workload(n_prompts: int, seed: int):
    import random

    from raypai.alignment.tasks import arithmetic as ar

    items = ar.problems(max_operand=49)
    random.Random(seed).shuffle(items)
    return items[:n_prompts], items[n_prompts : n_prompts + 16]


def run_raypai(
    model_dir: str, out: Path, args, prompts: int, group: int, async_rollout: bool, replicas: int = 1
) -> dict:
    from raypai.alignment import GRPOConfig, run_grpo
    from raypai.alignment.data import prompt_examples
    from raypai.alignment.tasks import arithmetic as ar

    train, held = workload(args.prompts, args.seed)
    log = Steps()
    name = f"raypai_grpo_{'async' if async_rollout else f'sync{replicas}r'}_{prompts}x{group}"
    cfg = GRPOConfig(
        steps=args.steps,
        prompts_per_step=prompts,
        group_size=group,
        lr=1e-6,
        beta=0.0,
        aggregation="dapo",
        max_new_tokens=args.max_new_tokens,
        eval_every=10**6,
        seed=args.seed,
        async_rollout=async_rollout,
        train_threads=args.train_threads,
        rollout_threads=args.rollout_threads,
        rollout_engine=args.rollout_engine,
        compile_rollout=args.compile_rollout,
        rollout_replicas=replicas,
    )
    t0 = time.perf_counter()
    summary = run_grpo(
        model_dir,
        str(out / name),
        prompt_examples(ar.prompt_rows(train)),
        prompt_examples(ar.prompt_rows(held)),
        cfg,
        run_name=name.replace("_", "-"),
        rewards=[(ar.exact_match_reward, 1.0)],
        logger=log,
    )
    steady = log.rows[1:]
    seconds = sum(r["step_seconds"] for r in steady)
    row = {
        "result": name,
        "samples_per_s": sum(r["samples"] for r in steady) / seconds,
        "step_seconds": seconds / len(steady),
        "response_length": sum(r["response_length"] for r in steady) / len(steady),
        "reward_mean": summary["mean_reward_mean"],
        "sync_bytes": summary["sync_bytes"],
        "async_rollout": async_rollout,
        "rollout_engine": args.rollout_engine,
        "compile_rollout": args.compile_rollout,
        "first_step_seconds": log.rows[0]["step_seconds"],
        "rollout_replicas": cfg.rollout_replicas,
        "wall_s_incl_startup": time.perf_counter() - t0,
    }
    row.update({k: sum(r[k] for r in steady) / len(steady) for k in SPLIT})
    return row


def with_threads(n: int, fn):
    """fn() with torch using n threads in this process (TRL runs in the driver), then the old count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def run_trl_grpo(model_dir: str, out: Path, args, prompts: int, group: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from raypai.alignment.tasks import arithmetic as ar
    from raypai.chat import ChatFormat

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.generation_config.eos_token_id = list(ChatFormat(tok).stop_ids)  # the same stop tokens as raypai
    train, _ = workload(args.prompts, args.seed)
    data = Dataset.from_list(ar.prompt_rows(train))  # conversational prompts: TRL applies the chat template

    class Timed(GRPOTrainer):
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

    Timed.gen_seconds = []
    cfg = GRPOConfig(
        output_dir=str(out / f"trl-{prompts}x{group}"),
        per_device_train_batch_size=prompts * group,
        num_generations=group,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        max_completion_length=args.max_new_tokens,
        learning_rate=1e-6,
        beta=0.0,
        loss_type="dapo",
        num_iterations=1,
        temperature=1.0,
        max_steps=args.steps,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = Timed(
        model=model,
        reward_funcs=ar.exact_match_reward,
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Clock()],
    )
    trainer.train()
    steady = len(stamps) - 1
    seconds = stamps[-1] - stamps[0]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    gen = sum(Timed.gen_seconds[1:]) / steady
    return {
        "result": f"trl_grpo_{prompts}x{group}_{_threads()}t",
        "samples_per_s": steady * prompts * group / seconds,
        "step_seconds": seconds / steady,
        "response_length": sum(lengths) / len(lengths),
        "time_generate_and_score": gen,
        "time_rest": seconds / steady - gen,
        "torch_threads": _threads(),
    }


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def pairs(args):
    from raypai.alignment.tasks import arithmetic as ar

    train, _ = workload(args.prompts, args.seed)
    return ar.preference_rows(train, seed=args.seed, per_problem=1)


def run_raypai_dpo(model_dir: str, out: Path, args) -> dict:
    from raypai.alignment import DPOConfig, run_dpo
    from raypai.alignment.data import preference_examples

    rows = preference_examples(pairs(args))
    log = Steps()
    t0 = time.perf_counter()
    run_dpo(
        model_dir,
        str(out / "raypai-dpo"),
        rows,
        rows[:16],
        DPOConfig(steps=args.dpo_steps, batch_size=8, lr=1e-6, beta=0.1),
        run_name="bench-dpo",
        logger=log,
    )
    steady = len(log.stamps) - 1  # timed as TRL's: from the end of step 1 to the end of the last step
    seconds = log.stamps[-1] - log.stamps[0]
    return {
        "result": "raypai_dpo",
        "pairs_per_s": 8 * steady / seconds,
        "step_seconds": seconds / steady,
        "wall_s_incl_startup": time.perf_counter() - t0,
    }


def run_trl_dpo(model_dir: str, out: Path, args) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    data = Dataset.from_list(pairs(args))
    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    cfg = DPOConfig(
        output_dir=str(out / "trl-dpo"),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        learning_rate=1e-6,
        beta=0.1,
        max_steps=args.dpo_steps,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
        disable_tqdm=True,
        precompute_ref_log_probs=True,
    )
    t0 = time.perf_counter()
    DPOTrainer(model=model, args=cfg, train_dataset=data, processing_class=tok, callbacks=[Clock()]).train()
    steady = len(stamps) - 1
    return {
        "result": f"trl_dpo_{_threads()}t",
        "pairs_per_s": 8 * steady / (stamps[-1] - stamps[0]),
        "step_seconds": (stamps[-1] - stamps[0]) / steady,
        "wall_s_incl_startup": time.perf_counter() - t0,
        "torch_threads": _threads(),
    }


TARGETS = {"sync": 1.5, "async": 2.0, "dpo": 1.5}  # issue #14: raypai over TRL's best, at both batch sizes


def summarize(rows: list[dict]) -> list[dict]:
    """Per configuration the median rate over the rounds; per batch size raypai's best synchronous
    and its async configuration against TRL's best thread count, and the DPO ratio."""
    import statistics

    med: dict[str, float] = {}
    for name in dict.fromkeys(r["result"] for r in rows):
        vals = [r.get("samples_per_s", r.get("pairs_per_s")) for r in rows if r["result"] == name]
        med[name] = statistics.median(vals)
    out = []
    for batch in dict.fromkeys(f"{r['prompts_per_step']}x{r['group']}" for r in rows if "group" in r):
        trl = {k: v for k, v in med.items() if k.startswith(f"trl_grpo_{batch}_")}
        sync = {k: v for k, v in med.items() if k.startswith("raypai_grpo_sync") and k.endswith(f"_{batch}")}
        if not trl or not sync:
            continue
        base, best_sync = max(trl, key=trl.get), max(sync, key=sync.get)
        row = {
            "result": f"summary_grpo_{batch}",
            "rounds": len([r for r in rows if r["result"] == base]),
            "trl_best": base,
            "trl_samples_per_s": trl[base],
            "raypai_sync_best": best_sync,
            "sync_samples_per_s": sync[best_sync],
            "sync_vs_trl": sync[best_sync] / trl[base],
        }
        if f"raypai_grpo_async_{batch}" in med:
            row.update(
                async_samples_per_s=med[f"raypai_grpo_async_{batch}"],
                async_vs_trl=med[f"raypai_grpo_async_{batch}"] / trl[base],
            )
        row.update(sync_target=TARGETS["sync"], async_target=TARGETS["async"])
        out.append(row)
    trl_dpo = {k: v for k, v in med.items() if k.startswith("trl_dpo_")}
    if trl_dpo and "raypai_dpo" in med:
        base = max(trl_dpo, key=trl_dpo.get)
        out.append(
            {
                "result": "summary_dpo",
                "trl_best": base,
                "trl_pairs_per_s": trl_dpo[base],
                "raypai_pairs_per_s": med["raypai_dpo"],
                "dpo_vs_trl": med["raypai_dpo"] / trl_dpo[base],
                "dpo_target": TARGETS["dpo"],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=64, help="size of the prompt pool")
    ap.add_argument("--batches", default="1x8,8x8", help="prompts x group per step, comma-separated")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    # 100: a DPO step of this model takes 20-40 ms, so 20 steps timed half a second on each side,
    # where this shared 2-vCPU machine's slow spells moved the ratio by ±10 % between rounds
    ap.add_argument("--dpo-steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("grpo", "dpo"), default=None)
    ap.add_argument("--train-threads", type=int, default=0, help="raypai GRPOConfig.train_threads (0: placement's)")
    ap.add_argument("--rollout-threads", type=int, default=0, help="raypai GRPOConfig.rollout_threads (0: placement's)")
    ap.add_argument(
        "--rollout-engine", default="raypai", choices=("raypai", "hf", "vllm"), help="raypai GRPOConfig.rollout_engine"
    )
    ap.add_argument(
        "--compile-rollout",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="raypai GRPOConfig.compile_rollout (the compile lands in step 1, which is reported as "
        "first_step_seconds and left out of the steady state on both sides)",
    )
    ap.add_argument(
        "--sync-rollout-replicas",
        default="1,2",
        help="rollout replicas of the synchronous runs, comma-separated: one run each (colocated "
        "replicas split the batch and the cores)",
    )
    ap.add_argument("--modes", default="sync,async", help="raypai GRPO runs: sync, async or both")
    ap.add_argument("--no-trl", action="store_true", help="raypai rows only")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="every configuration this many times, interleaved; the summary lines take medians",
    )
    ap.add_argument(
        "--trl-threads",
        default="1,2",
        help="torch threads of the TRL runs, comma-separated: one run each (the baseline is TRL's best of them)",
    )
    args = ap.parse_args()

    import ray

    from raypai.alignment.tasks.tiny import build_tiny_model

    out = Path(tempfile.mkdtemp(prefix="align-bench-"))
    model = build_tiny_model(out / "model", hidden=128, layers=4, heads=4, kv_heads=2, vocab_size=512, seed=args.seed)
    common = {"steps": args.steps, "max_new_tokens": args.max_new_tokens, "cpus": os.cpu_count()}
    from raypai.runtime import ensure_ray
    from raypai.settings import Settings

    ensure_ray(Settings.load(), local=True, num_cpus=8, dashboard=False, log_to_driver=False)
    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        emit(row)

    try:
        # rounds: every configuration once per round, so a slow spell of the shared machine hits all
        # of them; the summary takes each configuration's median over the rounds
        for rnd in range(1, args.rounds + 1):
            if args.only in (None, "grpo"):
                for batch in args.batches.split(","):
                    prompts, group = map(int, batch.split("x"))
                    modes = args.modes.split(",")
                    runs = [
                        lambda r=int(r): run_raypai(model, out, args, prompts, group, False, r)
                        for r in args.sync_rollout_replicas.split(",")
                        if "sync" in modes
                    ]
                    if "async" in modes:
                        runs.append(lambda: run_raypai(model, out, args, prompts, group, True))
                    if not args.no_trl:  # TRL at each thread count: its best is the baseline
                        runs += [
                            lambda n=int(n): with_threads(n, lambda: run_trl_grpo(model, out, args, prompts, group))
                            for n in args.trl_threads.split(",")
                        ]
                    for fn in runs:
                        record(
                            {
                                **fn(),
                                **common,
                                "round": rnd,
                                "prompts_per_step": prompts,
                                "group": group,
                                "train_threads": args.train_threads,
                                "rollout_threads": args.rollout_threads,
                                "load_avg_1m": os.getloadavg()[0],
                            }
                        )
            if args.only in (None, "dpo"):
                runs = [lambda: run_raypai_dpo(model, out, args)]
                if not args.no_trl:
                    runs += [
                        lambda n=int(n): with_threads(n, lambda: run_trl_dpo(model, out, args))
                        for n in args.trl_threads.split(",")
                    ]
                for fn in runs:
                    record(
                        {
                            **fn(),
                            "round": rnd,
                            "dpo_steps": args.dpo_steps,
                            "cpus": os.cpu_count(),
                            "load_avg_1m": os.getloadavg()[0],
                        }
                    )
        for row in summarize(rows):
            emit(row)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
