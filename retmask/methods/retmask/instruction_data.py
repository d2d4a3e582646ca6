"""Generator of the shipped RetMask instruction set (``retmask_instructions.jsonl`` next to this file).

A model with its retrieval heads masked gets these things wrong (RetMask's published examples): it corrupts
entity names and addresses it should copy from the prompt, ignores a stated output format, loses track of a
reasoning chain over given facts, and drifts on constrained answers. Each category here exercises one of
those, so the chosen (original model) and rejected (masked model) responses differ where it matters.

Everything is generated from templates with invented entities (names, streets, towns, companies, product
codes built from made-up syllables), deterministically from a fixed seed. Regenerate the shipped file
with::

    python -m retmask.methods.retmask.instruction_data

A test checks that the shipped file equals :func:`retmask.runfiles.jsonl_text` of :func:`generate_instructions`.
Records: ``{"id", "category", "prompt"}`` plus ``"reference"`` where one answer is well defined.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from retmask.data import data_path
from retmask.runfiles import atomic_write_text, jsonl_text

SEED = 20240531
PER_CATEGORY = 60
SHIPPED = data_path("instructions", "retmask_instructions.jsonl")

CATEGORIES = (
    "entity_copy",
    "address_copy",
    "json_format",
    "format_constraint",
    "multi_step_reasoning",
    "multiple_choice",
)

# Invented syllables: combining them gives names that belong to no real person, town or company.
_ONSETS = [
    "Bra",
    "Cor",
    "Dal",
    "Esk",
    "Fen",
    "Gal",
    "Hal",
    "Ist",
    "Jor",
    "Kel",
    "Lum",
    "Mer",
    "Nov",
    "Orr",
    "Pel",
    "Quin",
    "Ros",
    "Sar",
    "Tam",
    "Ulm",
    "Val",
    "Wen",
    "Yar",
    "Zel",
]
_CODAS = [
    "adine",
    "bek",
    "cira",
    "dorn",
    "essa",
    "fel",
    "grim",
    "hild",
    "ivo",
    "jun",
    "kara",
    "lis",
    "mond",
    "nara",
    "oth",
    "pia",
    "rick",
    "sel",
    "tova",
    "uel",
    "vik",
    "wyn",
]
_SURNAME_ENDS = [
    "ström",
    "wick",
    "hollow",
    "ard",
    "enby",
    "ski",
    "mere",
    "dottir",
    "kamp",
    "ley",
    "ridge",
    "vane",
    "holt",
    "oni",
]
_TOWN_ENDS = ["brook", "ford", "haven", "marsh", "stead", "vale", "wick", "moor", "port", "crest"]
_STREET_WORDS = [
    "Juniper",
    "Copperleaf",
    "Harrow",
    "Saltmeadow",
    "Lantern",
    "Quarry",
    "Thistle",
    "Kestrel",
    "Old Mill",
    "Weaver",
    "Bellfounder",
    "Orchard",
    "Tidewater",
    "Foxglove",
    "Ironbridge",
    "Marigold",
    "Stonecutter",
    "Hazel",
    "Pilgrim",
    "Rookery",
]
_STREET_KINDS = ["Street", "Lane", "Road", "Avenue", "Close", "Way", "Terrace", "Row", "Crescent"]
_STREET_PARTS = ["", "", "", "North ", "West ", "East ", "Upper ", "Lower "]
_COMPANY_FIELDS = [
    "Bio-technology",
    "Precision Tools",
    "Textile Works",
    "Logistics",
    "Ceramics",
    "Optical Instruments",
    "Seed Company",
    "Robotics",
    "Paper Mills",
    "Marine Supply",
    "Acoustics",
    "Glassworks",
]
_COMPANY_SUFFIXES = ["Co., Ltd", "Ltd", "GmbH", "& Sons", "Cooperative", "Holdings", "Inc."]
_PRODUCTS = [
    "thermal flask",
    "folding ladder",
    "desk lamp",
    "rain jacket",
    "soil sensor",
    "chess clock",
    "hand drill",
    "tea kettle",
    "bike light",
    "field notebook",
    "water filter",
    "label printer",
]
_ITEMS = ["crates", "jars", "boxes", "bundles", "sacks", "trays", "baskets", "rolls"]
_ROLES = [
    "head archivist",
    "chief brewer",
    "harbour master",
    "lead surveyor",
    "clockmaker",
    "librarian",
    "orchard keeper",
    "bridge inspector",
    "glassblower",
    "ferry captain",
]
_COLOURS = ["amber", "teal", "crimson", "slate", "ochre", "violet", "olive", "ivory"]
_WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]


class _Names:
    """Invented entities drawn from one seeded random stream."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def first(self) -> str:
        return self.rng.choice(_ONSETS) + self.rng.choice(_CODAS)

    def surname(self) -> str:
        return self.rng.choice(_ONSETS) + self.rng.choice(_SURNAME_ENDS)

    def person(self) -> str:
        return f"{self.first()} {self.surname()}"

    def town(self) -> str:
        return self.rng.choice(_ONSETS) + self.rng.choice(_TOWN_ENDS)

    def street(self) -> str:
        r = self.rng
        return f"No.{r.randint(2, 480)} {r.choice(_STREET_PARTS)}{r.choice(_STREET_WORDS)} {r.choice(_STREET_KINDS)}"

    def address(self) -> str:
        return f"{self.street()}, {self.town()} {self.rng.randint(10000, 99999)}"

    def company(self) -> str:
        r = self.rng
        return f"{self.town()} {r.choice(_COMPANY_FIELDS)} {r.choice(_COMPANY_SUFFIXES)}"

    def code(self) -> str:
        r = self.rng
        letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
        return f"{r.choice(letters)}{r.choice(letters)}-{r.randint(1000, 9999)}-{r.choice(letters)}"

    def distinct(self, make: Callable[[], str], n: int) -> list[str]:
        """``n`` different values of ``make()`` (questions about "which one" need distinct entities)."""
        out: list[str] = []
        while len(out) < n:
            v = make()
            if v not in out:
                out.append(v)
        return out


Record = dict[str, str]
Template = Callable[[_Names], tuple[str, str | None]]


# ---------------------------------------------------------------- entity names ---------------------------


def _entity_letter(n: _Names) -> tuple[str, str | None]:
    person, company, role = n.person(), n.company(), n.rng.choice(_ROLES)
    return (
        f"Write a short thank-you note from {person}, {role}, to {company} for a prompt delivery. "
        "Use the full names exactly as written.",
        None,
    )


def _entity_extract(n: _Names) -> tuple[str, str | None]:
    people = n.distinct(n.person, 3)
    roles = n.rng.sample(_ROLES, 3)
    i = n.rng.randrange(3)
    lines = "; ".join(f"{p} is the {r}" for p, r in zip(people, roles, strict=True))
    return f"{lines}. Who is the {roles[i]}? Answer with the full name only.", people[i]


def _entity_company(n: _Names) -> tuple[str, str | None]:
    companies = n.distinct(n.company, 3)
    codes = n.distinct(n.code, 3)
    i = n.rng.randrange(3)
    lines = "\n".join(f"- {c} supplies part {k}" for c, k in zip(companies, codes, strict=True))
    return f"Suppliers:\n{lines}\nWhich company supplies part {codes[i]}? Give its exact name.", companies[i]


def _entity_intro(n: _Names) -> tuple[str, str | None]:
    person, town, company = n.person(), n.town(), n.company()
    return (
        f"Introduce {person} from {town}, who founded {company}, in two sentences for a conference "
        "programme. Keep every name exactly as given.",
        None,
    )


def _entity_repeat(n: _Names) -> tuple[str, str | None]:
    company = n.company()
    return f'Repeat this company name exactly, with nothing else: "{company}"', company


def _entity_rename(n: _Names) -> tuple[str, str | None]:
    old, new = n.distinct(n.company, 2)
    return (
        f"{old} changed its name to {new} last spring. Write one sentence announcing the change that "
        "mentions both names.",
        None,
    )


# ---------------------------------------------------------------- addresses ------------------------------


def _address_label(n: _Names) -> tuple[str, str | None]:
    person, company, address = n.person(), n.company(), n.address()
    return (
        f"Write a shipping label for {person} at {company}, {address}. "
        "Put the name, the company and the address on separate lines.",
        f"{person}\n{company}\n{address}",
    )


def _address_lookup(n: _Names) -> tuple[str, str | None]:
    companies = n.distinct(n.company, 3)
    addresses = n.distinct(n.address, 3)
    i = n.rng.randrange(3)
    lines = "\n".join(f"{c}: {a}" for c, a in zip(companies, addresses, strict=True))
    return (
        f"Directory:\n{lines}\nWhat is the address of {companies[i]}? Answer with the address only.",
        addresses[i],
    )


def _address_invite(n: _Names) -> tuple[str, str | None]:
    person, address, day = n.person(), n.address(), n.rng.choice(_WEEKDAYS)
    hour = n.rng.randint(9, 19)
    return (
        f"Write a brief invitation from {person} to a tasting on {day} at {hour}:00 at {address}. "
        "Quote the address exactly.",
        None,
    )


def _address_moved(n: _Names) -> tuple[str, str | None]:
    company = n.company()
    old, new = n.distinct(n.address, 2)
    return (
        f"{company} moved from {old} to {new}. Where should customers send letters now? "
        "Reply with the current address only.",
        new,
    )


def _address_registry(n: _Names) -> tuple[str, str | None]:
    company, address, person = n.company(), n.address(), n.person()
    return (
        f"Fill in this registration line for {company}, registered office {address}, director {person}: "
        '"Company: ___ | Office: ___ | Director: ___"',
        f"Company: {company} | Office: {address} | Director: {person}",
    )


# ---------------------------------------------------------------- JSON formats ---------------------------


def _json_record(n: _Names) -> tuple[str, str | None]:
    person, town, code = n.person(), n.town(), n.code()
    qty = n.rng.randint(2, 40)
    ref = json.dumps({"customer": person, "city": town, "product_code": code, "quantity": qty})
    return (
        f"{person} from {town} ordered {qty} units of product {code}. Return only a JSON object with the "
        'keys "customer", "city", "product_code" and "quantity" (an integer).',
        ref,
    )


def _json_score(n: _Names) -> tuple[str, str | None]:
    product = n.rng.choice(_PRODUCTS)
    good = n.rng.choice(["sturdy", "light", "quiet", "easy to clean", "well packed"])
    bad = n.rng.choice(["the lid squeaks", "the manual is vague", "it arrived late", "the strap is short"])
    return (
        f'Review: "The {product} from {n.company()} is {good}, but {bad}." Rate the review\'s sentiment '
        'from 1 to 10. Respond only with {"score": integer}.',
        None,
    )


def _json_list(n: _Names) -> tuple[str, str | None]:
    towns = n.distinct(n.town, 3)
    pops = [n.rng.randint(800, 90000) for _ in towns]
    facts = ", ".join(f"{t} has {p} inhabitants" for t, p in zip(towns, pops, strict=True))
    ref = json.dumps([{"town": t, "population": p} for t, p in zip(towns, pops, strict=True)])
    return (
        f'{facts}. Output a JSON array of objects with the keys "town" and "population", in the order '
        "given, and nothing else.",
        ref,
    )


def _json_event(n: _Names) -> tuple[str, str | None]:
    person, address, day = n.person(), n.address(), n.rng.choice(_WEEKDAYS)
    ref = json.dumps({"organiser": person, "venue": address, "day": day})
    return (
        f"{person} is organising a repair café on {day} at {address}. Extract the details as JSON with "
        'exactly the keys "organiser", "venue", "day". No other text.',
        ref,
    )


def _json_bool(n: _Names) -> tuple[str, str | None]:
    code, stock = n.code(), n.rng.randint(0, 12)
    need = n.rng.randint(1, 12)
    ok = stock >= need
    return (
        f"Warehouse stock of part {code}: {stock}. An order needs {need}. Answer with a JSON object "
        '{"part": string, "can_fulfil": boolean} only.',
        json.dumps({"part": code, "can_fulfil": ok}),
    )


# ---------------------------------------------------------------- other format constraints ---------------


def _fmt_bullets(n: _Names) -> tuple[str, str | None]:
    product = n.rng.choice(_PRODUCTS)
    k = n.rng.choice([2, 3, 4])
    return (
        f'Give exactly {k} bullet points, each starting with "- ", on why a hiker might carry a {product}. '
        "No introduction and no conclusion.",
        None,
    )


def _fmt_upper(n: _Names) -> tuple[str, str | None]:
    town = n.town()
    return f"Write one sentence welcoming visitors to {town}. Use only capital letters.", None


def _fmt_words(n: _Names) -> tuple[str, str | None]:
    colour, product = n.rng.choice(_COLOURS), n.rng.choice(_PRODUCTS)
    k = n.rng.choice([5, 6, 7, 8])
    article = "an" if colour[0] in "aeiou" else "a"
    return f"Describe {article} {colour} {product} in exactly {k} words.", None


def _fmt_sorted(n: _Names) -> tuple[str, str | None]:
    towns = n.distinct(n.town, 4)
    return (
        f"Sort these towns alphabetically and output them comma-separated on one line: {', '.join(towns)}.",
        ", ".join(sorted(towns)),
    )


def _fmt_table(n: _Names) -> tuple[str, str | None]:
    people = n.distinct(n.person, 2)
    roles = n.rng.sample(_ROLES, 2)
    rows = "\n".join(f"| {p} | {r} |" for p, r in zip(people, roles, strict=True))
    return (
        f"{people[0]} is the {roles[0]} and {people[1]} is the {roles[1]}. Output a markdown table with the "
        "columns Name and Role, one row per person, and nothing else.",
        f"| Name | Role |\n| --- | --- |\n{rows}",
    )


def _fmt_prefix(n: _Names) -> tuple[str, str | None]:
    code = n.code()
    return (
        f'Write a one-line status update about shipment {code}. The line must start with "[{code}]" and '
        "end with a full stop.",
        None,
    )


# ---------------------------------------------------------------- multi-step reasoning -------------------


def _reason_items(n: _Names) -> tuple[str, str | None]:
    person, item = n.first(), n.rng.choice(_ITEMS)
    a, b, per = n.rng.randint(5, 30), n.rng.randint(1, 4), n.rng.randint(3, 15)
    give = n.rng.randint(1, a - 1)
    total = (a - give) * per + b * per
    return (
        f"{person} has {a} {item}. They give {give} away, then receive {b} more. Each holds {per} items. "
        "How many items does "
        f"{person} have now? Think step by step, then give the final number on the last line.",
        str(total),
    )


def _reason_age(n: _Names) -> tuple[str, str | None]:
    x, y, z = n.distinct(n.first, 3)
    ay = n.rng.randint(20, 50)
    d1, d2 = n.rng.randint(2, 9), n.rng.randint(2, 9)
    return (
        f"{x} is {d1} years older than {y}. {z} is {d2} years younger than {x}. {y} is {ay}. How old is {z}? "
        "Show your reasoning briefly and end with the number.",
        str(ay + d1 - d2),
    )


def _reason_order(n: _Names) -> tuple[str, str | None]:
    towns = n.distinct(n.town, 4)  # towns[0] oldest ... towns[3] newest
    facts = [f"{towns[i]} was founded before {towns[i + 1]}" for i in range(3)]
    n.rng.shuffle(facts)
    ask_oldest = n.rng.random() < 0.5
    q = "oldest" if ask_oldest else "newest"
    return (
        f"{'. '.join(facts)}. Which town is the {q}? Reason step by step, then name the town.",
        towns[0] if ask_oldest else towns[3],
    )


def _reason_cost(n: _Names) -> tuple[str, str | None]:
    product, company = n.rng.choice(_PRODUCTS), n.company()
    price, qty = n.rng.randint(3, 60), n.rng.randint(2, 12)
    disc = n.rng.choice([10, 20, 25, 50])
    ship = n.rng.randint(4, 15)
    total = price * qty * (100 - disc) / 100 + ship
    ref = f"{total:.2f}"
    return (
        f"{company} sells a {product} for {price} crowns. An order of {qty} gets {disc}% off the goods, then "
        f"a shipping fee of {ship} crowns is added. What is the total? Work it out and give the amount "
        "with two decimals.",
        ref,
    )


def _reason_route(n: _Names) -> tuple[str, str | None]:
    a, b, c = n.distinct(n.town, 3)
    d1, d2 = n.rng.randint(5, 60), n.rng.randint(5, 60)
    speed = n.rng.choice([10, 15, 20, 30])
    minutes = (d1 + d2) * 60 / speed
    return (
        f"The road from {a} to {b} is {d1} km and from {b} to {c} is {d2} km. A cart travels at {speed} km/h. "
        f"How many minutes does the trip from {a} to {c} through {b} take? Explain, then give the number.",
        f"{minutes:g}",
    )


def _reason_schedule(n: _Names) -> tuple[str, str | None]:
    person = n.person()
    start = n.rng.randrange(len(_WEEKDAYS) - 3)
    gap1, gap2 = n.rng.randint(1, 2), 1
    day = _WEEKDAYS[start + gap1 + gap2]
    return (
        f"{person} inspects the bridge on {_WEEKDAYS[start]}. The paperwork is filed {gap1} day(s) after the "
        f"inspection, and the report is sent {gap2} day after filing. On which day is the report sent? "
        "Reason step by step.",
        day,
    )


# ---------------------------------------------------------------- multiple choice ------------------------

_LETTERS = "ABCD"


def _mc(question: str, options: list[str], answer: str) -> tuple[str, str]:
    lines = "\n".join(f"{_LETTERS[i]}. {o}" for i, o in enumerate(options))
    return f"{question}\n{lines}\nAnswer with the letter only.", _LETTERS[options.index(answer)]


def _near_misses(n: _Names, right: str, mutate: Callable[[str], str], k: int = 3) -> list[str]:
    """``k`` distinct corruptions of ``right``: the options a model that half-copied would pick."""
    out: list[str] = []
    for _ in range(200):
        v = mutate(right)
        if v != right and v not in out:
            out.append(v)
            if len(out) == k:
                return out
    raise RuntimeError(f"cannot corrupt {right!r} into {k} distinct options")


def _mc_address(n: _Names) -> tuple[str, str | None]:
    # Options differ from the right address in one detail (number, direction, street kind, town, postcode),
    # like the masked model's "No.8 Wuke West Second Road" -> "No.8, Wuke Road" in RetMask's published
    # examples.
    company = n.company()
    street, town_zip = n.street(), f"{n.town()} {n.rng.randint(10000, 99999)}"
    right = f"{street}, {town_zip}"

    def mutate(addr: str) -> str:
        r = n.rng
        number, rest = addr.split(" ", 1)
        road, place = rest.split(", ", 1)
        town, postcode = place.rsplit(" ", 1)
        change = r.randrange(5)
        if change == 0:
            delta = r.choice([-10, -1, 1, 10])
            value = int(number[3:]) + delta
            number = f"No.{value if value >= 1 else value + 2 * abs(delta)}"
        elif change == 1:
            words = road.split()
            if words[0] in ("North", "West", "East", "Upper", "Lower"):
                words = words[1:]
            else:
                words = [r.choice(["North", "West", "East", "Upper", "Lower"]), *words]
            road = " ".join(words)
        elif change == 2:
            road = " ".join([*road.split()[:-1], r.choice(_STREET_KINDS)])
        elif change == 3:
            town = town[: len(town) // 2] + r.choice(_TOWN_ENDS)
        else:
            postcode = postcode[:-2] + f"{r.randint(0, 99):02d}"
        return f"{number} {road}, {town} {postcode}"

    options = [right, *_near_misses(n, right, mutate)]
    n.rng.shuffle(options)
    return _mc(f"{company} is located at {right}. Which address is correct?", options, right)


def _mc_role(n: _Names) -> tuple[str, str | None]:
    people = n.distinct(n.person, 4)
    role = n.rng.choice(_ROLES)
    right = people[0]
    other = people[1]
    n.rng.shuffle(people)
    return _mc(
        f"{right} became {role} in {n.town()}; {other} applied but was not chosen. Who is the {role}?",
        people,
        right,
    )


def _mc_arith(n: _Names) -> tuple[str, str | None]:
    person, item = n.first(), n.rng.choice(_ITEMS)
    a, b = n.rng.randint(3, 20), n.rng.randint(2, 9)
    right = a * b - b
    options = [str(x) for x in (right, a * b, right + b + 1, a + b)]
    if len(set(options)) < 4:
        options = [str(right), str(right + 1), str(right + 2), str(right + 3)]
    correct = options[0]
    n.rng.shuffle(options)
    return _mc(
        f"{person} packs {a} {item} with {b} items each, then removes {b} items. How many items remain?",
        options,
        correct,
    )


def _mc_code(n: _Names) -> tuple[str, str | None]:
    product = n.rng.choice(_PRODUCTS)
    right = n.code()

    def mutate(code: str) -> str:
        # one changed or swapped character: codes that look right at a glance
        chars = list(code)
        i = n.rng.choice([0, 1, 3, 4, 5, 6, 8])
        if n.rng.random() < 0.5 and i in (3, 4, 5):
            chars[i], chars[i + 1] = chars[i + 1], chars[i]
        else:
            pool = "0123456789" if chars[i].isdigit() else "ABCDEFGHJKLMNPQRSTUVWXYZ"
            chars[i] = n.rng.choice(pool)
        return "".join(chars)

    options = [right, *_near_misses(n, right, mutate)]
    n.rng.shuffle(options)
    return _mc(
        f"The {product} in the catalogue of {n.company()} has product code {right}. Which is its code?",
        options,
        right,
    )


def _mc_compare(n: _Names) -> tuple[str, str | None]:
    towns = n.distinct(n.town, 4)
    heights = n.rng.sample(range(120, 900), 4)
    facts = "; ".join(f"{t} lies at {h} m" for t, h in zip(towns, heights, strict=True))
    right = towns[heights.index(max(heights))]
    options = list(towns)
    n.rng.shuffle(options)
    return _mc(f"{facts}. Which town lies highest?", options, right)


TEMPLATES: dict[str, list[Template]] = {
    "entity_copy": [
        _entity_letter,
        _entity_extract,
        _entity_company,
        _entity_intro,
        _entity_repeat,
        _entity_rename,
    ],
    "address_copy": [_address_label, _address_lookup, _address_invite, _address_moved, _address_registry],
    "json_format": [_json_record, _json_score, _json_list, _json_event, _json_bool],
    "format_constraint": [_fmt_bullets, _fmt_upper, _fmt_words, _fmt_sorted, _fmt_table, _fmt_prefix],
    "multi_step_reasoning": [
        _reason_items,
        _reason_age,
        _reason_order,
        _reason_cost,
        _reason_route,
        _reason_schedule,
    ],
    "multiple_choice": [_mc_address, _mc_role, _mc_arith, _mc_code, _mc_compare],
}


def generate_instructions(seed: int = SEED, per_category: int = PER_CATEGORY) -> list[Record]:
    """The instruction set: ``per_category`` distinct prompts per category, templates used in turn."""
    rng = random.Random(seed)
    names = _Names(rng)
    records: list[Record] = []
    seen: set[str] = set()
    for category in CATEGORIES:
        templates = TEMPLATES[category]
        count = attempts = 0
        while count < per_category:
            attempts += 1
            if attempts > per_category * 50:  # a template that keeps repeating itself is a bug here
                raise RuntimeError(f"cannot generate {per_category} distinct {category} instructions")
            prompt, reference = templates[count % len(templates)](names)
            if not prompt or prompt in seen:
                continue
            seen.add(prompt)
            rec: Record = {"id": f"{category}-{count:03d}", "category": category, "prompt": prompt}
            if reference is not None:
                rec["reference"] = reference
            records.append(rec)
            count += 1
    return records


def main() -> None:
    """Regenerate the shipped file."""
    text = jsonl_text(generate_instructions())
    atomic_write_text(SHIPPED, text)
    print(f"{len(text.splitlines())} instructions, {len(text.encode())} bytes -> {SHIPPED}")


if __name__ == "__main__":
    main()
