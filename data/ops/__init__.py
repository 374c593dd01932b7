"""Cleaning ops: mappers (rewrite text), filters (stat, then threshold), dedup (exact, MinHash-LSH).
The name → class registry is `raypai.data.recipe.OPS`; what a custom op must provide is `base`."""

from raypai.data.ops.base import AnnotatingFilter, Filter, Mapper
from raypai.data.ops.dedup import ExactDedup, MinHashDedup
from raypai.data.ops.filters import (
    AlnumRatio,
    CharRepetition,
    FineWebQuality,
    FlaggedWords,
    GopherQuality,
    GopherRepetition,
    MeanWordLength,
    SpecialCharRatio,
    WordCount,
    WordRepetition,
)
from raypai.data.ops.language import Language
from raypai.data.ops.mappers import BoilerplateStrip, PIIRedact, PunctuationNormalize, UnicodeNFC, WhitespaceNormalize

__all__ = [
    "Mapper",
    "Filter",
    "AnnotatingFilter",
    "UnicodeNFC",
    "WhitespaceNormalize",
    "PunctuationNormalize",
    "BoilerplateStrip",
    "PIIRedact",
    "WordCount",
    "MeanWordLength",
    "AlnumRatio",
    "SpecialCharRatio",
    "CharRepetition",
    "WordRepetition",
    "GopherRepetition",
    "GopherQuality",
    "FineWebQuality",
    "FlaggedWords",
    "Language",
    "ExactDedup",
    "MinHashDedup",
]
