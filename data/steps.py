"""Pipeline steps of the data package: source → ingest → clean → train_tokenizer → tokenize."""

from __future__ import annotations

from raypai import Artifact, StepContext, step
from raypai.data.clean import clean as clean_dataset
from raypai.data.ingest import IngestConfig
from raypai.data.ingest import ingest as ingest_files
from raypai.data.recipe import load_recipe
from raypai.data.synth import synth
from raypai.data.tokenizer import tokenize as tokenize_dataset
from raypai.data.tokenizer import train_tokenizer as train_bpe


@step(cpus=0.5, paths=("path",))
def source(ctx: StepContext, path: str) -> Artifact:
    """Record a folder of raw files (by digest, not copied): the root of every lineage chain. Keyed
    by the folder's content, so an edited file re-runs it and everything downstream."""
    return ctx.register_source(path)


@step(cpus=0.5)
def synth_corpus(ctx: StepContext, docs: int = 2000, files: int = 4, seed: int = 0) -> Artifact:
    """Generate the synthetic raw corpus under $RAYPAI_HOME/sources and record it as a source."""
    folder = ctx.settings.home / "sources" / f"synth-{docs}-{files}-{seed}"
    counts = synth(folder, docs=docs, files=files, seed=seed)
    ctx.log_metrics({"raw_rows": sum(counts.values())})
    return ctx.register_source(folder, name=folder.name, metadata={"categories": counts})


@step(cpus=1)
def ingest(ctx: StepContext, raw: Artifact, text_field: str = "text", text_mode: str = "paragraphs") -> Artifact:
    out = ctx.output_dir("raw")
    manifest = ingest_files(str(raw.local_path()), out, IngestConfig(text_field=text_field, text_mode=text_mode))
    ctx.log_metrics({"rows": manifest["rows"], "rejected": manifest["rejected"]})
    return ctx.save(
        out, kind="dataset", name="raw", metadata={"rows": manifest["rows"], "rejected": manifest["rejected"]}
    )


@step(cpus=1)
def clean(ctx: StepContext, raw: Artifact, recipe: str = "default") -> Artifact:
    """Filters + dedup on Ray; per-op stats to the metadata store and MLflow; the report too."""
    ops = load_recipe(recipe)
    out = ctx.output_dir("clean")
    # per-shard progress kept under the step call's work folder: a resumed run skips finished shards
    manifest = clean_dataset(
        raw.local_path(), out, ops, work_dir=ctx.work_dir("clean"), logger=ctx.logger, progress=ctx.progress
    )
    ctx.log_metrics({"kept": manifest["accounting"]["kept"], "dropped": manifest["accounting"]["dropped"]})
    if ctx.logger:
        ctx.logger.log_artifact(out / "report.md", "report")
        if (out / "report").exists():
            ctx.logger.log_artifacts(out / "report", "report/report")
    art = ctx.save(
        out, kind="dataset", name="clean", metadata={"rows": manifest["rows"], "accounting": manifest["accounting"]}
    )
    ctx.record_op_stats(art, manifest["op_stats"])
    return art


@step(cpus=1)
def train_tokenizer(
    ctx: StepContext, dataset: Artifact, vocab_size: int = 2048, sample_bytes: int | None = None
) -> Artifact:
    """BPE on the dataset's text streamed row group by row group; `sample_bytes` caps the sample
    (whole row groups in a seeded order), None trains on all of it."""
    out = ctx.output_dir("tokenizer")
    info = train_bpe(dataset.local_path(), out, vocab_size=vocab_size, sample_bytes=sample_bytes)
    ctx.log_metrics(
        {
            "vocab_size": info["vocab_size"],
            "sample_bytes": info["sample"]["bytes"],
            "sample_documents": info["sample"]["documents"],
        }
    )
    return ctx.save(out, kind="tokenizer", name="tokenizer", metadata=info)


@step(cpus=1)
def tokenize(ctx: StepContext, dataset: Artifact, tokenizer: Artifact, block_size: int = 128) -> Artifact:
    """Token shards written by Ray tasks (this step's Ray): tokenize per row groups, write per shard."""
    out = ctx.output_dir("shards")
    m = tokenize_dataset(dataset.local_path(), tokenizer.local_path(), out, block_size=block_size)
    ctx.log_metrics(
        {
            "num_blocks": m["num_blocks"],
            "num_tokens": m["num_tokens"],
            "unigram_entropy_nats": m["unigram_entropy_nats"],
            **m["work"],
        }
    )
    return ctx.save(
        out,
        kind="token_shards",
        name="token_shards",
        metadata={k: v for k, v in m.items() if k not in ("files", "work")},
    )
