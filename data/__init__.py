"""raypai.data: ingest, clean (filters + dedup on Ray), tokenizer training and token shards."""

from raypai.data.clean import clean
from raypai.data.ingest import IngestConfig, ingest
from raypai.data.recipe import DEFAULT_RECIPE, OPS, load_recipe
from raypai.data.synth import synth

__all__ = ["ingest", "IngestConfig", "clean", "load_recipe", "DEFAULT_RECIPE", "OPS", "synth"]
