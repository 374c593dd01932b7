"""A 3-step toy pipeline: write text -> transform -> count. The smallest thing that shows caching,
lineage, failures and resume.

    raypai run pipelines/toy.py --param n=20
    raypai run pipelines/toy.py --param n=20 --param upper=false   # re-runs transform and count only
    raypai lineage <artifact id of the count report>
"""

from __future__ import annotations

import json
from pathlib import Path

from raypai import Artifact, StepContext, pipeline, step

WORDS = "ray serve train data lineage model token shard artifact pipeline".split()


@step(cpus=0.5)
def write_text(ctx: StepContext, n: int = 10, seed: int = 0) -> Artifact:
    """n lines of pseudo-random words."""
    out = ctx.output_dir("text")
    lines = [" ".join(WORDS[(i * 7 + j * 3 + seed) % len(WORDS)] for j in range(5 + i % 4)) for i in range(n)]
    (out / "text.txt").write_text("\n".join(lines) + "\n")
    ctx.log_metrics({"lines": n})
    return ctx.save(out, kind="dataset", name="text", metadata={"lines": n})


@step(cpus=0.5)
def transform(ctx: StepContext, text: Artifact, upper: bool = True, fail_if_exists: str = "") -> Artifact:
    """Upper-case (or title-case) every line. Raises while the file `fail_if_exists` exists, to
    exercise failure and `raypai resume` (delete the file, then resume)."""
    if fail_if_exists and Path(fail_if_exists).exists():
        raise RuntimeError(f"transform fails while {fail_if_exists} exists; delete it and run `raypai resume`")
    src = (text.local_path() / "text.txt").read_text()
    out = ctx.output_dir("text")
    (out / "text.txt").write_text(src.upper() if upper else src.title())
    return ctx.save(out, kind="dataset", name="transformed", metadata={"upper": upper})


@step(cpus=0.5)
def count(ctx: StepContext, text: Artifact) -> Artifact:
    """Word counts as a JSON report."""
    counts: dict[str, int] = {}
    for word in (text.local_path() / "text.txt").read_text().split():
        counts[word] = counts.get(word, 0) + 1
    out = ctx.output_dir("report")
    Path(out / "counts.json").write_text(json.dumps(counts, sort_keys=True, indent=1))
    ctx.log_metrics({"distinct_words": len(counts), "words": sum(counts.values())})
    return ctx.save(out, kind="report", name="counts", metadata={"distinct_words": len(counts)})


@pipeline
def toy(n: int = 10, upper: bool = True, fail_if_exists: str = "", seed: int = 0):
    text = write_text(n=n, seed=seed)
    shouted = transform(text, upper=upper, fail_if_exists=fail_if_exists)
    return count(shouted)
