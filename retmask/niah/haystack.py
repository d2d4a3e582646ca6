"""Haystack text: the project's default (essays shipped in ``retmask/data/haystack``), the earlier default
assembled from the interpreter's ``pydoc_data.topics`` (``"pydoc"``), or user text files."""

from __future__ import annotations

import math
import re
from functools import lru_cache
from pathlib import Path

from retmask.errors import UsageError

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "data" / "haystack"
# ``--haystack pydoc``: the default of retmask runs before 2026-11-26. Its text depends on the Python
# version (CPython 3.11 and 3.12 ship different topics, so the same run gave different prompts beyond
# about 1,700 tokens); kept only to reproduce those runs on the Python that made them.
PYDOC = "pydoc"


# A repeated haystack never grows beyond this many characters per token it must give: ordinary text takes
# about 4 characters per token, so only a text whose copies merge into ever fewer tokens (e.g. "a" -> "aaaa")
# comes near it; such a text fails with an error instead of being repeated without end.
MAX_CHARS_PER_TOKEN = 64


class HaystackError(UsageError):
    """A haystack file or directory that cannot be used; the message names the file (and line)."""


class HaystackText(str):
    """The haystack text with where it came from (``source``: a path, ``"(the default essays)"``...), so
    errors found only once it is tokenised (:func:`haystack_token_ids`) can name it. Equal to, and usable
    as, the plain ``str``."""

    source: str

    def __new__(cls, text: str, source: str) -> HaystackText:
        obj = super().__new__(cls, text)
        obj.source = source
        return obj


def haystack_name(text: str) -> str:
    """How errors name a haystack: its source when known (:class:`HaystackText`), else ``"the haystack"``."""
    source = getattr(text, "source", None)
    return f"haystack {source}" if source else "the haystack"


@lru_cache(maxsize=1)
def default_haystack_text() -> str:
    """The default haystack: original essays written for this project (plain prose paragraphs, about
    9,000 words, 12,000 tokens), shipped as ``retmask/data/haystack/*.txt`` and joined in file-name order
    with a blank line between essays. The same text on every machine and Python version.

    Longer haystacks are obtained by repetition (:func:`haystack_token_ids`), as the reference script does.
    """
    files = sorted(DEFAULT_DIR.glob("*.txt"))
    if not files:
        raise HaystackError(
            f"the shipped haystack is missing ({DEFAULT_DIR} has no *.txt files); reinstall retmask"
        )
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


def _is_prose(paragraph: str) -> bool:
    # Keep ordinary English sentences; drop code, tables, grammar rules and version notes, so the haystack
    # reads like a book and the period token reliably ends sentences.
    if len(paragraph) < 120 or not paragraph.endswith("."):
        return False
    if ">>>" in paragraph or "|" in paragraph or paragraph.count('"') > 6:
        return False
    if paragraph.startswith(("Changed in version", "Added in version", "Deprecated", "**", "See also")):
        return False
    ok = sum(c.isalpha() or c in " ,.;'\"()-" for c in paragraph)
    return ok / len(paragraph) >= 0.93


@lru_cache(maxsize=1)
def pydoc_haystack_text() -> str:
    """The earlier default (``--haystack pydoc``): prose paragraphs of the Python documentation topics
    bundled with CPython (``pydoc_data.topics``, PSF licence), in sorted topic order. Differs between
    Python versions; use it only to reproduce a run recorded with it (its run record has the text's
    sha256 and the Python version)."""
    from pydoc_data.topics import topics

    paragraphs: list[str] = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            text = re.sub(r"\s+", " ", block).strip()
            if _is_prose(text):
                paragraphs.append(text)
    return "\n\n".join(paragraphs) + "\n\n"


@lru_cache(maxsize=4)
def load_haystack(path: str | Path | None = None) -> HaystackText:
    """The haystack text: ``None`` -> :func:`default_haystack_text`; ``"pydoc"`` -> :func:`pydoc_haystack_text`;
    a file -> its text; a directory -> all ``*.txt`` files in it (sorted by name, recursively)
    concatenated. Errors name the file and line; the text carries its source (:class:`HaystackText`) so
    later errors (:func:`haystack_token_ids`) can name it too."""
    if path is None:
        return HaystackText(default_haystack_text(), "(the default essays)")
    if str(path) == PYDOC and not Path(path).exists():
        return HaystackText(pydoc_haystack_text(), f"'{PYDOC}'")
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise HaystackError(
                f"haystack directory {path} has no *.txt files; add text files or pass a file"
            )
    elif path.is_file():
        files = [path]
    else:
        raise HaystackError(
            f"haystack {path} does not exist; pass --haystack FILE|DIR (or '{PYDOC}' for the pre-2026-11-26 "
            "default)"
        )
    parts = []
    for f in files:
        data = f.read_bytes()
        try:
            parts.append(data.decode("utf-8"))
        except UnicodeDecodeError as err:
            line = data[: err.start].count(b"\n") + 1
            raise HaystackError(
                f"{f}:{line}: not UTF-8 text ({err.reason}); convert the file to UTF-8"
            ) from None
    text = "".join(parts)
    if not text.strip():
        raise HaystackError(f"haystack {path} is empty; it must contain prose")
    return HaystackText(text, str(path))


def haystack_token_ids(tokenizer, text: str, min_tokens: int) -> list[int]:
    """Token ids of ``text`` (no special tokens), repeated until at least ``min_tokens`` long.

    The text is repeated before tokenising (like the reference, which concatenates the files again) so
    the seams tokenise naturally. Copies may merge at the seams ("a" * 8 is two tokens, not eight), so each
    try sizes the repetition from the tokens per copy measured so far and at least doubles it; the repeated
    text never exceeds ``MAX_CHARS_PER_TOKEN`` characters per wanted token. A text that cannot fill
    ``min_tokens`` within that raises :class:`HaystackError` naming it, after a few tokenisations, instead
    of looping.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise HaystackError(f"{haystack_name(text)} tokenises to zero tokens; it must contain prose")
    single, reps = len(ids), 1
    max_reps = max(1, math.ceil(min_tokens * MAX_CHARS_PER_TOKEN / len(text)))
    while len(ids) < min_tokens:
        if reps >= max_reps:
            raise HaystackError(
                f"{haystack_name(text)} cannot fill a {min_tokens}-token context: its text ({len(text)} "
                f"characters, {single} token{'s' if single != 1 else ''}) repeated {reps} times gives only {len(ids)} tokens (its "
                "copies merge into fewer tokens); use a longer prose text (the default essays give about "
                "12,000 tokens)"
            )
        per_copy = len(ids) / reps  # > 0: ids is never empty
        reps = min(max_reps, max(2 * reps, math.ceil(min_tokens / per_copy) + 1))
        ids = tokenizer(text * reps, add_special_tokens=False)["input_ids"]
    return ids
