"""Needle-in-a-Haystack building blocks, tokenizer-level and model-free.

haystack.py  default haystack text and haystack files      needles.py  needles JSONL
context.py   context construction (buffer, walk back)      prompt.py   chat / base prompt
span.py      needle span rule                              rouge.py    ROUGE-1 recall filter
grid.py      protocols (lengths × depths × needles) and the list of tests
"""

from retmask.niah.context import build_context_ids, period_token_ids
from retmask.niah.grid import (
    PROTOCOLS,
    SPAN_MISS,
    NiahTest,
    Protocol,
    build_tests,
    depth_grid,
    length_grid,
    resolve_grid,
    split_runnable,
)
from retmask.niah.haystack import default_haystack_text, haystack_token_ids, load_haystack
from retmask.niah.needles import DEFAULT_NEEDLES_PATH, Needle, NeedleFileError, load_needles
from retmask.niah.prompt import PROMPT_STYLES, build_prompt_ids, is_chat_tokenizer, resolve_prompt_style
from retmask.niah.rouge import rouge1_recall
from retmask.niah.span import find_needle_span

__all__ = [
    "DEFAULT_NEEDLES_PATH",
    "PROTOCOLS",
    "SPAN_MISS",
    "Needle",
    "NeedleFileError",
    "NiahTest",
    "Protocol",
    "build_context_ids",
    "PROMPT_STYLES",
    "build_prompt_ids",
    "resolve_prompt_style",
    "build_tests",
    "default_haystack_text",
    "depth_grid",
    "find_needle_span",
    "haystack_token_ids",
    "is_chat_tokenizer",
    "length_grid",
    "load_haystack",
    "load_needles",
    "period_token_ids",
    "split_runnable",
    "resolve_grid",
    "rouge1_recall",
]
