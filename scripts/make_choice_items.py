#!/usr/bin/env python
"""Make the multiple-choice item set the project ships for ``eval-choice``
(``deinfer_megatron/evaluation/items/zero_shot.jsonl``), from two texts held out of every
calibration and healing run of the project's SmolLM2 models:

- *Northanger Abbey* (Jane Austen, 1803; public domain): ``../shared/data/text/austen/
  northangerabbey.txt``, the novel docs/HEALING.md holds out;
- the evaluation half of Python's own documentation topics (``pydoc_data.topics``, the keys
  at odd positions in sorted order: the half ``tests/helpers/text.py`` never calibrates on;
  PSF License Version 2).

Paragraphs are unwrapped and split into sentences (a full stop, question or exclamation mark,
perhaps a closing quotation mark or bracket, then a capital; "Mr.", "e.g." and the like are not
ends). Of the documentation only prose is used: indented blocks (code, grammar), headings, lists
and tables are left out, footnote marks (``[1]``) are dropped, and so is a paragraph that does
not end a sentence (it leads into a code block), or that has a sentence of four words or more
found earlier in the half or anywhere in the calibration half (topics repeat each other).

Four categories, ``--per-category`` items each, four choices each, at most one item per
paragraph in a category:

- ``novel-word`` / ``docs-word``: the last word of a sentence (LAMBADA-style cloze). The context
  is the whole sentences before it, back through earlier paragraphs of the same chapter or topic
  (``MIN_CONTEXT_WORDS`` to ``MAX_CONTEXT_WORDS`` words), and the sentence without its last word;
  the choices are that word and three other sentence-final words of the same text, with its
  punctuation. Distractors end like the answer (``-ly``, ``-ed``, ``-ing``,
  ``-tion``/``-ness``/``-ment``, ``-s``, other: a cheap stand-in for the part of speech), are
  about as frequent in the text (within a factor ``FREQ_FACTOR``, so that the raw log-likelihood
  does not just prefer the commoner word) and do not occur in the context.
- ``novel-ending``: the last four to eight words of a narrative sentence (no quotation marks;
  HellaSwag-style ending). The context is at least ``MIN_NEXT_CONTEXT_WORDS`` words of whole
  sentences before it and the sentence's head; the choices are its ending and the endings of as
  many words of three sentences from other chapters, with the same final mark and the same case
  of the first letter.
- ``docs-next``: the next sentence. The context is at least ``MIN_NEXT_CONTEXT_WORDS`` words of
  whole sentences before it (the sentence is not a paragraph's first); the choices are the
  sentence and three sentences from other topics of about the same length (within
  ``LENGTH_TOLERANCE`` of its characters) that open the same way (a quotation mark or not).
  Sentences that end in a colon (they introduce code) are never answers or distractors.

Each category puts its answers at each of the four positions equally often (to one item), in a
shuffled order, with the distractors shuffled around them. The output is a pure function of the
two texts (the documentation is the running Python's: the shipped set was made with 3.11.7) and
``--seed``: run again, it writes the same bytes.

    python scripts/make_choice_items.py --out deinfer_megatron/evaluation/items/zero_shot.jsonl --overwrite
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deinfer_megatron.files.staging import write_atomic  # noqa: E402

NOVEL = ROOT.parent / "shared" / "data" / "text" / "austen" / "northangerabbey.txt"
MIN_CONTEXT_WORDS = 30
MAX_CONTEXT_WORDS = 90
MIN_NEXT_CONTEXT_WORDS = 25
ENDING_WORDS = (4, 8)
MIN_HEAD_WORDS = 6
FREQ_FACTOR = 3.0
LENGTH_TOLERANCE = 0.2
CHOICES = 4
ABBREVIATIONS = ("Mr.", "Mrs.", "Dr.", "St.", "e.g.", "i.e.", "etc.", "vs.", "Ph.D.", "No.")
_DOT = "\u2024"  # stands in for an abbreviation's dot while sentences are split
_SENTENCE_END = re.compile(r'(?:(?<=[.!?])|(?<=[.!?]["\')]))\s+(?=["\'(]?[A-Z0-9])')
_FOOTNOTE = re.compile(r"\s*\[\d+\]")
_LAST_WORD = re.compile(r"^(?P<head>.*\S)\s+(?P<word>[a-z]{4,})(?P<tail>[.!?])$", re.S)


@dataclass(frozen=True)
class Sentence:
    text: str
    paragraph: int  # index of its paragraph in the source
    section: str  # the chapter or topic it belongs to
    source: str  # where it came from, for the item's "source"


def split_sentences(paragraph: str) -> list[str]:
    protected = paragraph
    for abbr in ABBREVIATIONS:
        protected = protected.replace(abbr, abbr.replace(".", _DOT))
    parts = (part.replace(_DOT, ".").strip() for part in _SENTENCE_END.split(protected))
    return [part for part in parts if part]


def novel_paragraphs(path: Path) -> list[tuple[str, str, int]]:
    """(chapter, paragraph text unwrapped, first line number) of the novel's chapters."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, chapter, buf, start = [], None, [], 0
    for number, line in enumerate(lines + [""], start=1):
        heading = re.fullmatch(r"CHAPTER \d+", line.strip())
        if heading:
            chapter = line.strip()
            continue
        if line.strip():
            if not buf:
                start = number
            buf.append(line.strip())
            continue
        if buf and chapter is not None:
            out.append((chapter, " ".join(buf), start))
        buf = []
    return out


def docs_paragraphs() -> list[tuple[str, str, int]]:
    """(topic, prose paragraph unwrapped, paragraph index) of the documentation's evaluation half:
    indented blocks (code, grammar), headings, lists and tables are left out, and so is a
    paragraph with a sentence (of four words or more) found in an earlier paragraph of the half or
    anywhere in the calibration half (topics repeat each other: ``compound`` holds ``if``,
    ``for``, ``try``, ...)."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    calibration = _FOOTNOTE.sub("", re.sub(r"\s+", " ", "\n\n".join(topics[k] for k in keys[0::2])))
    seen: set[str] = set()
    out = []
    for key in keys[1::2]:
        for index, block in enumerate(re.split(r"\n\s*\n", topics[key])):
            lines = block.splitlines()
            if not lines or any(ln.startswith((" ", "\t", "*", "+", "=", "-", ">>>", "|")) or re.match(r"\d+\.", ln)
                                for ln in lines):
                continue
            if len(lines) > 1 and re.fullmatch(r"[*=\-~^]+", lines[-1].strip()):
                continue  # a heading and its underline
            text = _FOOTNOTE.sub("", re.sub(r"\s+", " ", " ".join(lines)).strip())
            if "::=" in text or len(text.split()) < 6 or not re.search(r"[.!?][\"')]?$", text):
                continue
            sentences = [x for x in split_sentences(text) if len(x.split()) >= 4]
            if any(x in seen or x in calibration for x in sentences):
                continue
            seen.update(sentences)
            out.append((key, text, index))
    return out


def sentences_of(paragraphs: list[tuple[str, str, int]], source: str) -> list[list[Sentence]]:
    return [[Sentence(s, i, section, f"{source}:{section}:{where}") for s in split_sentences(text)]
            for i, (section, text, where) in enumerate(paragraphs)]


def suffix_class(word: str) -> str:
    for suffix in ("ly", "ed", "ing", "tion", "ness", "ment"):
        if word.endswith(suffix):
            return "noun" if suffix in ("tion", "ness", "ment") else suffix
    return "s" if word.endswith("s") and not word.endswith("ss") else "other"


def word_counts(paragraphs: list[list[Sentence]]) -> Counter:
    return Counter(w.lower() for para in paragraphs for s in para for w in re.findall(r"[A-Za-z]+", s.text))


def context_before(paragraphs: list[list[Sentence]], p: int, j: int, min_words: int) -> list[str] | None:
    """Whole sentences ending just before sentence ``j`` of paragraph ``p``, going back through
    earlier paragraphs of the same section until ``min_words`` words (None: not enough, or
    more than ``MAX_CONTEXT_WORDS`` once a sentence is whole)."""
    section = paragraphs[p][j].section
    taken: list[str] = []
    words = 0
    q, k = p, j - 1
    while words < min_words:
        if k < 0:
            q -= 1
            if q < 0 or not paragraphs[q] or paragraphs[q][0].section != section:
                return None
            k = len(paragraphs[q]) - 1
            continue
        taken.insert(0, paragraphs[q][k].text)
        words += len(paragraphs[q][k].text.split())
        k -= 1
    return taken if words <= MAX_CONTEXT_WORDS else None


def word_items(paragraphs: list[list[Sentence]], category: str, n: int, rng: random.Random) -> list[dict]:
    counts = word_counts(paragraphs)
    finals: dict[str, set[str]] = {}
    candidates = []
    for p, para in enumerate(paragraphs):
        for j, s in enumerate(para):
            m = _LAST_WORD.match(s.text)
            if m is None or len(s.text.split()) < 8:
                continue
            finals.setdefault(suffix_class(m["word"]), set()).add(m["word"])
            candidates.append((p, j, m))
    rng.shuffle(candidates)
    items, used, positions = [], set(), answer_positions(n, rng)
    for p, j, m in candidates:
        if len(items) == n:
            break
        if p in used:
            continue
        before = context_before(paragraphs, p, j, MIN_CONTEXT_WORDS)
        if before is None:
            continue
        context = " ".join(before + [m["head"]])
        seen = {w.lower() for w in re.findall(r"[A-Za-z]+", context)}
        answer = m["word"]
        freq = counts[answer]
        pool = sorted(w for w in finals[suffix_class(answer)]
                      if w != answer and w not in seen and freq / FREQ_FACTOR <= counts[w] <= freq * FREQ_FACTOR)
        if len(pool) < CHOICES - 1:
            continue
        words = [answer] + rng.sample(pool, CHOICES - 1)
        items.append(_item(context, [w + m["tail"] for w in words], category, paragraphs[p][j].source,
                           positions[len(items)], rng))
        used.add(p)
    if len(items) < n:
        raise SystemExit(f"{category}: only {len(items)} items could be made, {n} asked for")
    return items


def _is_next_candidate(s: Sentence) -> bool:
    """A whole sentence of 6 to 45 words (not one that introduces a code block with a colon)."""
    return 6 <= len(s.text.split()) <= 45 and re.search(r"[.!?][\"')]?$", s.text) is not None


def next_items(paragraphs: list[list[Sentence]], category: str, n: int, rng: random.Random) -> list[dict]:
    every = [s for para in paragraphs for s in para if _is_next_candidate(s)]
    candidates = [(p, j) for p, para in enumerate(paragraphs) for j in range(1, len(para))]
    rng.shuffle(candidates)
    items, used, positions = [], set(), answer_positions(n, rng)
    for p, j in candidates:
        if len(items) == n:
            break
        answer = paragraphs[p][j]
        if p in used or not _is_next_candidate(answer):
            continue
        before = context_before(paragraphs, p, j, MIN_NEXT_CONTEXT_WORDS)
        if before is None:
            continue
        context = " ".join(before)
        quoted = answer.text[:1] in "\"'"
        size = len(answer.text)
        pool = sorted({s.text for s in every
                       if s.section != answer.section and (s.text[:1] in "\"'") == quoted
                       and abs(len(s.text) - size) <= LENGTH_TOLERANCE * size and s.text != answer.text})
        if len(pool) < CHOICES - 1:
            continue
        choices = [answer.text] + rng.sample(pool, CHOICES - 1)
        items.append(_item(context, choices, category, answer.source, positions[len(items)], rng))
        used.add(p)
    if len(items) < n:
        raise SystemExit(f"{category}: only {len(items)} items could be made, {n} asked for")
    return items


def _ending(s: Sentence, k: int) -> tuple[str, str] | None:
    """(head, the last ``k`` words) of a narrative sentence (no quotation marks) of at least
    ``k + MIN_HEAD_WORDS`` words ending in a full stop, question or exclamation mark."""
    words = s.text.split()
    if '"' in s.text or len(words) < k + MIN_HEAD_WORDS or not re.search(r"[a-z][.!?]$", s.text):
        return None
    return " ".join(words[:-k]), " ".join(words[-k:])


def ending_items(paragraphs: list[list[Sentence]], category: str, n: int, rng: random.Random) -> list[dict]:
    """The last ``ENDING_WORDS`` words of a sentence, against the endings of as many words of
    sentences from other sections (same final mark, same case of the first letter)."""
    endings: dict[int, list[tuple[str, str]]] = {}
    for para in paragraphs:
        for s in para:
            for k in range(ENDING_WORDS[0], ENDING_WORDS[1] + 1):
                split = _ending(s, k)
                if split is not None:
                    endings.setdefault(k, []).append((s.section, split[1]))
    candidates = [(p, j) for p, para in enumerate(paragraphs) for j in range(len(para))]
    rng.shuffle(candidates)
    items, used, positions = [], set(), answer_positions(n, rng)
    for p, j in candidates:
        if len(items) == n:
            break
        k = rng.randint(*ENDING_WORDS)
        answer = paragraphs[p][j]
        split = None if p in used else _ending(answer, k)
        if split is None:
            continue
        before = context_before(paragraphs, p, j, MIN_NEXT_CONTEXT_WORDS)
        if before is None:
            continue
        head, tail = split
        pool = sorted({t for section, t in endings[k]
                       if section != answer.section and t[-1] == tail[-1] and t[0].islower() == tail[0].islower()
                       and t != tail})
        if len(pool) < CHOICES - 1:
            continue
        items.append(_item(" ".join(before + [head]), [tail] + rng.sample(pool, CHOICES - 1), category,
                           answer.source, positions[len(items)], rng))
        used.add(p)
    if len(items) < n:
        raise SystemExit(f"{category}: only {len(items)} items could be made, {n} asked for")
    return items


def _item(context: str, choices: list[str], category: str, source: str, position: int,
          rng: random.Random) -> dict:
    """An item whose answer (``choices[0]``) stands at ``position``, the distractors shuffled."""
    others = choices[1:]
    rng.shuffle(others)
    ordered = others[:position] + [choices[0]] + others[position:]
    return {"context": context, "choices": ordered, "answer": position, "category": category, "source": source}


def answer_positions(n: int, rng: random.Random) -> list[int]:
    """Where each of ``n`` items puts its answer: every position equally often (to one), in a
    shuffled order."""
    positions = [i % CHOICES for i in range(n)]
    rng.shuffle(positions)
    return positions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--novel", type=Path, default=NOVEL, help="Northanger Abbey, plain text")
    p.add_argument("--per-category", type=int, default=75)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    a = p.parse_args()
    if a.out.exists() and not a.overwrite:
        raise SystemExit(f"{a.out} exists; pass --overwrite to replace it")
    if not a.novel.is_file():
        raise SystemExit(f"{a.novel} is missing: the novel comes from ../shared/data/text/austen")
    novel = sentences_of(novel_paragraphs(a.novel), a.novel.name)
    docs = sentences_of(docs_paragraphs(), "pydoc_data.topics")
    items = []
    for category, make, text in (("novel-word", word_items, novel), ("novel-ending", ending_items, novel),
                                 ("docs-word", word_items, docs), ("docs-next", next_items, docs)):
        items += make(text, category, a.per_category, random.Random(f"{a.seed}:{category}"))
    write_atomic(a.out, "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))
    counts = Counter(item["category"] for item in items)
    print(f"{a.out}: {len(items)} items ({', '.join(f'{k} {v}' for k, v in counts.items())}), "
          f"Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
