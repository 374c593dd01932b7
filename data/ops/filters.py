"""Filters: a stat per document, then a threshold. Defaults from data-juicer and datatrove, cited
per class. Every stat is defined for empty text (0 words → ratios of 0, never a division error)."""

from __future__ import annotations

import bisect
import re
import string
from dataclasses import dataclass, field
from importlib import resources
from itertools import chain

import numpy as np

from raypai.data.ops._ngrams import BatchNgrams, group, token_ids

_WORD = re.compile(r"\w+", re.U)
_ALNUM = re.compile(r"[^\W_]", re.U)  # str.isalnum() as a regex class: word characters minus "_"
_ASCII_ALNUM = bytes(string.ascii_letters + string.digits, "ascii")
_SPECIAL = set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~’“”—–•©®™°±§¶…\x00\t")
_DELETE_SPECIAL = str.maketrans("", "", "".join(_SPECIAL))


def _words(t: str) -> list[str]:
    return _WORD.findall(t.lower())


def _alnum_count(t: str) -> int:
    if t.isascii():  # bytes.translate deletes in C, far faster than a per-character test
        b = t.encode("ascii")
        return len(b) - len(b.translate(None, _ASCII_ALNUM))
    return len(_ALNUM.findall(t))


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


@dataclass(frozen=True)
class WordCount:
    """Number of words (data-juicer `words_num_filter`: min_num=10, max_num=sys.maxsize)."""

    min_value: float = 10
    max_value: float = 100_000
    name: str = "word_count"

    def stats(self, texts):
        return np.array([len(_WORD.findall(t)) for t in texts], dtype=np.float64)

    def keep(self, s):
        return (s >= self.min_value) & (s <= self.max_value)


@dataclass(frozen=True)
class MeanWordLength:
    """Mean word length in characters (Gopher rules, Rae et al. 2021 §A: keep 3..10)."""

    min_value: float = 3
    max_value: float = 10
    name: str = "mean_word_length"

    def stats(self, texts):
        out = []
        for t in texts:
            w = t.split()
            out.append(_ratio(sum(len(x) for x in w), len(w)))
        return np.array(out)

    def keep(self, s):
        return (s >= self.min_value) & (s <= self.max_value)


@dataclass(frozen=True)
class AlnumRatio:
    """Share of alphanumeric characters (data-juicer `alphanumeric_filter`: min_ratio=0.25)."""

    min_value: float = 0.25
    max_value: float = 1.0
    name: str = "alnum_ratio"

    def stats(self, texts):
        return np.array([_ratio(_alnum_count(t), len(t)) for t in texts])

    def keep(self, s):
        return (s >= self.min_value) & (s <= self.max_value)


@dataclass(frozen=True)
class SpecialCharRatio:
    """Share of special characters (data-juicer `special_characters_filter`: max_ratio=0.25)."""

    min_value: float = 0.0
    max_value: float = 0.25
    name: str = "special_char_ratio"

    def stats(self, texts):
        return np.array([_ratio(len(t) - len(t.translate(_DELETE_SPECIAL)), len(t)) for t in texts])

    def keep(self, s):
        return (s >= self.min_value) & (s <= self.max_value)


@dataclass(frozen=True)
class CharRepetition:
    """Character 10-gram repetition (data-juicer `character_repetition_filter`, after BigScience
    ROOTS): share of all 10-gram occurrences taken by the ⌊√U⌋ most frequent repeated 10-grams,
    U = distinct 10-grams; rep_len=10, max_ratio=0.5."""

    rep_len: int = 10
    max_value: float = 0.5
    name: str = "char_repetition"

    def _one(self, t: str) -> float:
        n = len(t) - self.rep_len + 1
        if n <= 0:
            return 0.0
        # Rolling polynomial hash of each rep_len-character window (mod 2^64; collisions between
        # distinct 10-grams are ~n²/2^64, negligible), then counts of the distinct windows.
        cp = np.frombuffer(t.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
        h = np.zeros(n, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for i in range(self.rep_len):
                h = h * np.uint64(1_000_003) + cp[i : i + n]
        freqs = np.sort(np.unique(h, return_counts=True)[1])[::-1]  # descending
        top = min(int(len(freqs) ** 0.5), int((freqs > 1).sum()))
        return float(freqs[:top].sum()) / n

    def stats(self, texts):
        return np.array([self._one(t) for t in texts])

    def keep(self, s):
        return s <= self.max_value


@dataclass(frozen=True)
class WordRepetition:
    """Word 10-gram repetition ratio (data-juicer `word_repetition_filter`: rep_len=10, max_ratio=0.5)."""

    rep_len: int = 10
    max_value: float = 0.5
    name: str = "word_repetition"

    def stats(self, texts):
        words = [_words(t) for t in texts]
        n_words = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
        grams = BatchNgrams(token_ids(list(chain.from_iterable(words))), n_words)
        keys, pos = grams.keys(self.rep_len)
        _, cnt, _ = group(keys)
        doc = grams.doc[pos]
        total = np.bincount(doc, minlength=len(texts))  # n-grams per document
        repeated = np.bincount(doc, weights=cnt > 1, minlength=len(texts))  # ... in repeated n-grams
        return np.divide(repeated, total, out=np.zeros(len(texts)), where=total > 0)

    def keep(self, s):
        return s <= self.max_value


_PARAGRAPHS = re.compile(r"\n{2,}")
_LINES = re.compile(r"\n+")


def _dup_parts(parts: list[str]) -> tuple[int, int]:
    """(repeated elements, their characters): every occurrence after an element's first
    (datatrove `find_duplicates`)."""
    seen, n_dup, chars = set(), 0, 0
    for p in parts:
        if p in seen:
            n_dup += 1
            chars += len(p)
        else:
            seen.add(p)
    return n_dup, chars


def _all_dup_chars(
    pos: np.ndarray, first: np.ndarray, inv: np.ndarray, lengths: list[int], doc: np.ndarray, n: int, n_docs: int
) -> np.ndarray:
    """(D,) characters (spaces excluded) of each document's repeated word n-grams, with datatrove's
    `find_all_duplicate` walk: left to right, an n-gram already seen at an earlier *visited*
    position counts and the walk jumps n words ahead (overlapping repeats count once).

    `pos` (M,) sorted word positions of the n-grams that can repeat, `first`/`inv` their groups.
    Same result without visiting every position: only a position whose n-gram occurred earlier can
    count, and between counted repeats every position is visited, so the walk is replayed over
    those candidates alone, remembering the skipped windows [d+1, d+n). Documents never interfere:
    an n-gram, and so its window, ends inside its document."""
    out = np.zeros(n_docs, dtype=np.int64)
    cand = np.flatnonzero(first < np.arange(len(pos)))  # (C,) indices into pos
    if not len(cand):
        return out
    order = np.argsort(inv, kind="stable")  # indices grouped by n-gram, increasing within a group
    starts = np.zeros(int(inv.max()) + 2, dtype=np.int64)
    np.cumsum(np.bincount(inv), out=starts[1:])
    pos_l, inv_l, order_l, starts_l = pos.tolist(), inv.tolist(), order.tolist(), starts.tolist()
    skipped: list[int] = []  # first positions d+1 of the skipped windows, increasing
    nxt = 0
    for j in cand.tolist():
        q = pos_l[j]
        if q < nxt:
            continue  # inside a skipped window: not visited, not remembered
        g = inv_l[j]
        for k in order_l[starts_l[g] : starts_l[g + 1]]:
            p = pos_l[k]
            if p >= q:
                nxt = q + 1  # every earlier occurrence was skipped: this one is remembered instead
                break
            w = bisect.bisect_right(skipped, p)
            if not w or p >= skipped[w - 1] + n - 1:  # p was visited
                out[doc[q]] += lengths[q + n] - lengths[q]
                skipped.append(q + 1)
                nxt = q + n
                break
    return out


@dataclass(frozen=True)
class GopherRepetition:
    """Gopher repetition rules (Rae et al. 2021, Table A1), with datatrove `GopherRepetitionFilter`'s
    defaults and definitions (whitespace-split words instead of spaCy tokens): duplicate paragraph /
    line fraction ≤ 0.3 and their character fraction ≤ 0.2; top 2/3/4-gram character share ≤
    0.20/0.18/0.16; characters in duplicated 5..10-grams ≤ 0.15..0.10 (shares of the text's length;
    "duplicate" = every occurrence after the first). The stat is the worst rule's excess over its
    limit (≤ 0 passes; an empty text gets 1)."""

    dup_para_frac: float = 0.3
    dup_para_char_frac: float = 0.2
    dup_line_frac: float = 0.3
    dup_line_char_frac: float = 0.2
    top_ngrams: tuple = ((2, 0.20), (3, 0.18), (4, 0.16))
    dup_ngrams: tuple = ((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10))
    name: str = "gopher_repetition"

    def _part_rules(self, t: str) -> float:
        size = len(t)
        paras = _PARAGRAPHS.split(t.strip())
        n_para, c_para = _dup_parts(paras)
        lines = _LINES.split(t)
        n_line, c_line = _dup_parts(lines)
        return max(
            n_para / len(paras) - self.dup_para_frac,
            c_para / size - self.dup_para_char_frac,
            n_line / len(lines) - self.dup_line_frac,
            c_line / size - self.dup_line_char_frac,
        )

    def stats(self, texts):
        n_docs = len(texts)
        if not n_docs:
            return np.zeros(0)
        size = np.array([len(t) or 1 for t in texts], dtype=np.float64)
        excess = np.array([self._part_rules(t) if t else 1.0 for t in texts])
        words = [t.split() for t in texts]
        counts_ = np.fromiter(map(len, words), dtype=np.int64, count=n_docs)
        flat = list(chain.from_iterable(words))
        lengths = np.zeros(len(flat) + 1, dtype=np.int64)  # chars of words[i:j] = lengths[j] - lengths[i]
        np.cumsum(np.fromiter(map(len, flat), dtype=np.int64, count=len(flat)), out=lengths[1:])
        grams = BatchNgrams(token_ids(flat), counts_)
        length_list = lengths.tolist()
        active = None  # positions whose (n-1)-gram repeats: only they can hold a repeated n-gram
        for n, limit in self.top_ngrams:
            keys, pos = grams.keys(n, active)
            first, cnt, _ = group(keys)
            rep = cnt > 1
            # datatrove's Counter.most_common(1): the most frequent n-gram, the first seen among
            # ties; where nothing repeats, that is the document's first n-gram (count 1).
            top, at = np.ones(n_docs), grams.starts.copy()
            if rep.any():
                d, c, p = grams.doc[pos[rep]], cnt[rep], pos[rep]
                best = np.zeros(n_docs, dtype=np.int64)
                np.maximum.at(best, d, c)
                sel = c == best[d]
                docs, i = np.unique(d[sel], return_index=True)  # p is increasing: the first per doc
                top[docs], at[docs] = best[docs], p[sel][i]
            has = np.flatnonzero(counts_ >= n)  # datatrove skips the rule where there is no n-gram
            i = at[has]
            share = (lengths[i + n] - lengths[i] + n - 1) * top[has] / size[has] - limit
            excess[has] = np.maximum(excess[has], share)
            active = pos[rep]
        for n, limit in self.dup_ngrams:
            keys, pos = grams.keys(n, active)
            first, cnt, inv = group(keys)
            chars = _all_dup_chars(pos, first, inv, length_list, grams.doc, n, n_docs)
            excess = np.maximum(excess, chars / size - limit)
            active = pos[cnt > 1]
        return np.where([bool(t) for t in texts], excess, 1.0)

    def keep(self, s):
        return s <= 0


_STOP = frozenset("the be to of and that have with".split())


@dataclass(frozen=True)
class GopherQuality:
    """Gopher quality rules (Rae et al. 2021 §A; datatrove `GopherQualityFilter` defaults):
    50..100k words and mean word length 3..10 (both over words that are not all punctuation),
    ≥ 2 distinct stop words, '#' and ellipsis per word ≤ 0.1, ≤ 90% bullet lines, ≤ 30% lines
    ending in an ellipsis, ≥ 80% words with a letter. The stat counts failed rules (0 passes)."""

    min_words: int = 50
    max_words: int = 100_000
    min_avg_word_length: float = 3
    max_avg_word_length: float = 10
    min_stop_words: int = 2
    max_symbol_word_ratio: float = 0.1
    max_bullet_lines_ratio: float = 0.9
    max_ellipsis_lines_ratio: float = 0.3
    min_alpha_words_ratio: float = 0.8
    name: str = "gopher_quality"

    def _one(self, t: str) -> int:
        words = t.split()
        n = len(words)
        content = [w for w in words if w.translate(_DELETE_SPECIAL)]  # datatrove's "non-symbol words"
        mean_len = _ratio(sum(map(len, content)), len(content))
        lines = [ln for ln in t.split("\n") if ln.strip()] or [""]
        fails = 0
        fails += not (self.min_words <= len(content) <= self.max_words)
        fails += not (self.min_avg_word_length <= mean_len <= self.max_avg_word_length)
        fails += len(_STOP.intersection(w.lower().strip(".,;:!?") for w in words)) < self.min_stop_words
        fails += _ratio(t.count("#"), n) > self.max_symbol_word_ratio
        fails += _ratio(t.count("...") + t.count("…"), n) > self.max_symbol_word_ratio
        fails += (
            _ratio(sum(ln.lstrip().startswith(("•", "-", "*")) for ln in lines), len(lines))
            > self.max_bullet_lines_ratio
        )
        fails += (
            _ratio(sum(ln.rstrip().endswith(("...", "…")) for ln in lines), len(lines)) > self.max_ellipsis_lines_ratio
        )
        fails += _ratio(sum(any(c.isalpha() for c in w) for w in words), n) < self.min_alpha_words_ratio
        return fails

    def stats(self, texts):
        return np.array([self._one(t) for t in texts], dtype=np.float64)

    def keep(self, s):
        return s == 0


@dataclass(frozen=True)
class FineWebQuality:
    """FineWeb line rules (Penedo et al. 2024; datatrove `FineWebQualityFilter` defaults): share of
    lines ending in punctuation ≥ 0.12, share of short (≤ 30 chars) lines ≤ 0.67, characters in
    repeated lines (after their first occurrence) ≤ 1% of the non-newline characters,
    newlines per word ≤ 0.3. The stat counts failed rules (0 passes; an empty text fails all four)."""

    line_punct_thr: float = 0.12
    short_line_thr: float = 0.67
    short_line_length: int = 30
    char_duplicates_ratio: float = 0.01
    new_line_ratio: float = 0.3
    name: str = "fineweb_quality"

    def _one(self, t: str) -> int:
        lines = [ln.strip() for ln in t.split("\n") if ln.strip()]
        if not lines:
            return 4
        fails = _ratio(sum(ln.endswith((".", "!", "?", '"', "'")) for ln in lines), len(lines)) < self.line_punct_thr
        fails += _ratio(sum(len(ln) <= self.short_line_length for ln in lines), len(lines)) > self.short_line_thr
        fails += _ratio(_dup_parts(lines)[1], len(t) - t.count("\n")) > self.char_duplicates_ratio
        fails += _ratio(t.count("\n"), len(t.split())) > self.new_line_ratio
        return int(fails)

    def stats(self, texts):
        return np.array([self._one(t) for t in texts], dtype=np.float64)

    def keep(self, s):
        return s == 0


def _load_flagged() -> frozenset:
    text = resources.files("raypai.data").joinpath("flagged_words.txt").read_text()
    return frozenset(w.strip().lower() for w in text.splitlines() if w.strip() and not w.startswith("#"))


@dataclass(frozen=True)
class FlaggedWords:
    """Share of flagged words (data-juicer `flagged_words_filter`: max_ratio=0.045). Ships a small
    list; `words_path` points at a user list (one word per line)."""

    max_value: float = 0.045
    words_path: str = ""
    name: str = "flagged_words"
    _words: frozenset = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self):
        words = _load_flagged()
        if self.words_path:
            from pathlib import Path

            words = frozenset(w.strip().lower() for w in Path(self.words_path).read_text().splitlines() if w.strip())
        object.__setattr__(self, "_words", words)

    def stats(self, texts):
        out = []
        for t in texts:
            w = _words(t)
            out.append(_ratio(sum(x in self._words for x in w), len(w)))
        return np.array(out)

    def keep(self, s):
        return s <= self.max_value
