"""MuDAF's multi-document QA data: a synthetic generator, a validated loader and the training prompt."""

from retmask.methods.mudaf.mdqa.generate import KINDS, generate_example, generate_mdqa
from retmask.methods.mudaf.mdqa.prompt import TEMPLATE, MDQAPrompt, build_prompt
from retmask.methods.mudaf.mdqa.records import (
    MDQAError,
    MDQAExample,
    Passage,
    example_from_json,
    load_mdqa,
    write_mdqa,
)

__all__ = [
    "KINDS",
    "TEMPLATE",
    "MDQAError",
    "MDQAExample",
    "MDQAPrompt",
    "Passage",
    "build_prompt",
    "example_from_json",
    "generate_example",
    "generate_mdqa",
    "load_mdqa",
    "write_mdqa",
]
