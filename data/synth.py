"""A synthetic-but-realistic raw corpus with known ground truth, for tests and the demo.

    raypai data synth OUT_DIR --docs 3000 --files 4 --seed 0

Writes `OUT_DIR/raw-NNN.jsonl` and `OUT_DIR/_ground_truth.jsonl` (one line per raw row: source,
category, expected keep|drop|reject, dup_of, near_miss_of, jaccard). Categories: clean prose; exact duplicates
(case and whitespace changed); near duplicates (word-5-gram Jaccard with their original ≥ 0.8,
to be dropped); near misses (Jaccard 0.4–0.7 with their original, to be kept: a dedup that
drops them loses data); Gutenberg boilerplate around clean text; PII (e-mails, IPv4/IPv6, phones)
inside clean text; gibberish; very short; repetitive; broken rows (bad JSON, missing or
non-string text, invalid UTF-8). `jaccard` is the exact word-5-gram Jaccard (lower-cased,
punctuation removed) of a near duplicate with `dup_of` or of a near miss with `near_miss_of`.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

SUBJECTS = (
    "the old miller",
    "a young teacher",
    "the river pilot",
    "our neighbour",
    "the village doctor",
    "a travelling painter",
    "the harbour master",
    "my grandmother",
    "the station clerk",
    "a quiet student",
    "the baker",
    "the carpenter",
    "a tired soldier",
    "the librarian",
    "the gardener",
)
VERBS = (
    "walked",
    "wrote",
    "remembered",
    "carried",
    "painted",
    "counted",
    "watched",
    "repaired",
    "described",
    "explained",
    "borrowed",
    "discovered",
    "measured",
    "followed",
    "planted",
)
OBJECTS = (
    "a letter to the council",
    "the broken lantern",
    "the long road north",
    "a basket of apples",
    "the winter storms",
    "an account of the harvest",
    "the map of the valley",
    "a song about the sea",
    "the names of the stars",
    "the price of bread",
    "a small wooden boat",
    "the history of the town",
    "a cart full of hay",
    "the new school roof",
    "an old family recipe",
    "the flooded cellar",
    "a parcel from the coast",
    "the copper kettle",
    "a ledger of debts",
    "the rules of the game",
)
PLACES = (
    "near the bridge",
    "before dawn",
    "in the market square",
    "after the rain",
    "by the old mill",
    "during the festival",
    "at the edge of the forest",
    "in the quiet evening",
    "on the northern hill",
    "beside the harbour",
    "under the chestnut trees",
    "on a cold morning",
    "behind the church",
    "across the frozen lake",
    "at the crossroads",
    "in the crowded inn",
    "along the canal",
    "under a grey sky",
    "near the salt marsh",
    "on the last day of summer",
)
CLAUSES = (
    "and nobody said a word about it",
    "because the weather had finally changed",
    "while the children played in the street",
    "although it was later than usual",
    "so that everyone would know what happened",
    "and then went home to rest",
    "as the bells rang across the valley",
    "which surprised most of the people there",
    "though few believed the story",
    "until the lamps were lit",
    "without asking anyone for help",
    "before the guests arrived",
    "while the dogs slept by the fire",
    "since the road was closed",
    "even though the wind kept rising",
    "and wrote it all down that night",
    "for reasons never explained",
    "after a long argument about money",
    "so the mayor sent a letter of thanks",
    "while a cart rattled past outside",
)
GUTENBERG_HEAD = (
    "The Project Gutenberg eBook of {title}\n\nThis ebook is for the use of anyone anywhere in the "
    "United States and most other parts of the world at no cost.\n\n*** START OF THE PROJECT "
    "GUTENBERG EBOOK {title} ***\n\n"
)
GUTENBERG_TAIL = (
    "\n\n*** END OF THE PROJECT GUTENBERG EBOOK {title} ***\n\nUpdated editions will replace the previous one."
)


NAMES = (
    "Ada",
    "Bram",
    "Clara",
    "Dmitri",
    "Elena",
    "Farid",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Kira",
    "Lior",
    "Mara",
    "Nils",
    "Olga",
    "Pavel",
    "Quinn",
    "Rosa",
    "Sven",
    "Tomas",
    "Uma",
    "Vera",
    "Wim",
    "Yara",
)
ADJ = (
    "quiet",
    "bright",
    "narrow",
    "ancient",
    "cheerful",
    "muddy",
    "golden",
    "stubborn",
    "gentle",
    "crowded",
    "distant",
    "careful",
    "humble",
    "restless",
    "patient",
    "weathered",
)


def _sentence(rng: random.Random) -> str:
    subject = rng.choice(SUBJECTS) if rng.random() < 0.6 else f"{rng.choice(NAMES)} the {rng.choice(ADJ)}"
    s = f"{subject} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}"
    if rng.random() < 0.5:
        s += f" in {rng.randint(1700, 1950)}"
    if rng.random() < 0.5:
        s += f" with {rng.choice(NAMES)} and {rng.randint(2, 40)} {rng.choice(ADJ)} friends"
    if rng.random() < 0.5:
        s += f" {rng.choice(CLAUSES)}"
    return s[0].upper() + s[1:] + "."


def prose(rng: random.Random, n_sentences: int) -> str:
    paras = []
    while n_sentences > 0:
        k = min(n_sentences, rng.randint(3, 6))
        paras.append(" ".join(_sentence(rng) for _ in range(k)))
        n_sentences -= k
    return "\n\n".join(paras)


def near_duplicate(text: str, rng: random.Random, edits: int) -> str:
    words = text.split(" ")
    for _ in range(edits):
        i = rng.randrange(len(words))
        words[i] = rng.choice(("indeed", "perhaps", "certainly", "quietly", "again", "slowly"))
    return " ".join(words)


def shingle_set(text: str, n: int = 5) -> set[tuple[str, ...]]:
    """Word n-grams of the lower-cased text without punctuation (what `minhash_dedup` compares)."""
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(max(1, len(words) - n + 1))}


def jaccard(a: str, b: str) -> float:
    sa, sb = shingle_set(a), shingle_set(b)
    return len(sa & sb) / max(1, len(sa | sb))


def near_miss(text: str, rng: random.Random, low: float = 0.4, high: float = 0.7) -> tuple[str, float]:
    """(a rewrite of `text` sharing part of its word n-grams, its Jaccard with `text`) with the Jaccard
    in [low, high]: sixteenths of the words are replaced, one at a time in random order, by fresh
    prose until the Jaccard falls below a target drawn in [low + 0.05, high − 0.02]."""
    words = text.split(" ")
    cuts = [round(i * len(words) / 16) for i in range(17)]
    for _ in range(50):
        target = rng.uniform(low + 0.05, high - 0.02)
        out = list(words)
        for seg in rng.sample(range(16), 16):
            fresh = prose(rng, 4).replace("\n\n", " ").split(" ")
            size = cuts[seg + 1] - cuts[seg]
            out[cuts[seg] : cuts[seg + 1]] = (fresh * (size // len(fresh) + 1))[:size]  # same length: cuts stay valid
            j = jaccard(text, " ".join(out))
            if j <= target:
                break
        if low <= j <= high:
            return " ".join(out), j
    raise RuntimeError("could not build a near miss in the Jaccard range; the text is too short")


def _pii(rng: random.Random) -> str:
    name = rng.choice(("anna", "li.wei", "jose", "mark_t", "sara"))
    return rng.choice(
        (
            f"Write to {name}@example.org for details.",
            f"The server at 192.168.{rng.randint(0, 255)}.{rng.randint(1, 254)} answered.",
            f"Call +1 415-555-{rng.randint(1000, 9999)} after six.",
            f"Its address is 2001:db8:85a3::8a2e:370:{rng.randint(1000, 9999)} on the new network.",
        )
    )


def synth(out_dir: str | Path, *, docs: int = 2000, files: int = 4, seed: int = 0) -> dict:
    """Write the corpus and its ground truth; return counts per category."""
    rng = random.Random(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[tuple] = []  # (category, record or None, expected[, index into originals, jaccard with it])
    originals: list[str] = []
    original_row: list[int] = []  # row index of each original
    weights = {
        "clean": 0.49,
        "exact_dup": 0.08,
        "near_dup": 0.08,
        "near_miss": 0.06,
        "boilerplate": 0.05,
        "pii": 0.08,
        "gibberish": 0.05,
        "short": 0.04,
        "repetitive": 0.04,
        "broken": 0.03,
    }
    cats = list(weights)
    for i in range(docs):
        cat = rng.choices(cats, weights=[weights[c] for c in cats])[0]
        if cat in ("exact_dup", "near_dup", "near_miss") and not originals:
            cat = "clean"
        if cat == "clean":
            text = prose(rng, rng.randint(8, 16))
            originals.append(text)
            original_row.append(len(rows))
            rows.append((cat, {"text": text, "id": i}, "keep"))
        elif cat == "exact_dup":
            k = rng.randrange(len(originals))  # same draw as rng.choice, without an O(n) .index()
            src = originals[k]
            variant = src.upper() if rng.random() < 0.3 else src.replace(". ", ".  ")
            rows.append((cat, {"text": variant, "id": i}, "drop", k, 1.0))
        elif cat == "near_dup":
            k = rng.randrange(len(originals))
            src = originals[k]
            text = near_duplicate(src, rng, edits=max(1, len(src.split()) // 90))
            rows.append((cat, {"text": text, "id": i}, "drop", k, jaccard(src, text)))
        elif cat == "near_miss":
            k = rng.randrange(len(originals))
            text, j = near_miss(originals[k], rng)
            rows.append((cat, {"text": text, "id": i}, "keep", k, j))
        elif cat == "boilerplate":
            title = rng.choice(("Tales of the Valley", "A Winter Journal", "The Miller's Accounts"))
            body = prose(rng, rng.randint(8, 14))
            originals.append(body)
            original_row.append(len(rows))
            rows.append(
                (
                    cat,
                    {"text": GUTENBERG_HEAD.format(title=title) + body + GUTENBERG_TAIL.format(title=title), "id": i},
                    "keep",
                )
            )
        elif cat == "pii":
            sents = prose(rng, rng.randint(8, 14)).split(". ")
            for _ in range(rng.randint(1, 3)):
                sents.insert(rng.randrange(len(sents)), _pii(rng).rstrip("."))
            text = ". ".join(sents)
            originals.append(text)
            original_row.append(len(rows))
            rows.append((cat, {"text": text, "id": i}, "keep"))
        elif cat == "gibberish":
            text = " ".join(
                "".join(rng.choice("qwrtzpsdfghjklxcvbnm") for _ in range(rng.randint(4, 11)))
                for _ in range(rng.randint(40, 120))
            )
            rows.append((cat, {"text": text, "id": i}, "drop"))
        elif cat == "short":
            rows.append((cat, {"text": " ".join(_sentence(rng).split()[: rng.randint(3, 9)]), "id": i}, "drop"))
        elif cat == "repetitive":
            s = _sentence(rng)
            rows.append((cat, {"text": " ".join([s] * rng.randint(15, 30)), "id": i}, "drop"))
        else:
            kind = rng.choice(("json", "missing", "type", "utf8"))
            rows.append((f"broken_{kind}", None, "reject"))
    shards: list[list] = [[] for _ in range(files)]
    truth = []
    for i, (cat, rec, expected, *dup) in enumerate(rows):
        f = i % files
        shards[f].append((cat, rec))
        truth.append(
            {
                "file": f"raw-{f:03d}.jsonl",
                "line": len(shards[f]),
                "category": cat,
                "expected": expected,
                "dup_of_row": original_row[dup[0]] if dup else None,
                "near_miss": cat == "near_miss",
                "jaccard": round(dup[1], 4) if dup else None,
            }
        )
    for f, shard in enumerate(shards):
        with open(out / f"raw-{f:03d}.jsonl", "wb") as fh:
            for cat, rec in shard:
                if rec is not None:
                    fh.write(json.dumps(rec).encode() + b"\n")
                elif cat == "broken_json":
                    fh.write(b'{"text": "an unterminated record\n')
                elif cat == "broken_missing":
                    fh.write(b'{"body": "no text field here"}\n')
                elif cat == "broken_type":
                    fh.write(b'{"text": 12345}\n')
                else:
                    fh.write(b'{"text": "bad bytes \xff\xfe here"}\n')
    for t in truth:
        t["source"] = f"{t['file']}:{t['line']}"
    for t in truth:  # row index -> source, so a duplicate names its original
        row, miss = t.pop("dup_of_row"), t.pop("near_miss")
        original = truth[row]["source"] if row is not None else None
        t["dup_of"], t["near_miss_of"] = (None, original) if miss else (original, None)
    with open(out / "_ground_truth.jsonl", "w") as fh:  # "_" prefix: ingest skips it
        for t in truth:
            fh.write(json.dumps(t) + "\n")
    counts: dict[str, int] = {}
    for t in truth:
        counts[t["category"]] = counts.get(t["category"], 0) + 1
    return counts
