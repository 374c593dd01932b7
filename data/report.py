"""Per-run cleaning report: per-op counts, stat histograms (PNG), sample removals per op."""

from __future__ import annotations

import html
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq


def _histograms(out_dir: Path, stats_files: list[Path]) -> list[str]:
    if not stats_files:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    table = pa.concat_tables([pq.read_table(f) for f in stats_files], promote_options="permissive")
    names = []
    (out_dir / "report").mkdir(exist_ok=True)
    for col in table.column_names:
        vals = np.asarray(table.column(col).to_numpy(zero_copy_only=False), dtype=float)
        vals = vals[np.isfinite(vals)]
        if not len(vals):
            continue
        fig, ax = plt.subplots(figsize=(4, 2.6))
        ax.hist(vals, bins=40, color="#4b7bec")
        ax.set_title(col.removeprefix("stats."), fontsize=9)
        ax.tick_params(labelsize=7)
        fig.tight_layout()
        name = f"report/{col.removeprefix('stats.')}.png"
        fig.savefig(out_dir / name, dpi=80)
        plt.close(fig)
        names.append(name)
    return names


def write_report(out_dir: Path, manifest: dict, dropped: pa.Table, stats_files: list[Path]) -> None:
    acc = manifest["accounting"]
    lines = [
        "# Cleaning report",
        "",
        f"input rows {acc['input_rows']} = kept {acc['kept']} + dropped {acc['dropped']} + rejected {acc['rejected']}",
        "",
        "| # | op | rows in | rows out | dropped | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for r in manifest["op_stats"]:
        lines.append(
            f"| {r['op_index']} | {r['op_name']} | {r['rows_in']} | {r['rows_out']} | {r['dropped']} | "
            f"{r['seconds']:.3f} |"
        )
    pngs = _histograms(out_dir, stats_files)
    if pngs:
        lines += ["", "## Stat distributions (before thresholds)", ""] + [f"![{p}]({p})" for p in pngs]
    lines += ["", "## Sample removals per op", ""]
    for r in manifest["op_stats"]:
        if not r["dropped"]:
            continue
        sample = dropped.filter(pc.equal(dropped.column("op"), r["op_name"])).slice(0, 3).to_pylist()
        lines.append(f"### {r['op_name']}")
        for row in sample:
            snippet = (row["text"] or "")[:160].replace("\n", " ")
            lines.append(f"- `{row['source']}` — {row['reason']}: “{snippet}”")
        lines.append("")
    md = "\n".join(lines)
    (out_dir / "report.md").write_text(md)
    body = "".join(
        f"<p>{html.escape(ln)}</p>" if not ln.startswith("![") else f'<img src="{ln[ln.index("(") + 1 : -1]}">'
        for ln in lines
    )
    (out_dir / "report.html").write_text(f"<!doctype html><meta charset=utf-8><title>cleaning report</title>{body}")
