"""Mappers: rewrite text. Defaults follow data-juicer's mappers (cited per class)."""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from dataclasses import dataclass

# data-juicer `punctuation_normalization_mapper`: fold typographic punctuation to ASCII.
_PUNCT = str.maketrans(
    {
        "，": ",",
        "。": ".",
        "、": ",",
        "„": '"',
        "”": '"',
        "“": '"',
        "«": '"',
        "»": '"',
        "１": '"',
        "」": '"',
        "「": '"',
        "《": '"',
        "》": '"',
        "´": "'",
        "∶": ":",
        "：": ":",
        "？": "?",
        "！": "!",
        "（": "(",
        "）": ")",
        "；": ";",
        "–": "-",
        "—": " - ",
        "．": ".",
        "～": "~",
        "’": "'",
        "‘": "'",
        "…": "...",
        "━": "-",
        "〈": "<",
        "〉": ">",
        "【": "[",
        "】": "]",
        "％": "%",
        "►": "-",
    }
)
_SPACES = " \t\u00a0\u2000-\u200b\u3000"  # a regex class body: space, tab, no-break and odd Unicode spaces
# Runs that need rewriting only: a lone ordinary space is left alone (rewriting it with itself was
# most of this op's time), so a run is ≥ 2 characters or starts with an odd space.
_WS = re.compile(rf"[\t\u00a0\u2000-\u200b\u3000][{_SPACES}]*| [{_SPACES}]+")
_BLANKS = re.compile(r"\n{3,}")
_LINE_EDGE = re.compile(r" \n ?|\n ")  # " ?\n ?" without the no-op match of a bare newline

_IPV4_HINT = re.compile(r"\d\.\d")  # necessary (not sufficient) substrings: cheap scans that skip most texts
_PHONE_HINT = re.compile(r"\d[\s.-]\d{3}")
_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")
_IPV4 = re.compile(r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b")
_IPV6_CANDIDATE = re.compile(r"(?<![\w:])[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7}(?![\w:])")
_PHONE = re.compile(r"(?<!\w)(?:\+?\d{1,3}[\s.-]?)?(?:\(\d{2,4}\)|\d{2,4})[\s.-]\d{3,4}[\s.-]\d{3,4}(?!\w)")

# Project Gutenberg licence / header blocks (the "*** START OF ..." and "*** END OF ..." markers and
# the small print around them); generic web boilerplate lines as in datatrove's FineWeb line filters.
_GUTENBERG_START = re.compile(r"\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG.*?\*\*\*", re.I | re.S)
_GUTENBERG_END = re.compile(r"\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG.*", re.I | re.S)
_BOILER_WORDS = (
    r"project gutenberg|all rights reserved|terms of use|privacy policy|cookie policy|subscribe to our"
    r" newsletter|click here|javascript is disabled|this ebook is for the use of anyone"
)
_BOILER_PHRASES = tuple(_BOILER_WORDS.split("|"))
_BOILER_LINES = re.compile(rf"^(.*({_BOILER_WORDS}).*)$", re.I | re.M)


@dataclass(frozen=True)
class UnicodeNFC:
    """Unicode NFC normalisation (data-juicer `fix_unicode_mapper` with normalization='NFC')."""

    name: str = "unicode_nfc"

    def map_texts(self, texts):
        return [unicodedata.normalize("NFC", t) for t in texts]


@dataclass(frozen=True)
class WhitespaceNormalize:
    """Collapse runs of spaces/tabs/odd Unicode spaces, strip line ends, at most one blank line
    (data-juicer `whitespace_normalization_mapper`)."""

    name: str = "whitespace_normalize"

    def map_texts(self, texts):
        out = []
        for t in texts:
            if "\r" in t:
                t = t.replace("\r\n", "\n")
            t = _WS.sub(" ", t)  # whole text at once: runs → one space
            t = _LINE_EDGE.sub("\n", t)  # ... then no space at either end of a line
            if "\n\n\n" in t:
                t = _BLANKS.sub("\n\n", t)
            out.append(t.strip())
        return out


@dataclass(frozen=True)
class PunctuationNormalize:
    """Typographic → ASCII punctuation (data-juicer `punctuation_normalization_mapper`)."""

    name: str = "punctuation_normalize"

    def map_texts(self, texts):
        return [t.translate(_PUNCT) for t in texts]


@dataclass(frozen=True)
class BoilerplateStrip:
    """Remove Project Gutenberg header/licence blocks and boilerplate lines (licence, cookie, nav)."""

    name: str = "boilerplate_strip"

    def map_texts(self, texts):
        out = []
        for t in texts:
            if "***" in t:
                m = _GUTENBERG_START.search(t)
                if m:
                    t = t[m.end() :]
                t = _GUTENBERG_END.sub("", t)
            low = t.lower()
            if any(p in low for p in _BOILER_PHRASES):  # substring scans first; the line regex backtracks
                t = _BOILER_LINES.sub("", t)
            out.append(t.strip())
        return out


@dataclass(frozen=True)
class PIIRedact:
    """Replace e-mails, IPv4/IPv6 addresses and phone numbers with placeholders
    (data-juicer `clean_email_mapper` / `clean_ip_mapper`, with typed placeholders instead of '')."""

    name: str = "pii_redact"
    email: str = "<EMAIL>"
    ip: str = "<IP>"
    phone: str = "<PHONE>"

    def map_texts(self, texts):
        out = []
        for t in texts:  # each pattern only runs when its anchor character is present
            if "@" in t:
                t = _EMAIL.sub(self.email, t)
            if "::" in t or t.count(":") >= 2:
                t = _IPV6_CANDIDATE.sub(lambda m: self.ip if _is_ipv6(m.group()) else m.group(), t)
            if _IPV4_HINT.search(t):
                t = _IPV4.sub(self.ip, t)
            if _PHONE_HINT.search(t):
                t = _PHONE.sub(self.phone, t)
            out.append(t)
        return out


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
        return True
    except ValueError:
        return False
