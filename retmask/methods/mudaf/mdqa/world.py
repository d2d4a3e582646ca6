"""A small fictional world — people, companies, towns — and one encyclopedia-style passage per entity.

All names are built from invented syllables, so no passage describes a real entity and a model cannot
answer from memory: the answer has to be read from the passages. Attribute values (years, towns,
occupations, products) are drawn so that passages about different entities look alike, which makes the
non-golden passages real distractors rather than obviously irrelevant text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_ONSETS = [
    "Ab",
    "Bel",
    "Cal",
    "Dov",
    "Ell",
    "Fir",
    "Gor",
    "Hest",
    "Ivar",
    "Jas",
    "Kor",
    "Lor",
    "Mav",
    "Nel",
    "Oss",
    "Pry",
    "Quel",
    "Riv",
    "Sol",
    "Tor",
    "Ust",
    "Vey",
    "Wil",
    "Xan",
    "Yel",
    "Zor",
]
_FIRST_ENDS = [
    "ana",
    "ber",
    "cia",
    "dric",
    "elle",
    "frey",
    "gard",
    "ine",
    "ian",
    "mira",
    "ott",
    "ric",
    "sa",
    "tine",
    "wen",
    "ya",
]
_SURNAME_ENDS = ["berg", "dahl", "escu", "garten", "hoff", "kov", "lund", "ovic", "sen", "thorpe", "vall"]
_TOWN_ENDS = ["brook", "bury", "field", "gate", "heim", "mouth", "stow", "thal", "wold", "ton"]
_RIVER_ENDS = ["anna", "ebb", "idra", "olt", "usk", "wey"]
_REGIONS = ["Northmark", "Saltlands", "Ambervale", "Greyfen", "High Coppice", "Lowmere", "Eastreach"]
_COMPANY_WORDS = [
    "Quorvane",
    "Halcyra",
    "Brightlow",
    "Ostrel",
    "Verdane",
    "Kettleby",
    "Marrowind",
    "Solvent Crane",
    "Tallowick",
    "Pennistow",
    "Greyhame",
    "Umbrix",
    "Cinderfall",
    "Lusk",
]
_COMPANY_KINDS = ["Instruments", "Works", "Foundry", "Mills", "Laboratories", "Supply", "Textiles"]
OCCUPATIONS = [
    "clockmaker",
    "cartographer",
    "glassblower",
    "violin maker",
    "bookbinder",
    "beekeeper",
    "ferry pilot",
    "stonemason",
    "lens grinder",
    "tea blender",
    "sail maker",
    "organ builder",
    "archivist",
    "botanist",
    "bridge engineer",
    "puppeteer",
]
PRODUCTS = [
    "brass barometers",
    "wool blankets",
    "ceramic insulators",
    "folding kayaks",
    "pocket compasses",
    "copper kettles",
    "glass floats",
    "wind chimes",
    "paper lanterns",
    "rope ladders",
    "tide clocks",
    "oak barrels",
]


@dataclass
class Town:
    name: str
    region: str
    river: str
    population: int


@dataclass
class Company:
    name: str
    founded: int
    hq: str  # town name
    founder: str  # person name
    product: str


@dataclass
class Person:
    name: str
    born: int
    birthplace: str  # town name
    occupation: str
    employer: str  # company name


@dataclass
class World:
    towns: dict[str, Town]
    companies: dict[str, Company]
    people: dict[str, Person]


def _distinct(rng: random.Random, make, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = make()
        if v not in out:
            out.append(v)
    return out


def make_world(rng: random.Random, n_people: int = 14, n_companies: int = 6, n_towns: int = 8) -> World:
    """Random entities; every company has a founder and every person an employer among them."""
    town_names = _distinct(rng, lambda: rng.choice(_ONSETS) + rng.choice(_TOWN_ENDS), n_towns)
    rivers = _distinct(rng, lambda: rng.choice(_ONSETS) + rng.choice(_RIVER_ENDS), n_towns)
    towns = {
        t: Town(t, rng.choice(_REGIONS), r, rng.randrange(2_000, 250_000, 100))
        for t, r in zip(town_names, rivers, strict=True)
    }
    # Distinct first names: passages refer to people by first name in their second sentence.
    firsts = _distinct(rng, lambda: rng.choice(_ONSETS) + rng.choice(_FIRST_ENDS), n_people)
    person_names = [f"{f} {rng.choice(_ONSETS)}{rng.choice(_SURNAME_ENDS)}" for f in firsts]
    company_names = _distinct(
        rng, lambda: f"{rng.choice(_COMPANY_WORDS)} {rng.choice(_COMPANY_KINDS)}", n_companies
    )
    companies = {
        c: Company(
            c, rng.randint(1840, 2005), rng.choice(town_names), rng.choice(person_names), rng.choice(PRODUCTS)
        )
        for c in company_names
    }
    people = {
        p: Person(
            p,
            rng.randint(1920, 1998),
            rng.choice(town_names),
            rng.choice(OCCUPATIONS),
            rng.choice(company_names),
        )
        for p in person_names
    }
    return World(towns, companies, people)


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


def person_text(p: Person, rng: random.Random) -> str:
    """A short biography; several phrasings so passages do not share one surface form."""
    a = _article(p.occupation)
    return rng.choice(
        [
            f"{p.name} is {a} {p.occupation} born in {p.birthplace} in {p.born}. "
            f"{p.name.split()[0]} works for {p.employer}.",
            f"Born in {p.born} in the town of {p.birthplace}, {p.name} trained as {a} {p.occupation} "
            f"and is employed by {p.employer}.",
            f"{p.name} ({p.born}) is {a} {p.occupation}. A native of {p.birthplace}, "
            f"{p.name.split()[0]} later joined the staff of {p.employer}.",
        ]
    )


def company_text(c: Company, rng: random.Random) -> str:
    return rng.choice(
        [
            f"{c.name} was founded in {c.founded} by {c.founder}. The firm makes {c.product} "
            f"and is headquartered in {c.hq}.",
            f"Headquartered in {c.hq}, {c.name} produces {c.product}. It was established in {c.founded} "
            f"by {c.founder}.",
            f"{c.name} is a manufacturer of {c.product} based in {c.hq}. {c.founder} founded the company "
            f"in {c.founded}.",
        ]
    )


def town_text(t: Town, rng: random.Random) -> str:
    return rng.choice(
        [
            f"{t.name} is a town in the {t.region} region, on the river {t.river}. "
            f"It has about {t.population} inhabitants.",
            f"Lying on the banks of the {t.river}, {t.name} is home to roughly {t.population} people "
            f"and belongs to the {t.region} region.",
        ]
    )


def passages_of(world: World, rng: random.Random) -> dict[str, str]:
    """``{entity name: passage text}`` for every entity (the title of a passage is its entity's name)."""
    out: dict[str, str] = {}
    for p in world.people.values():
        out[p.name] = person_text(p, rng)
    for c in world.companies.values():
        out[c.name] = company_text(c, rng)
    for t in world.towns.values():
        out[t.name] = town_text(t, rng)
    return out
