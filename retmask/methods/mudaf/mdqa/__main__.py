"""``python -m retmask.methods.mudaf.mdqa --n 200 --out mdqa.jsonl [--distractors K] [--seed S]``: write synthetic MDQA."""

from __future__ import annotations

import argparse

from retmask.methods.mudaf.mdqa.generate import generate_mdqa
from retmask.methods.mudaf.mdqa.records import MDQAError, write_mdqa


def main(argv: list[str] | None = None) -> int:
    """Generate examples and write them as JSONL."""
    p = argparse.ArgumentParser(
        prog="python -m retmask.methods.mudaf.mdqa", description="Write synthetic multi-document QA."
    )
    p.add_argument("--n", type=int, default=200, help="number of examples")
    p.add_argument("--distractors", type=int, default=8, help="distractor passages per example (K)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSONL file to write")
    args = p.parse_args(argv)
    try:
        path = write_mdqa(generate_mdqa(args.n, args.seed, args.distractors), args.out)
    except MDQAError as e:
        p.error(str(e))
    print(f"{args.n} MDQA examples -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
