"""Answer kinds (complete / cut short / partial / none / empty) of every configuration of saved ablation
JSONs (`retmask ablate` writes them; results written before answer kinds existed are classified from the
needles stored with them). Prints one markdown table per file.

    python bench/ablate_kinds.py bench/results/ablate_smollm2.json bench/results/ablate_smollm2_nonret.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from retmask.evaluate.ablate import answer_kinds_table
from retmask.evaluate.niah import NiahResult


def kinds_page(path: Path) -> str:
    data = json.loads(path.read_text())
    rows = [
        (c["name"], [tuple(h) for h in c["heads"]], NiahResult.from_json(c["result"]))
        for c in data["configs"]
    ]
    meta = data["meta"]
    head = (
        f"`{path.name}` (random heads drawn from {meta.get('random_from', 'all')}, "
        f"{meta.get('tests_per_config')} tests per configuration):"
    )
    return head + "\n\n" + answer_kinds_table(rows, max_heads=6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", type=Path, help="ablation JSON files (`retmask ablate` <prefix>.json)")
    for path in ap.parse_args().json:
        print(kinds_page(path) + "\n")


if __name__ == "__main__":
    main()
