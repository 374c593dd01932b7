"""Alignment throughput, raypai against TRL, every row in its own process (issue #36 item 4).

    .venv/bin/python benchmarks/align_grpo.py                     # both workloads, every variant, 3 rounds: ≈ 2 h on 2 quiet cores
    .venv/bin/python benchmarks/align_grpo.py --workload compute --variants bf16 --rounds 2       # ≈ 20 min
    .venv/bin/python benchmarks/align_grpo.py --smoke             # every kind of row once, tiny: ≈ 5 min (10 on a loaded machine)
    .venv/bin/python benchmarks/align_grpo.py --workload compute --only grpo --rounds 1
    .venv/bin/python benchmarks/align_grpo.py --workload toy --variants '' --trl-threads 1,2   # headline rows only

The rules (benchmarks/RESULTS.md, "How the alignment figures are measured"):
- each row is a process of its own (`--one '<spec>'`, run by `_harness.run_row`). A raypai row
  starts a local Ray and stops it; a TRL row never imports Ray (`ray_imported: false`). Before
  each row the parent waits for the last row's Ray to exit and records every Ray daemon still
  alive on the machine, anyone's (`ray_processes_at_start`: 0 in an honest row; a `warning` line
  first when Ray was running before the harness began: not a quiet machine);
- two headline rows a side: raypai at its defaults (`GRPOConfig()`/`DPOConfig()` but the
  workload's sizes; `precision="auto"`, bf16 on a CPU with bf16 units, the row's `compute_dtype`
  says which) and raypai with `precision="fp32"`, against TRL fp32 at its best torch thread count
  (`--trl-threads`). `headline_fp32_vs_trl` is fp32 against fp32; `defaults_vs_trl_best` is
  raypai's defaults against TRL's best row of either precision, the figure the targets are for;
- non-default raypai settings are rows of their own, `headline: false` (`--variants`): `async`
  (async_rollout), `sync_2r` (2 colocated rollout replicas), `sync_compiled` (compile_rollout, the
  compile in the row's wall time and first step). `bf16`: TRL `bf16=True` (its autocast) at its
  best fp32 thread count, and raypai `precision="bf16"` where the defaults are not bf16 already;
- every row gives `wall_s` (the parent's clock, process start to exit: imports, model load, Ray
  start and stop, compiles) beside its steady-state rate (steps 2..N; step 1 is warm-up on both
  sides, reported as `first_step_seconds`);
- the summary lines take each row's median over the rounds of this invocation and give raypai/TRL.

Workloads (`--workload toy|compute|both`, `_harness.WORKLOADS`), `a+b=` chat prompts, β = 0,
lr 1e-6, token-mean (`dapo`) loss, temperature 1:
- toy: issue #14's random Llama (0.63 M parameters as built), raypai's tokenizer, `--batches`
  1x8 and 8x8 prompts × samples a step, ≤ 16 new tokens, 20 steps, the exact-answer reward; DPO
  8 pairs a step, 100 steps;
- compute: a 9.8 M-parameter Qwen2 (hidden 256, 6 layers, MLP 1024, vocab 7,600), 8x8, ≤ 64 new
  tokens (a random model of this vocabulary rarely stops), 10 steps, reward = the completion's
  length mod 5 (so groups differ and every update is a real one); DPO 8 pairs a step, 30 steps.
TRL: `GRPOTrainer` (fp32, no gradient checkpointing, the same stop tokens, its generate-and-score
time split from the rest of its step) and `DPOTrainer` (`precompute_ref_log_probs`). raypai:
`run_grpo` (rollout/reward/train/sync seconds per step) and `run_dpo` (reference log-probs once, by
the Reference actor).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import _harness as h  # noqa: E402

SPLIT = ("time_rollout", "time_reference", "time_reward", "time_train", "time_sync", "update_seconds")
# raypai's GRPO rows: "sync" is GRPOConfig's defaults (the headline; `precision="auto"`: bf16 on a
# CPU with bf16 units), "fp32" the same in fp32 (the fp32-against-fp32 row, always run); the others
# are non-default settings, one row each (`--variants`)
VARIANTS = {
    "sync": {},
    "fp32": {"precision": "fp32"},
    "async": {"async_rollout": True},
    "sync_2r": {"rollout_replicas": 2},
    "sync_compiled": {"compile_rollout": True},
    "bf16": {"precision": "bf16"},
}
ALWAYS = ("sync", "fp32")
# raypai over TRL's best at defaults: issue #14 (toy: sync 1.5×, async 2×, DPO 1.5×) and issue #36
# item 5 (compute-bound: sync ≥ 1.5× TRL synchronous)
TARGETS = {"toy": {"sync": 1.5, "async": 2.0, "dpo": 1.5}, "compute": {"sync": 1.5}}


# ---- the rows, each run inside its own process ------------------------------------------------


def row_raypai_grpo(s: dict) -> dict:
    import ray

    from raypai.alignment import GRPOConfig, run_grpo
    from raypai.alignment.data import prompt_examples
    from raypai.alignment.tasks import arithmetic as ar
    from raypai.runtime import ensure_ray
    from raypai.settings import Settings

    t0 = time.perf_counter()
    train, held = h.problems(s["prompts"], s["seed"])
    log = h.Steps()
    cfg = GRPOConfig(
        steps=s["steps"],
        prompts_per_step=s["batch"][0],
        group_size=s["batch"][1],
        lr=1e-6,
        beta=0.0,
        aggregation="dapo",
        max_new_tokens=s["max_new_tokens"],
        eval_every=10**6,
        seed=s["seed"],
        **s["overrides"],
    )
    # a local Ray of this process only (ensure_ray picks free ports: 6379 may be a Redis here)
    ensure_ray(Settings.load(), local=True, num_cpus=8, dashboard=False, log_to_driver=False)
    try:
        ray_up = time.perf_counter() - t0
        summary = run_grpo(
            s["model_dir"],
            str(Path(s["out"]) / s["name"]),
            prompt_examples(ar.prompt_rows(train)),
            prompt_examples(ar.prompt_rows(held[:4])),
            cfg,
            run_name=s["name"].replace("_", "-"),
            rewards=[(h.reward_fn(s["reward"]), 1.0)],
            logger=log,
        )
    finally:
        ray.shutdown()
    steady = log.rows[1:]
    seconds = sum(r["step_seconds"] for r in steady)
    row = {
        "samples_per_s": sum(r["samples"] for r in steady) / seconds,
        "step_seconds": seconds / len(steady),
        "first_step_seconds": log.rows[0]["step_seconds"],
        "response_length": sum(r["response_length"] for r in steady) / len(steady),
        "reward_mean": summary["mean_reward_mean"],
        "sync_bytes": summary["sync_bytes"],
        "ray_start_s": ray_up,
        "in_process_s": h.process_age_s(),
        "config": {
            k: getattr(cfg, k)
            for k in ("async_rollout", "rollout_replicas", "compile_rollout", "rollout_engine", "precision")
        },
        "compute_dtype": cfg.dtype(s["model_dir"]),  # what `precision` chose on this machine
    }
    row.update({k: sum(r[k] for r in steady) / len(steady) for k in SPLIT})
    return row


def _trl_model(s: dict):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(s["threads"])
    tok = AutoTokenizer.from_pretrained(s["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(s["model_dir"], dtype=torch.float32)  # bf16 rows: TRL's autocast
    return tok, model


def _trl_common(s: dict) -> dict:
    return {
        "output_dir": str(Path(s["out"]) / s["name"]),
        "use_cpu": True,
        "bf16": s["dtype"] == "bf16",  # mixed precision (autocast), TRL's own bf16 switch
        "gradient_checkpointing": False,
        "report_to": [],
        "logging_steps": 1,
        "save_strategy": "no",
        "seed": s["seed"],
        "disable_tqdm": True,
        "gradient_accumulation_steps": 1,
        "learning_rate": 1e-6,
    }


def row_trl_grpo(s: dict) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from raypai.alignment.tasks import arithmetic as ar
    from raypai.chat import ChatFormat

    tok, model = _trl_model(s)
    model.generation_config.eos_token_id = list(ChatFormat(tok).stop_ids)  # raypai's stop tokens
    train, _ = h.problems(s["prompts"], s["seed"])
    prompts, group = s["batch"]
    gen_seconds, stamps = [], []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                gen_seconds.append(time.perf_counter() - t0)

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    cfg = GRPOConfig(
        per_device_train_batch_size=prompts * group,
        num_generations=group,
        steps_per_generation=1,
        max_completion_length=s["max_new_tokens"],
        beta=0.0,
        loss_type="dapo",
        num_iterations=1,
        temperature=1.0,
        max_steps=s["steps"],
        **_trl_common(s),
    )
    trainer = Timed(
        model=model,
        reward_funcs=h.reward_fn(s["reward"]),
        args=cfg,
        train_dataset=Dataset.from_list(ar.prompt_rows(train)),  # conversational: TRL applies the template
        processing_class=tok,
        callbacks=[Clock()],
    )
    start = time.perf_counter()
    trainer.train()
    steady = len(stamps) - 1
    seconds = stamps[-1] - stamps[0]
    lengths = [x["completions/mean_length"] for x in trainer.state.log_history if "completions/mean_length" in x]
    gen = sum(gen_seconds[1:]) / steady
    return {
        "samples_per_s": steady * prompts * group / seconds,
        "step_seconds": seconds / steady,
        "first_step_seconds": stamps[0] - start,  # with the trainer's own set-up inside train()
        "response_length": sum(lengths) / len(lengths),
        "time_generate_and_score": gen,
        "time_rest": seconds / steady - gen,
        "in_process_s": h.process_age_s(),
    }


def row_raypai_dpo(s: dict) -> dict:
    import ray

    from raypai.alignment import DPOConfig, run_dpo
    from raypai.alignment.data import preference_examples
    from raypai.runtime import ensure_ray
    from raypai.settings import Settings

    rows = preference_examples(_pairs(s))
    log = h.Steps()
    cfg = DPOConfig(steps=s["dpo_steps"], batch_size=8, lr=1e-6, beta=0.1, **s.get("overrides", {}))
    ensure_ray(Settings.load(), local=True, num_cpus=8, dashboard=False, log_to_driver=False)
    try:
        run_dpo(
            s["model_dir"],
            str(Path(s["out"]) / s["name"]),
            rows,
            rows[:16],
            cfg,
            run_name=s["name"].replace("_", "-"),
            logger=log,
        )
    finally:
        ray.shutdown()
    steady = len(log.stamps) - 1  # timed as TRL's: from the end of step 1 to the end of the last step
    seconds = log.stamps[-1] - log.stamps[0]
    return {
        "pairs_per_s": 8 * steady / seconds,
        "step_seconds": seconds / steady,
        "in_process_s": h.process_age_s(),
        "compute_dtype": cfg.dtype(s["model_dir"]),
    }


def _pairs(s: dict) -> list[dict]:
    from raypai.alignment.tasks import arithmetic as ar

    train, _ = h.problems(s["prompts"], s["seed"])
    return ar.preference_rows(train, seed=s["seed"], per_problem=1)


def row_trl_dpo(s: dict) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    tok, model = _trl_model(s)
    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    cfg = DPOConfig(
        per_device_train_batch_size=8,
        beta=0.1,
        max_steps=s["dpo_steps"],
        precompute_ref_log_probs=True,
        **_trl_common(s),
    )
    DPOTrainer(
        model=model, args=cfg, train_dataset=Dataset.from_list(_pairs(s)), processing_class=tok, callbacks=[Clock()]
    ).train()
    steady = len(stamps) - 1
    seconds = stamps[-1] - stamps[0]
    return {"pairs_per_s": 8 * steady / seconds, "step_seconds": seconds / steady, "in_process_s": h.process_age_s()}


ROWS = {
    "build": lambda s: h.build_workload(s["workload"], Path(s["out"]), s["seed"]),
    "raypai_grpo": row_raypai_grpo,
    "trl_grpo": row_trl_grpo,
    "raypai_dpo": row_raypai_dpo,
    "trl_dpo": row_trl_dpo,
}


def one(spec_json: str) -> None:
    """Child mode: run the row `spec` describes and print its marked JSON line."""
    s = json.loads(spec_json)
    row = ROWS[s["kind"]](s)
    if s["kind"].startswith("trl_"):
        row["ray_imported"] = "ray" in sys.modules  # must stay False: TRL runs with no Ray at all
    h.emit_child(row)


# ---- the parent: rounds of rows, then the summaries -------------------------------------------


def plan(args, wl: str, model_dir: str, out: str) -> list[dict]:
    """One round's row specs of a workload, in order. `threads: "best"` (the TRL bf16 rows) is
    resolved when the row runs: TRL's fastest fp32 thread count of the same round."""
    w = h.WORKLOADS[wl]
    base = {
        "workload": wl,
        "model_dir": model_dir,
        "out": out,
        "seed": args.seed,
        "prompts": args.prompts,
        "reward": w["reward"],
        "steps": args.steps or w["steps"],
        "max_new_tokens": args.max_new_tokens or w["max_new_tokens"],
        "dpo_steps": args.dpo_steps or w["dpo_steps"],
        "dtype": "fp32",
        "headline": False,
    }
    extra = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(extra) - set(VARIANTS))
    if unknown:
        raise SystemExit(
            f"--variants: unknown {unknown}; choose from {', '.join(v for v in VARIANTS if v not in ALWAYS)}"
        )
    threads = [int(n) for n in args.trl_threads.split(",")]
    pinned = {k: v for k, v in (("train_threads", args.train_threads), ("rollout_threads", args.rollout_threads)) if v}
    if args.rollout_engine != "raypai":
        pinned["rollout_engine"] = args.rollout_engine
    mine = [*ALWAYS, *[v for v in extra if v not in ALWAYS]]
    if "bf16" in mine and h.cpu_has_bf16() and w["hidden"] >= 256:  # roles._device.BF16_MIN_HIDDEN
        mine.remove("bf16")  # the defaults already run in bf16 here: their row is raypai's bf16 row
    rows = []
    for batch in (args.batches or w["batches"]).split(",") if args.only in (None, "grpo") else []:
        b = {**base, "batch": [int(x) for x in batch.split("x")]}
        for v in mine:
            rows.append(
                {
                    **b,
                    "kind": "raypai_grpo",
                    "name": f"{wl}_raypai_grpo_{v}_{batch}",
                    "variant": v,
                    "dtype": VARIANTS[v].get("precision", "auto"),
                    "overrides": {**VARIANTS[v], **pinned},
                    "headline": v in ALWAYS,
                }
            )
        for n in [] if args.no_trl else threads:
            rows.append(
                {**b, "kind": "trl_grpo", "name": f"{wl}_trl_grpo_{n}t_{batch}", "threads": n, "headline": True}
            )
        if "bf16" in extra and not args.no_trl:
            rows.append(
                {**b, "kind": "trl_grpo", "name": f"{wl}_trl_grpo_bf16_{batch}", "threads": "best", "dtype": "bf16"}
            )
    if args.only in (None, "dpo"):
        for v in [v for v in mine if v in ("sync", "fp32", "bf16")]:
            rows.append(
                {
                    **base,
                    "kind": "raypai_dpo",
                    "name": f"{wl}_raypai_dpo" + ("" if v == "sync" else f"_{v}"),
                    "variant": v,
                    "dtype": VARIANTS[v].get("precision", "auto"),
                    "overrides": {k: x for k, x in VARIANTS[v].items()},
                    "headline": v in ALWAYS,
                }
            )
        for n in [] if args.no_trl else threads:
            rows.append({**base, "kind": "trl_dpo", "name": f"{wl}_trl_dpo_{n}t", "threads": n, "headline": True})
        if "bf16" in extra and not args.no_trl:
            rows.append({**base, "kind": "trl_dpo", "name": f"{wl}_trl_dpo_bf16", "threads": "best", "dtype": "bf16"})
    return rows


def rate(row: dict) -> float | None:
    return row.get("samples_per_s", row.get("pairs_per_s"))


def best_trl(rows: list[dict], group: str, rnd: int | None = None) -> dict | None:
    """TRL's fastest fp32 thread count for `group` ("<wl>_trl_grpo_*_<batch>" or "<wl>_trl_dpo_*"),
    by median rate over the rounds (or in round `rnd`)."""
    import statistics

    fp32 = [
        r
        for r in rows
        if r.get("group") == group and r["dtype"] == "fp32" and rate(r) and (rnd is None or r["round"] == rnd)
    ]
    by = {}
    for r in fp32:
        by.setdefault(r["threads"], []).append(rate(r))
    if not by:
        return None
    n = max(by, key=lambda t: statistics.median(by[t]))
    return {
        "threads": n,
        "rate": statistics.median(by[n]),
        "name": next(r["result"] for r in fp32 if r["threads"] == n),
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Per workload and batch: each raypai row (median over the rounds) against TRL's best fp32
    thread count (`vs_trl`) and against TRL's best row of either precision (`vs_trl_best`: its bf16
    row when that is faster), steady state (rate ratio) and end to end (TRL's wall time over raypai's:
    > 1 = raypai finished sooner). `headline_fp32_vs_trl`: raypai fp32 against TRL fp32;
    `defaults_vs_trl_best`: raypai's defaults against TRL's best, the figure the targets are for."""
    out = []
    for group in dict.fromkeys(r["group"] for r in rows if r["system"] == "raypai"):
        mine = [r for r in rows if r["group"] == group]
        wl, algo = mine[0]["workload"], mine[0]["algo"]
        trl_group = group.replace("raypai_", "trl_")
        fp32 = best_trl(rows, trl_group)
        trl_rows = [r for r in rows if r.get("group") == trl_group]
        line = {"result": f"summary_{group}", "rounds": max((r["round"] for r in mine), default=0)}
        best = None
        if fp32:
            at = [r for r in trl_rows if r.get("threads") == fp32["threads"] and r["dtype"] == "fp32"]
            best = {"name": fp32["name"], "rate": fp32["rate"], "wall_s": h.median_of(at, "wall_s")}
            line.update(trl_fp32_best=fp32["name"], trl_rate=fp32["rate"], trl_wall_s=best["wall_s"])
        bf16 = [r for r in trl_rows if r["dtype"] == "bf16" and rate(r)]
        if bf16:
            line["trl_bf16"] = {"rate": h.median_of(bf16, rate), "wall_s": h.median_of(bf16, "wall_s")}
            if best is None or line["trl_bf16"]["rate"] > best["rate"]:
                best = {"name": bf16[0]["result"], **line["trl_bf16"]}
        if best:
            line["trl_best"] = best["name"]
        for variant in dict.fromkeys(r["variant"] for r in mine):
            vr = [r for r in mine if r["variant"] == variant]
            v = {"rate": h.median_of(vr, rate), "wall_s": h.median_of(vr, "wall_s")}
            v["compute_dtype"] = vr[0].get("compute_dtype")
            if fp32 and v["rate"]:
                v["vs_trl"] = v["rate"] / fp32["rate"]
                v["end_to_end_vs_trl"] = line["trl_wall_s"] / v["wall_s"]
            if best and v["rate"]:
                v["vs_trl_best"] = v["rate"] / best["rate"]
                v["end_to_end_vs_trl_best"] = best["wall_s"] / v["wall_s"]
            if bf16 and v["rate"] and (variant == "bf16" or v["compute_dtype"] == "bfloat16"):
                v["vs_trl_bf16"] = v["rate"] / line["trl_bf16"]["rate"]
            # the targets are for raypai's defaults (DPO's) and its non-default GRPO modes (async)
            target = TARGETS.get(wl, {}).get(("dpo" if variant == "sync" else None) if algo == "dpo" else variant)
            if target:
                v["target"] = target
                if "vs_trl_best" in v:
                    v["target_met"] = v["vs_trl_best"] >= target
            line[variant] = v
        if "vs_trl" in line.get("fp32", {}):
            line["headline_fp32_vs_trl"] = line["fp32"]["vs_trl"]
        if "vs_trl_best" in line.get("sync", {}):
            line["defaults_vs_trl_best"] = line["sync"]["vs_trl_best"]
            line["defaults_end_to_end_vs_trl_best"] = line["sync"]["end_to_end_vs_trl_best"]
        both = mine + trl_rows
        line["rows_started_with_ray_alive"] = sum(1 for r in both if r.get("ray_processes_at_start"))
        line["trl_rows_that_imported_ray"] = sum(1 for r in trl_rows if r.get("ray_imported"))
        line["failed_rows"] = [r["result"] for r in both if "error" in r]
        out.append(line)
    return out


def label(spec: dict) -> dict:
    """The row's identity fields: workload, algo, system, variant, group (its summary's key)."""
    system, algo = spec["kind"].split("_")
    batch = "x".join(map(str, spec["batch"])) if "batch" in spec else None
    variant = spec.get("variant", spec["dtype"])  # TRL's rows: fp32 or bf16
    group = f"{spec['workload']}_{system}_{algo}" + (f"_{batch}" if batch else "")
    return {"workload": spec["workload"], "algo": algo, "system": system, "variant": variant, "group": group}


# a row's identity, copied from its spec into its JSON line
KEEP = ("round", "workload", "algo", "system", "variant", "group", "dtype", "headline", "threads", "batch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child mode: one row, spec as JSON
    ap.add_argument("--workload", choices=("toy", "compute", "both"), default="both")
    ap.add_argument("--only", choices=("grpo", "dpo"), default=None)
    ap.add_argument(
        "--rounds", type=int, default=3, help="every row this many times, interleaved; summaries take medians"
    )
    ap.add_argument("--steps", type=int, default=0, help="GRPO steps (0: the workload's, 20 toy / 10 compute)")
    ap.add_argument("--batches", default="", help="prompts x group per step, comma-separated (default: the workload's)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0: the workload's (16 toy / 64 compute)")
    # toy: a DPO step takes 20-40 ms, so 100 steps are needed to time more than a few seconds
    ap.add_argument("--dpo-steps", type=int, default=0, help="0: the workload's (100 toy / 30 compute)")
    ap.add_argument("--prompts", type=int, default=64, help="size of the prompt pool")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--variants",
        default="async,sync_2r,sync_compiled,bf16",
        help="non-headline rows besides raypai's defaults and TRL fp32: async, sync_2r, sync_compiled, bf16 ('' = none)",
    )
    ap.add_argument("--trl-threads", default="1,2", help="TRL's torch threads, one row each; the baseline is its best")
    ap.add_argument("--no-trl", action="store_true", help="raypai rows only")
    ap.add_argument("--train-threads", type=int, default=0, help="raypai GRPOConfig.train_threads in every raypai row")
    ap.add_argument(
        "--rollout-threads", type=int, default=0, help="raypai GRPOConfig.rollout_threads in every raypai row"
    )
    ap.add_argument("--rollout-engine", default="raypai", choices=("raypai", "hf", "vllm"))
    ap.add_argument(
        "--ray-wait",
        type=float,
        default=60,
        help="seconds a row waits for the last row's Ray to exit (then records it)",
    )
    ap.add_argument("--row-timeout", type=float, default=1800, help="seconds before a row's process is killed")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="every kind of row once at tiny sizes: proves the harness, measures nothing",
    )
    args = ap.parse_args()
    if args.one:
        return one(args.one)
    if args.smoke:
        args.rounds, args.steps, args.dpo_steps, args.trl_threads = 1, 3, 4, "1"
        args.batches, args.max_new_tokens = args.batches or "2x4", args.max_new_tokens or 8
    h.stop_rows_on_sigterm()
    script = str(Path(__file__).resolve())
    out = tempfile.mkdtemp(prefix="align-bench-")  # model folders and run outputs, removed at the end
    try:
        parent(args, script, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def parent(args, script: str, out: str) -> None:
    """The rows of every round, each in its own process, then the summaries."""
    workloads = ["toy", "compute"] if args.workload == "both" else [args.workload]
    # Ray daemons alive before this harness began are someone else's: rows do not wait for them to
    # exit, but each row counts them (ray_processes_at_start) and the summaries say so
    foreign = frozenset(p["pid"] for p in h.ray_processes())
    if foreign:
        h.emit({"result": "warning", "ray_processes_before_start": len(foreign), "note": "not a quiet machine"})
    models = {}
    for wl in workloads:  # built in a process of its own, like every row
        built = h.run_row(
            script,
            {"kind": "build", "name": f"build_{wl}", "workload": wl, "out": out, "seed": args.seed},
            foreign=foreign,
        )
        if "error" in built:
            raise SystemExit(f"building the {wl} workload failed: {built['error']}")
        h.emit({**built, "result": f"workload_{wl}"})
        models[wl] = built["model_dir"]
    rows: list[dict] = []
    # rounds: every row once per round, so a slow spell of the machine hits all of them
    for rnd in range(1, args.rounds + 1):
        for wl in workloads:
            for spec in plan(args, wl, models[wl], out):
                spec = {**spec, "round": rnd, **label(spec)}
                if spec.get("threads") == "best":
                    fastest = best_trl(rows, spec["group"], rnd)
                    if fastest is None:
                        continue
                    spec["threads"] = fastest["threads"]
                row = h.run_row(
                    script,
                    spec,
                    threads=spec.get("threads"),
                    timeout_s=args.row_timeout,
                    ray_wait_s=args.ray_wait,
                    foreign=foreign,
                )
                row = {**row, **{k: spec[k] for k in KEEP if k in spec}}
                for k in ("steps", "max_new_tokens") if spec["algo"] == "grpo" else ("dpo_steps",):
                    row[k] = spec[k]
                rows.append(row)
                h.emit(row)
    for line in summarize(rows):
        h.emit(line)


if __name__ == "__main__":
    main()
