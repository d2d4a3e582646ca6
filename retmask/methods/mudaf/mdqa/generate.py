"""Synthetic multi-document QA for MuDAF: one question, 1–2 golden passages, K distractors.

Question kinds (the golden passages are listed in hop order):

* single-hop, one golden passage: a person's birthplace, occupation or birth year; a company's founding
  year, product or headquarters;
* bridge, two golden passages: the founding year or headquarters of a person's employer, the birthplace of
  a company's founder, the river of a person's home town — the first passage names the entity the second
  one describes;
* comparison, two golden passages: who of two people was born earlier.

Answerability is enforced, not hoped for: no distractor contains the answer string or any entity named
in the question, and for bridge questions the first passage does not contain the answer, so both golden
passages are needed. Passages appear in a seeded random order with the question last.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from retmask.methods.mudaf.mdqa.records import MDQAError, MDQAExample, Passage
from retmask.methods.mudaf.mdqa.world import World, make_world, passages_of

# A question: (kind, question text, answer, golden entity names in hop order, names used in the question).
Question = tuple[str, str, str, list[str], list[str]]


def _q_birthplace(w: World, rng: random.Random) -> Question:
    p = rng.choice(list(w.people.values()))
    return "single-birthplace", f"In which town was {p.name} born?", p.birthplace, [p.name], [p.name]


def _q_occupation(w: World, rng: random.Random) -> Question:
    p = rng.choice(list(w.people.values()))
    return "single-occupation", f"What is the occupation of {p.name}?", p.occupation, [p.name], [p.name]


def _q_born(w: World, rng: random.Random) -> Question:
    p = rng.choice(list(w.people.values()))
    return "single-birth-year", f"In which year was {p.name} born?", str(p.born), [p.name], [p.name]


def _q_founded(w: World, rng: random.Random) -> Question:
    c = rng.choice(list(w.companies.values()))
    return "single-founded", f"In which year was {c.name} founded?", str(c.founded), [c.name], [c.name]


def _q_product(w: World, rng: random.Random) -> Question:
    c = rng.choice(list(w.companies.values()))
    return "single-product", f"What does {c.name} make?", c.product, [c.name], [c.name]


def _q_hq(w: World, rng: random.Random) -> Question:
    c = rng.choice(list(w.companies.values()))
    return "single-headquarters", f"Where is {c.name} headquartered?", c.hq, [c.name], [c.name]


def _q_employer_founded(w: World, rng: random.Random) -> Question:
    p = rng.choice(list(w.people.values()))
    c = w.companies[p.employer]
    q = f"In which year was the company that employs {p.name} founded?"
    return "bridge-employer-founded", q, str(c.founded), [p.name, c.name], [p.name]


def _q_employer_hq(w: World, rng: random.Random) -> Question:
    p = rng.choice(list(w.people.values()))
    c = w.companies[p.employer]
    q = f"In which town is the employer of {p.name} headquartered?"
    return "bridge-employer-headquarters", q, c.hq, [p.name, c.name], [p.name]


def _q_founder_birthplace(w: World, rng: random.Random) -> Question:
    c = rng.choice(list(w.companies.values()))
    p = w.people[c.founder]
    q = f"In which town was the founder of {c.name} born?"
    return "bridge-founder-birthplace", q, p.birthplace, [c.name, p.name], [c.name]


def _q_home_river(w: World, rng: random.Random) -> Question:
    p = rng.choice(list(w.people.values()))
    t = w.towns[p.birthplace]
    q = f"On which river lies the town where {p.name} was born?"
    return "bridge-birthplace-river", q, t.river, [p.name, t.name], [p.name]


def _q_older(w: World, rng: random.Random) -> Question:
    a, b = rng.sample(list(w.people.values()), 2)
    if a.born == b.born:
        return "", "", "", [], []  # no single answer: the caller draws again
    older = a if a.born < b.born else b
    q = f"Who was born earlier, {a.name} or {b.name}?"
    return "comparison-born-earlier", q, older.name, [a.name, b.name], [a.name, b.name]


QUESTION_MAKERS: list[Callable[[World, random.Random], Question]] = [
    _q_birthplace,
    _q_occupation,
    _q_born,
    _q_founded,
    _q_product,
    _q_hq,
    _q_employer_founded,
    _q_employer_hq,
    _q_founder_birthplace,
    _q_home_river,
    _q_older,
]
KINDS = [
    "single-birthplace",
    "single-occupation",
    "single-birth-year",
    "single-founded",
    "single-product",
    "single-headquarters",
    "bridge-employer-founded",
    "bridge-employer-headquarters",
    "bridge-founder-birthplace",
    "bridge-birthplace-river",
    "comparison-born-earlier",
]


def _try_example(rng: random.Random, ex_id: str, num_distractors: int, maker) -> MDQAExample | None:
    """One attempt; ``None`` when this world cannot give a clean example for the drawn question."""
    world = make_world(rng, n_people=max(14, num_distractors + 6), n_companies=6, n_towns=8)
    texts = passages_of(world, rng)
    kind, question, answer, golden, named = maker(world, rng)
    if not kind:
        return None
    if not any(answer in texts[g] for g in golden):
        return None  # cannot happen with the templates; kept so a template change fails loudly in tests
    if kind.startswith("bridge") and answer in texts[golden[0]]:
        return None  # a bridge question must need the second passage
    forbidden = [answer, *named]
    candidates = sorted(
        title
        for title, text in texts.items()
        if title not in golden and not any(f in text for f in forbidden)
    )
    if len(candidates) < num_distractors:
        return None
    distractors = rng.sample(candidates, num_distractors)
    titles = golden + distractors
    rng.shuffle(titles)
    passages = [Passage(f"P{i + 1}", t, texts[t]) for i, t in enumerate(titles)]
    by_title = {p.title: p.id for p in passages}
    return MDQAExample(
        id=ex_id,
        passages=passages,
        golden_ids=[by_title[g] for g in golden],
        question=question,
        answer=answer,
        kind=kind,
    )


def generate_example(index: int, seed: int = 0, num_distractors: int = 8) -> MDQAExample:
    """Example ``index`` of the seeded stream (question kinds in turn; independent of other indices)."""
    if num_distractors < 1:
        raise MDQAError(f"num_distractors must be >= 1, got {num_distractors}")
    # A string seed gives each example its own stream, so example i does not depend on how many came before.
    rng = random.Random(f"mdqa-{seed}-{index}")
    maker = QUESTION_MAKERS[index % len(QUESTION_MAKERS)]
    for _ in range(200):
        ex = _try_example(rng, f"mdqa-{seed}-{index:05d}", num_distractors, maker)
        if ex is not None:
            return ex
    raise MDQAError(
        f"could not build example {index} with {num_distractors} clean distractors; use fewer distractors"
    )


def generate_mdqa(n: int, seed: int = 0, num_distractors: int = 8) -> list[MDQAExample]:
    """``n`` examples with ``num_distractors`` distractors each (K + 1 or K + 2 passages per prompt)."""
    if n < 1:
        raise MDQAError(f"number of examples must be >= 1, got {n}")
    return [generate_example(i, seed, num_distractors) for i in range(n)]
