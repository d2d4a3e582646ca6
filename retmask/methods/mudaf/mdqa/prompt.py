"""The MuDAF training prompt and the token span of every passage in it.

Template::

    Based on the following passages, answer the question.\\n\\n<passages>\\n{body}\\n\\n</passages>\\n\\n Question: {question}\\nAnswer: {answer}

``body`` joins one block per passage, ``Passage {i}:\\n{title}\\n{text}``, with blank lines, in prompt order.
A passage's span covers its whole block (header and title included): per-passage attention mass and the
pooled keys of the contrastive loss are taken over these tokens.

The prompt ends with ``Answer:``; the last prompt token is ``prompt_length - 1`` (where MDQA retrieval
scores read attention), and with ``include_answer`` the answer tokens (``answer_span``, the leading space
and an EOS included) are the CLM targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from retmask.methods.mudaf.mdqa.records import MDQAError, MDQAExample

INSTRUCTION = "Based on the following passages, answer the question."
TEMPLATE = INSTRUCTION + "\n\n<passages>\n{body}\n\n</passages>\n\n Question: {question}\nAnswer: {answer}"

Span = tuple[int, int]
"""Half-open ``[start, end)``: characters in ``text`` or token positions in ``input_ids``."""


@dataclass
class MDQAPrompt:
    """A rendered example. Token fields are ``None`` when no tokenizer was given."""

    text: str
    prompt_text: str  # text up to and including "Answer:" (no answer)
    passage_char_spans: list[Span]
    question_char_span: Span
    golden_indices: list[int]
    input_ids: list[int] | None = None
    passage_spans: list[Span] | None = None
    question_span: Span | None = None
    prompt_length: int | None = None  # number of prompt tokens; the last prompt token is prompt_length - 1
    answer_span: Span | None = None


def passage_block(index: int, title: str, text: str) -> str:
    """``Passage {index}:`` then the title line (omitted when empty) and the text."""
    return f"Passage {index}:\n{title}\n{text}" if title else f"Passage {index}:\n{text}"


def render(example: MDQAExample, include_answer: bool = True) -> tuple[str, str, list[Span], Span]:
    """The text, the prompt part, each passage block's character span and the question's."""
    head = INSTRUCTION + "\n\n<passages>\n"
    pieces = [head]
    pos = len(head)
    spans: list[Span] = []
    for i, p in enumerate(example.passages):
        if i:
            pieces.append("\n\n")
            pos += 2
        block = passage_block(i + 1, p.title, p.text)
        pieces.append(block)
        spans.append((pos, pos + len(block)))
        pos += len(block)
    before_q = "\n\n</passages>\n\n Question: "
    q_start = pos + len(before_q)
    prompt_text = "".join(pieces) + before_q + example.question + "\nAnswer:"
    text = prompt_text + (f" {example.answer}" if include_answer else "")
    # The template is the single source of truth; this check keeps the hand-built offsets honest.
    body = "\n\n".join(passage_block(i + 1, p.title, p.text) for i, p in enumerate(example.passages))
    assert prompt_text + f" {example.answer}" == TEMPLATE.format(
        body=body, question=example.question, answer=example.answer
    )
    return text, prompt_text, spans, (q_start, q_start + len(example.question))


def _token_span(starts: list[int], char_span: Span, what: str, ex_id: str) -> Span:
    """Token positions whose first character lies inside ``char_span``."""
    idx = [i for i, s in enumerate(starts) if s >= 0 and char_span[0] <= s < char_span[1]]
    if not idx:
        raise MDQAError(
            f"example {ex_id}: {what} has no tokens (the tokenizer merged it with its neighbours)"
        )
    return idx[0], idx[-1] + 1


def _encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[int]]:
    """Ids and, per token, where it starts (-1 for special tokens) from a fast tokenizer.

    "Starts" is the token's first non-whitespace character: byte-level tokenizers without trimmed
    offsets report " In" as starting at the space, which would put a question's first word outside the
    question's span.
    """
    enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    starts = []
    for s, e in enc["offset_mapping"]:
        if e <= s:
            starts.append(-1)
            continue
        piece = text[s:e]
        stripped = len(piece) - len(piece.lstrip())
        starts.append(s + stripped if stripped < len(piece) else s)
    return list(enc["input_ids"]), starts


def _encode_by_segments(tokenizer: Any, text: str, cuts: list[int]) -> tuple[list[int], list[int]]:
    """For tokenizers without offsets: encode the text piecewise at ``cuts`` so spans are exact.

    The special tokens the tokenizer adds to an empty string (a BOS, typically) go first.
    """
    ids: list[int] = list(tokenizer("", add_special_tokens=True)["input_ids"])
    starts = [-1] * len(ids)
    bounds = [0, *sorted(set(cuts)), len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        if b <= a:
            continue
        piece = tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        starts.extend([a] * len(piece))  # every token of the piece starts inside it
    return ids, starts


def build_prompt(
    example: MDQAExample,
    tokenizer: Any = None,
    *,
    include_answer: bool = True,
    add_eos: bool = True,
    max_question_tokens: int | None = None,
    max_length: int | None = None,
) -> MDQAPrompt:
    """Render ``example`` with the training template; with a tokenizer, also the token spans.

    Errors: a question longer than ``max_question_tokens`` tokens, or a whole sequence longer than
    ``max_length`` (the model's context), name the example and both numbers.
    """
    text, prompt_text, char_spans, q_char = render(example, include_answer)
    out = MDQAPrompt(
        text=text,
        prompt_text=prompt_text,
        passage_char_spans=char_spans,
        question_char_span=q_char,
        golden_indices=example.golden_indices,
    )
    if tokenizer is None:
        if max_question_tokens is not None or max_length is not None:
            raise MDQAError(
                "length limits are in tokens: pass a tokenizer with max_question_tokens/max_length"
            )
        return out
    if max_question_tokens is not None:
        nq = len(tokenizer(example.question, add_special_tokens=False)["input_ids"])
        if nq > max_question_tokens:
            raise MDQAError(
                f"example {example.id}: the question has {nq} tokens, more than the limit of "
                f"{max_question_tokens}; shorten the question or raise the limit"
            )
    answer_start = len(prompt_text)
    if getattr(tokenizer, "is_fast", False):
        ids, starts = _encode_with_offsets(tokenizer, text)
    else:
        cuts = [c for span in char_spans for c in span] + [q_char[0], q_char[1], answer_start]
        ids, starts = _encode_by_segments(tokenizer, text, cuts)
    # Prompt tokens: everything that starts before the answer (special tokens at the front included).
    prompt_length = max((i + 1 for i, s in enumerate(starts) if 0 <= s < answer_start), default=0)
    if include_answer:
        eos = getattr(tokenizer, "eos_token_id", None)
        if add_eos and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
            starts.append(-1)
        answer_span: Span | None = (prompt_length, len(ids))
        if prompt_length == len(ids):
            raise MDQAError(f"example {example.id}: the answer produced no tokens")
    else:
        ids, starts = ids[:prompt_length], starts[:prompt_length]  # drop trailing special tokens (an EOS)
        answer_span = None
    if max_length is not None and len(ids) > max_length:
        raise MDQAError(
            f"example {example.id}: {len(ids)} tokens, longer than the context limit of {max_length}; "
            "use fewer or shorter passages"
        )
    out.input_ids = ids
    out.passage_spans = [
        _token_span(starts, span, f"passage {i + 1} ({example.passages[i].id})", example.id)
        for i, span in enumerate(char_spans)
    ]
    out.question_span = _token_span(starts, q_char, "the question", example.id)
    out.prompt_length = prompt_length
    out.answer_span = answer_span
    return out
