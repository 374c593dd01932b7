"""Per-op unit tests on hand-written inputs, edge cases included."""

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pytest

from raypai.data._execute import apply_row_ops
from raypai.data.ops import minhash
from raypai.data.ops.dedup import ExactDedup, MinHashDedup, UnionFind, normalize
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
from raypai.data.ops.language import Language, detect
from raypai.data.ops.mappers import BoilerplateStrip, PIIRedact, PunctuationNormalize, UnicodeNFC, WhitespaceNormalize
from raypai.data.recipe import load_recipe
from raypai.errors import ConfigError

EDGE = ["", "!!! ??? ...", "Съешь же ещё этих мягких французских булок", "word " * 20000]


def test_mappers():
    assert UnicodeNFC().map_texts(["e\u0301"]) == ["\u00e9"]
    assert WhitespaceNormalize().map_texts(["a \t b\u00a0c  \n\n\n\nd  "]) == ["a b c\n\nd"]
    assert PunctuationNormalize().map_texts(["“Hi”—you…"]) == ['"Hi" - you...']
    red = PIIRedact().map_texts(["mail bob@x.org from 10.0.0.1 or 2001:db8::1, call +1 415-555-1234."])[0]
    assert red == "mail <EMAIL> from <IP> or <IP>, call <PHONE>."
    text = (
        "The Project Gutenberg eBook of X\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nBody text here.\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicence"
    )
    assert BoilerplateStrip().map_texts([text]) == ["Body text here."]
    for m in (UnicodeNFC(), WhitespaceNormalize(), PunctuationNormalize(), PIIRedact(), BoilerplateStrip()):
        assert len(m.map_texts(EDGE)) == len(EDGE)  # no op crashes on empty, punctuation-only, Cyrillic, huge


def test_count_and_ratio_filters_by_hand():
    texts = ["one two three", "aaaa bbbb", ""]
    assert WordCount().stats(texts).tolist() == [3, 2, 0]
    assert MeanWordLength().stats(texts).tolist() == [11 / 3, 4.0, 0.0]
    # "ab!!" has 2 alphanumerics of 4 chars, 2 specials of 4
    assert AlnumRatio().stats(["ab!!"]).tolist() == [0.5]
    assert SpecialCharRatio().stats(["ab!!"]).tolist() == [0.5]
    assert not SpecialCharRatio().keep(np.array([0.5]))[0]
    # word 2-grams of "a b a b": (a b) (b a) (a b) → the repeated gram covers 2 of 3 occurrences
    assert WordRepetition(rep_len=2).stats(["a b a b"]).tolist() == [pytest.approx(2 / 3)]


def test_char_repetition_bigscience_definition():
    # "aaaaa" 2-grams: aa×4 → U=1, ⌊√1⌋=1 repeated gram with 4 of 4 occurrences → 1.0
    assert CharRepetition(rep_len=2).stats(["aaaaa"]).tolist() == [1.0]
    # "abcd" 2-grams all unique → no repeated gram → 0
    assert CharRepetition(rep_len=2).stats(["abcd", ""]).tolist() == [0.0, 0.0]


def test_gopher_and_fineweb_rules():
    import random

    from raypai.data.synth import prose

    good = prose(random.Random(3), 8)  # varied sentences, ≥ 50 words
    assert GopherQuality().stats([good]).tolist() == [0.0]
    assert GopherQuality().stats(["short text"]).tolist()[0] >= 1
    rep = "\n".join(["the same line again"] * 10)
    assert GopherRepetition().stats([rep])[0] > 0 and not GopherRepetition().keep(GopherRepetition().stats([rep]))[0]
    assert GopherRepetition().stats([good])[0] <= 0
    lines = "\n".join(["menu", "home", "about", "contact"] * 5)
    assert FineWebQuality().stats([lines])[0] >= 1
    assert FineWebQuality().stats([""])[0] == 4


def test_gopher_repetition_duplicate_ngram_walk():
    """datatrove's `find_all_duplicate` walk, isolated (every other rule switched off)."""

    def only(n):
        return GopherRepetition(
            dup_para_frac=1,
            dup_para_char_frac=1,
            dup_line_frac=1,
            dup_line_char_frac=1,
            top_ngrams=(),
            dup_ngrams=((n, 0.0),),
        )

    # "x"×12: the 5-grams at 0..7 are equal; 0 is new, 1 repeats (5 chars, jump to 6), 6 repeats
    # (5 chars, jump to 11, past the last 5-gram): 10 of the text's 23 characters.
    assert only(5).stats([" ".join("x" * 12)]).tolist() == [pytest.approx(10 / 23)]
    # 2-grams of "a b a b c b c": ab ba ab(repeat: 2 chars, jump to 4, so "bc" at 3 is never seen)
    # cb bc(at 5: its only earlier occurrence was skipped, so it is new): 2 of 13 characters.
    assert only(2).stats(["a b a b c b c"]).tolist() == [pytest.approx(2 / 13)]
    texts = ["a b a b c b c", "", "a b a b c b c a b", " ".join("x" * 12), "one two three four five one two three"]
    together = GopherRepetition().stats(texts)
    alone = [GopherRepetition().stats([t])[0] for t in texts]
    assert together.tolist() == pytest.approx(alone)  # documents of one batch never share n-grams
    assert together[1] == 1.0  # empty text: dropped, as datatrove does


def test_gopher_quality_and_fineweb_extra_rules():
    long_words = " ".join(["extraordinarily"] * 60 + ["the", "and", "of"] * 10)  # mean length 13.2
    assert GopherQuality().stats([long_words])[0] >= 1
    dup_lines = "\n".join(
        ["A line that ends well, and it is long enough."] * 3
        + [f"Line number {i} is different from all of the other lines." for i in range(20)]
    )
    assert FineWebQuality(char_duplicates_ratio=1.0).stats([dup_lines])[0] == 0
    assert FineWebQuality().stats([dup_lines])[0] == 1  # 2 repeated lines: 88 of ~1.2k chars > 1%


def test_flagged_words_and_user_list(tmp_path):
    assert FlaggedWords().stats(["buy viagra now please"])[0] == pytest.approx(0.25)
    custom = tmp_path / "words.txt"
    custom.write_text("banana\n")
    assert FlaggedWords(words_path=str(custom)).stats(["banana split", "viagra"]).tolist() == [0.5, 0.0]


def test_language_detector_needs_no_download():
    assert detect("The cat sat on the mat and it was happy with the day.")[0] == "en"
    assert detect("Le chat est sur la table et il est content de la journée.")[0] == "fr"
    assert detect("Съешь же ещё этих мягких французских булок")[0] == "ru"
    assert detect("qwrtz pls dfgkj xcvbn mnbvc")[0] == "und"
    assert detect("") == ("und", 0.0) and detect("!!!") == ("und", 0.0)
    lang = Language()
    ann = lang.annotate(["The cat sat on the mat and it was happy.", "zzkq vvbn xxrt"])
    assert lang.keep(lang.stats([], ann)).tolist() == [True, False]


def test_dedup_primitives():
    assert normalize("Hello,  WORLD!") == "hello world"
    k = ExactDedup().keys(["Hello world", "hello,   world", "other"])
    assert k[0] == k[1] != k[2]
    mh = MinHashDedup()
    assert (mh.num_bands, mh.rows_per_band) == (21, 6)  # chosen for threshold 0.8 with 128 hashes
    base = " ".join(f"w{i}" for i in range(200))
    near = base.replace("w100", "x100")
    far = " ".join(f"v{i}" for i in range(200))
    sig = mh.signatures([base, near, far, ""])
    est = (sig[0] == sig[1]).mean()
    # one substituted word changes 5 of 196 shingles: Jaccard = 191/201 ≈ 0.95
    assert est == pytest.approx(191 / 201, abs=0.08)
    assert (sig[0] == sig[2]).mean() < 0.1
    keys = mh.band_keys(sig)
    assert keys.shape == (4, 21) and (keys[0] == keys[1]).any() and not (keys[0] == keys[2]).any()
    uf = UnionFind()
    uf.union("b", "c")
    uf.union("c", "a")
    assert uf.find("c") == "a" and uf.find("b") == "a"


def test_banding_follows_the_lsh_formula():
    """P(s) = 1 − (1 − s^r)^b (MMDS §3.4.2): 21 bands of 6 rows give 1 − (1 − 0.8^6)^21 = 0.9983 at
    s = 0.8; 18 × 7, the next-stricter banding of 128 hashes, gives only 0.9855 < 0.99."""
    assert minhash.lsh_probability(0.8, 21, 6) == pytest.approx(1 - (1 - 0.8**6) ** 21)
    assert minhash.lsh_probability(0.8, 21, 6) == pytest.approx(0.9983, abs=1e-4)
    assert minhash.lsh_probability(0.8, 18, 7) == pytest.approx(0.9855, abs=1e-4)
    assert minhash.choose_bands(0.8, 128) == (21, 6)
    assert minhash.choose_bands(0.5, 128) == (42, 3)  # 1 − (1 − 0.125)^42 = 0.9963; 32 × 4 gives 0.873
    for t in (0.5, 0.7, 0.8, 0.9):
        assert MinHashDedup(threshold=t).lsh_recall >= 0.99
    with pytest.raises(ValueError, match="both num_bands and rows_per_band"):
        MinHashDedup(num_bands=4)
    with pytest.raises(ValueError, match="exceeds num_perm"):
        MinHashDedup(num_bands=20, rows_per_band=8)
    with pytest.raises(ValueError, match="threshold"):
        MinHashDedup(threshold=1.5)


def test_shingles_and_exact_jaccard_by_hand():
    h, off = minhash.shingle_hashes(["", " !! ", "A b", "one two three four five six", "One, two three four five"], 5)
    assert off.tolist() == [0, 0, 0, 1, 3, 4]  # no words: no shingle; 2 words: one; 6 words: two 5-grams
    assert h[3] == h[1]  # case and punctuation do not matter: "one two three four five" both times
    # sets {1,2,3} and {2,3,4}: 2 shared of 4; a set against itself: 1; empty against anything: 0
    hashes = np.array([1, 2, 3, 3, 2, 3, 4], dtype=np.uint64)  # repeats inside a document count once
    offsets = np.array([0, 4, 7, 7])
    pairs = np.array([[0, 1], [0, 0], [1, 2]])
    assert minhash.exact_jaccard(hashes, offsets, pairs).tolist() == [0.5, 1.0, 0.0]


def test_candidates_and_verification_by_hand():
    # band 0: rows 0, 2, 3 share a bucket; band 1: rows 1 and 3. fanout 1: a row pairs with the
    # first earlier member only, so (2, 3) is not emitted.
    keys = np.array([[7, 1], [8, 5], [7, 2], [7, 5]], dtype=np.uint64)
    assert minhash.candidate_pairs(keys, fanout=1).tolist() == [[0, 2], [0, 3], [1, 3]]
    assert minhash.candidate_pairs(keys, fanout=2).tolist() == [[0, 2], [0, 3], [1, 3], [2, 3]]
    valid = np.array([True, True, False, True])
    assert minhash.candidate_pairs(keys, valid=valid, fanout=4).tolist() == [[0, 3], [1, 3]]
    # signatures agreeing on 100%, 80% and 50% of 10 values; threshold 0.8, margin 0.15: the 0.8
    # estimate is near the threshold, so the exact Jaccard (here claimed 0.6) decides it
    sigs = np.array([[1] * 10, [1] * 10, [1] * 8 + [2] * 2, [1] * 5 + [3] * 5], dtype=np.uint32)
    pairs = np.array([[0, 1], [0, 2], [0, 3]])
    ok, sim, exact = minhash.verify(pairs, sigs, 0.8, 0.15, lambda p: np.full(len(p), 0.6))
    assert ok.tolist() == [True, False, False] and exact.tolist() == [False, True, False]
    assert sim.tolist() == [1.0, 0.6, 0.5]


def test_minhash_find_verifies_before_merging():
    """A near miss (J ≈ 0.55) that LSH makes a candidate is not merged; a near duplicate is, and
    records its keeper, partner and exact similarity; an empty text is nobody's duplicate."""
    import random

    from raypai.data.synth import jaccard, near_duplicate, near_miss, prose

    rng = random.Random(5)
    docs = [prose(rng, 14) for _ in range(40)]
    dup = near_duplicate(docs[3], rng, 2)
    misses = [near_miss(docs[i], rng)[0] for i in range(10)]
    texts = docs + [dup, "", ""] + misses
    op = MinHashDedup()
    d = op.find(texts)
    assert d.dropped.tolist() == [40]
    assert d.keeper[40] == 3 and d.partner[40] == 3
    assert d.exact[40] or d.similarity[40] >= 0.95  # estimated only when far above the threshold
    assert d.similarity[40] == pytest.approx(jaccard(docs[3], dup), abs=1e-9 if d.exact[40] else 0.15)
    assert d.candidates > d.verified  # some near misses were candidates and were rejected
    broken = MinHashDedup(verify_margin=0.0, threshold=0.8)  # estimate only: still rejects J ≈ 0.55
    assert broken.find(texts).dropped.tolist() == [40]


def test_recipe_validation_reports_every_problem(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_recipe(
            [
                "whitespace_normalize",
                "no_such_op",
                {"word_count": {"min_value": "ten"}},
                {"minhash_dedup": {"bands": 3}},
                "pkg.missing:Op",
            ]
        )
    msgs = err.value.problems
    assert len(msgs) == 4
    assert "unknown op 'no_such_op'" in msgs[0] and "word_count" in msgs[0]  # lists the valid choices
    assert "'min_value' must be float (got str 'ten')" in msgs[1] and "unknown parameter 'bands'" in msgs[2]
    assert "cannot be imported" in msgs[3]
    assert load_recipe([{"word_count": {"min_value": "3"}}])[0].min_value == 3.0  # a number written as text
    y = tmp_path / "r.yaml"
    y.write_text("ops:\n  - whitespace_normalize\n  - word_count: {min_value: 3}\n  - exact_dedup\n")
    ops = load_recipe(str(y))
    assert [o.name for o in ops] == ["whitespace_normalize", "word_count", "exact_dedup"] and ops[1].min_value == 3
    with pytest.raises(ConfigError, match="not found"):
        load_recipe(str(tmp_path / "missing.yaml"))


@dataclass(frozen=True)
class Shout:
    """A custom mapper: any object with `name` and `map_texts`."""

    name: str = "shout"

    def map_texts(self, texts):
        return [t.upper() for t in texts]


@dataclass(frozen=True)
class StatsOnly:
    """`stats` without `keep`: not a filter (it cannot say which rows to keep)."""

    name: str = "stats_only"

    def stats(self, texts):
        return np.zeros(len(texts))


def test_row_ops_dispatch_on_the_op_contract():
    """A mapper rewrites the alive rows; a filter's stat lands in `stats.<name>` and its rejects are
    marked; an annotating filter (`language`) also writes its columns; later ops skip dropped rows."""
    texts = ["the cat sat on the mat and it was happy with the day", "one", "qwrtz pls dfgkj xcvbn mnbvc"]
    out = apply_row_ops(pa.table({"text": texts}), [Shout(), WordCount(min_value=2), Language()], [])
    assert out.column("text").to_pylist() == [t.upper() for t in texts]
    assert out.column("stats.word_count").to_pylist() == [13, 1, 5]
    assert out.column("drop_op").to_pylist() == [None, "word_count", "language"]
    assert out.column("lang").to_pylist() == ["en", None, "und"]  # not run on the row word_count dropped
    assert np.isnan(out.column("stats.language").to_pylist()[1])


def test_recipe_refuses_an_object_that_is_not_an_op():
    assert load_recipe([Shout(), "word_count"])[0].name == "shout"
    with pytest.raises(ConfigError) as err:
        load_recipe([StatsOnly(), "word_count", "collections:Counter"])
    msgs = err.value.problems
    assert len(msgs) == 2
    assert msgs[0].startswith("op #0 stats_only: StatsOnly is not an op") and "keep(stats)" in msgs[0]
    assert msgs[1].startswith("op #2 collections:Counter: Counter is not an op")
