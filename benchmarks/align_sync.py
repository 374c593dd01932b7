"""Weight sync's share of a synchronous GRPO step and its steadiness, per family and rank layout
(issue #36 item 3: sync ≤ 10 % of a step, a run's p99 sync ≤ 2× its median).

    .venv/bin/python benchmarks/align_sync.py                 # 5 families × (1 rank ZeRO-0, 2 ranks ZeRO-3): ≈ 10 min
    .venv/bin/python benchmarks/align_sync.py --families qwen2 --layouts 1x0 --steps 10

Every run is a process of its own with its own local Ray (`_harness.run_row`): `run_grpo` at its
defaults (synchronous; `precision="auto"`) on a random tiny model of the family (hidden 64, 2
layers; Phi-3's maker is the test suite's, tests/alignment/conftest.py), 4 prompts × 4 samples, up
to 8 new tokens, `--steps` steps. A row gives the run summary's `p50_sync_seconds`,
`p99_sync_seconds`, `sync_share` (the syncs over the steps' wall time) and `sync_setup_seconds` (the
first round, before step 1), the bytes handed over a step, and whether the two goals were met.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import _harness as h  # noqa: E402

FAMILIES = ("raypai", "llama3", "qwen2", "gpt2", "phi3")
LAYOUTS = {"1x0": (1, 0), "2x3": (2, 3)}  # ranks x ZeRO stage


def _model(family: str, out: Path) -> str:
    if family == "phi3":  # the test suite's Phi-3 maker (fused qkv/gate_up, Phi-3's template)
        where = Path(__file__).parents[1] / "tests" / "alignment" / "conftest.py"
        spec = importlib.util.spec_from_file_location("_phi3_maker", where)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.build_tiny_phi3(out)
    from raypai.alignment.tasks.tiny import build_tiny_model

    return build_tiny_model(out, family=family, hidden=64, layers=2)


def row(s: dict) -> dict:
    import ray

    from raypai.alignment import GRPOConfig, run_grpo
    from raypai.alignment.data import prompt_examples
    from raypai.alignment.tasks import arithmetic as ar
    from raypai.runtime import ensure_ray
    from raypai.settings import Settings

    model = _model(s["family"], Path(s["out"]) / s["name"] / "model")
    ranks, stage = LAYOUTS[s["layout"]]
    # GPT-2 has no chat template: plain-text prompts (the standard format)
    prompts = prompt_examples(ar.prompt_rows(ar.problems(max_operand=9)[:32], chat=s["family"] != "gpt2"))
    cfg = GRPOConfig(
        steps=s["steps"],
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=8,
        eval_every=10**6,
        ranks=ranks,
        zero_stage=stage,
    )
    log = h.Steps()
    ensure_ray(Settings.load(), local=True, num_cpus=8, dashboard=False, log_to_driver=False)
    try:
        out = run_grpo(
            model,
            str(Path(s["out"]) / s["name"] / "out"),
            prompts,
            prompts[:2],
            cfg,
            run_name=s["name"].replace("_", "-"),
            rewards=["raypai.alignment.tasks.arithmetic:exact_match_reward"],
            logger=log,
        )
    finally:
        ray.shutdown()
    p50, p99, share = out["p50_sync_seconds"], out["p99_sync_seconds"], out["sync_share"]
    return {
        "family": s["family"],
        "ranks": ranks,
        "zero_stage": stage,
        "steps": s["steps"],
        "p50_sync_seconds": p50,
        "p99_sync_seconds": p99,
        "p99_over_median": p99 / p50 if p50 > 0 else None,
        "sync_share": share,
        "sync_setup_seconds": out["sync_setup_seconds"],
        "sync_bytes": out["sync_bytes"],
        "step_seconds": sum(r["step_seconds"] for r in log.rows) / len(log.rows),
        "share_goal_met": share <= 0.10,
        "p99_goal_met": p99 <= 2 * p50,
        "sync_seconds_each": [r["sync_seconds"] for r in log.rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="ranks x ZeRO stage: 1x0, 2x3")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if args.one:
        import json

        return h.emit_child(row(json.loads(args.one)))
    h.stop_rows_on_sigterm()
    foreign = frozenset(p["pid"] for p in h.ray_processes())
    if foreign:
        h.emit({"result": "warning", "ray_processes_before_start": len(foreign), "note": "not a quiet machine"})
    script = str(Path(__file__).resolve())
    with tempfile.TemporaryDirectory(prefix="align-sync-") as out:
        rows = []
        for layout in args.layouts.split(","):
            for family in args.families.split(","):
                spec = {"name": f"sync_{family}_{layout}", "family": family, "layout": layout}
                r = h.run_row(script, {**spec, "steps": args.steps, "out": out}, foreign=foreign)
                rows.append(r)
                h.emit(r)
        ok = [r for r in rows if "error" not in r]
        h.emit(
            {
                "result": "summary_sync",
                "runs": len(rows),
                "failed": [r["result"] for r in rows if "error" in r],
                "share_goal_met": sum(r["share_goal_met"] for r in ok),
                "p99_goal_met": sum(r["p99_goal_met"] for r in ok),
                "max_sync_share": max((r["sync_share"] for r in ok), default=None),
                "max_p99_over_median": max((r["p99_over_median"] or 0 for r in ok), default=None),
                "at": time.strftime("%Y-%m-%d %H:%M:%S"),
            }
        )


if __name__ == "__main__":
    main()
