"""A light language identifier that needs no model download: dominant Unicode script, then, for
Latin script, function-word evidence for a handful of languages. Keeps `lang` and `lang_score`.
(Stand-in for data-juicer's fastText `language_id_score_filter`, default min_score 0.8; our score
is coarser, so the default threshold is 0.5.)"""

from __future__ import annotations

import functools
import re
import string
import unicodedata
from collections import Counter
from dataclasses import dataclass

import numpy as np

_STOPWORDS = {
    "en": "the and of to in is that it was for with as on be at by this had not are but from or have an they which you were her all she there would their we him been has when who will more no if out so said what up its about into than them can only other new some could time these two may then do first any my now such like our over man me even most made after also did many before must through back years where much your way well down should because each just those people how too little state good very make world still own see men work long get here between both life being under never day same another know while last might us great old year off come since against go came right used take three",
    "fr": "le la les de des du un une et est que qui dans pour pas sur au aux avec ce cette il elle nous vous ils sont mais ou par plus se ne son sa ses leur",
    "de": "der die das und ist nicht ein eine zu den von mit sich des auf für im dem auch es an als wie bei oder aus wird nach sie wir ich",
    "es": "el la los las de del y en que un una es por con para no se al lo como más pero sus le ya o este si porque esta entre cuando",
    "it": "il lo la gli le di del della e che un una è per con non si da al nel sono come ma anche questo",
    "pt": "o a os as de do da e que um uma é para com não se em no na por mais como mas foi ao ele das",
}
_SETS = {lang: frozenset(words.split()) for lang, words in _STOPWORDS.items()}
_WORD = re.compile(r"[^\W\d_]+", re.U)
_ASCII_LETTERS = bytes(string.ascii_letters, "ascii")
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
_SCRIPTS = (
    ("LATIN", "latin"),
    ("CYRILLIC", "ru"),
    ("GREEK", "el"),
    ("ARABIC", "ar"),
    ("HEBREW", "he"),
    ("CJK", "zh"),
    ("HIRAGANA", "ja"),
    ("KATAKANA", "ja"),
    ("HANGUL", "ko"),
    ("DEVANAGARI", "hi"),
    ("THAI", "th"),
)


@functools.lru_cache(maxsize=65536)
def _script(ch: str) -> str | None:
    name = unicodedata.name(ch, "")
    for key, code in _SCRIPTS:
        if name.startswith(key):
            return code
    return None


def detect(text: str) -> tuple[str, float]:
    """(language code or 'und', score in [0, 1]) from the first 5,000 characters."""
    sample = text[:5000]
    # ASCII letters are Latin; only the (rarer) non-ASCII letters need a Unicode-name look-up.
    ascii_bytes = sample.encode("ascii", "ignore")
    n_ascii = len(ascii_bytes) - len(ascii_bytes.translate(None, _ASCII_LETTERS))
    scripts = Counter({"latin": n_ascii}) if n_ascii else Counter()
    if not sample.isascii():
        other = [c for c in _NON_ASCII.findall(sample) if c.isalpha()]
        scripts.update(s for s in map(_script, other) if s)
        n_letters = n_ascii + len(other)
    else:
        n_letters = n_ascii
    if not n_letters or not scripts:
        return "und", 0.0
    script, n = scripts.most_common(1)[0]
    share = n / n_letters
    if script != "latin":
        return script, share
    words = Counter(_WORD.findall(sample.lower()))
    total = sum(words.values())
    if not total:
        return "und", 0.0
    hits = {lang: sum(words[w] for w in words.keys() & s) for lang, s in _SETS.items()}
    lang, best = max(hits.items(), key=lambda kv: kv[1])
    # Natural prose has ~25-50% function words; gibberish has almost none.
    evidence = min(1.0, best / (0.15 * total))
    return (lang if best else "und"), share * evidence


@dataclass(frozen=True)
class Language:
    """Keep documents in `languages` whose score ≥ `min_score` (stat: score of an allowed language, else 0)."""

    languages: tuple = ("en",)
    min_score: float = 0.5
    name: str = "language"

    def annotate(self, texts):
        found = [detect(t) for t in texts]
        return {"lang": [f[0] for f in found], "lang_score": [float(f[1]) for f in found]}

    def stats(self, texts, annotations=None):
        ann = annotations or self.annotate(texts)
        return np.array([s if lang in self.languages else 0.0 for lang, s in zip(ann["lang"], ann["lang_score"])])

    def keep(self, s):
        return s >= self.min_score
