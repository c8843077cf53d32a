"""Fixed evaluation texts shipped with pagedjax (public domain; sources in data/README.md)."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).parent / "data"
# name -> (file, source): the source is printed beside any number measured on the text.
TEXTS = {
    "alice": (
        "alice_ch1-2.txt",
        "Lewis Carroll, Alice's Adventures in Wonderland (1865), Chapters I-II"
        " (Millennium Fulcrum Edition 2.9, Canterbury Corpus alice29.txt); public domain",
    ),
}


def load_text(name: str = "alice") -> str:
    """The text named ``name`` (see TEXTS)."""
    if name not in TEXTS:
        raise KeyError(f"no evaluation text {name!r}; known: {sorted(TEXTS)}")
    return (DATA / TEXTS[name][0]).read_text(encoding="utf-8")


def text_source(name: str = "alice") -> str:
    if name not in TEXTS:
        raise KeyError(f"no evaluation text {name!r}; known: {sorted(TEXTS)}")
    return TEXTS[name][1]
