"""`raypai data …`: synthesise a corpus, clean a folder of raw files.

raypai data synth raw/ --docs 3000
raypai data clean --recipe recipe.yaml raw/ cleaned/
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="Data: synthetic corpus, cleaning and dedup.", no_args_is_help=True)


@app.command("synth")
def synth_cmd(out_dir: Path, docs: int = 2000, files: int = 4, seed: int = 0):
    """Write a synthetic raw corpus (+ _ground_truth.jsonl) to OUT_DIR."""
    from raypai.data.synth import synth

    counts = synth(out_dir, docs=docs, files=files, seed=seed)
    typer.echo(f"wrote {sum(counts.values())} raw rows to {out_dir}: {counts}")


@app.command("clean")
def clean_cmd(
    input_dir: str,
    output_dir: Path,
    recipe: str = typer.Option("default", help="YAML recipe or 'default'"),
    text_mode: str = "paragraphs",
):
    """Ingest INPUT_DIR (.jsonl/.parquet/.txt) and clean it into OUTPUT_DIR on a local Ray."""
    import ray

    from raypai.data.clean import clean
    from raypai.data.ingest import IngestConfig, ingest
    from raypai.data.recipe import load_recipe
    from raypai.runtime import ensure_ray
    from raypai.settings import Settings

    ops = load_recipe(recipe)  # validate before any work
    raw = output_dir / "_raw"
    ensure_ray(Settings.load(), dashboard=False, log_to_driver=False)  # ingest's ranges run as Ray tasks too
    try:
        m = ingest(input_dir, raw, IngestConfig(text_mode=text_mode))
        typer.echo(f"ingested {m['rows']} rows ({m['rejected']} rejected) from {len(m['files'])} files")
        out = clean(raw, output_dir, ops, work_dir=output_dir / "_work")
    finally:
        ray.shutdown()
    a = out["accounting"]
    typer.echo(
        f"kept {a['kept']}, dropped {a['dropped']}, rejected {a['rejected']} of {a['input_rows']}; "
        f"report: {output_dir / 'report.md'}"
    )
