"""Page: the prefill chunk's effect on `retmask detect`, from several `bench_detect.py --chunk N` runs.

``bench_detect.py`` times the fast side against the reference procedure for one chunk; this script puts
the runs of several chunks (same machine, grid, model and dtype, e.g. one GPU session) side by side: prompt
tokens computed, prefill and decode time of the fast side, its total against the smallest chunk's, and
each run's agreement with the reference side (the reference does not depend on the chunk, so equal
agreement lines mean the fast side gave the same answers). It measures nothing itself.

    python bench/detect_chunk_summary.py RUN.json [RUN.json ...] --out bench/results/detect_chunk_h100_bf16

Each RUN.json is a `bench_detect.py` summary; its ``prefill_chunk`` field names the chunk.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, page_tail, save_figure, write_page  # noqa: E402

SAME_RUN_KEYS = ("device", "model", "dtype", "grid", "haystack_sha256")


def load_runs(paths: list[Path]) -> list[dict]:
    """The runs sorted by chunk; refuses runs of different settings or without a chunk."""
    runs = [json.loads(p.read_text()) for p in paths]
    for path, run in zip(paths, runs, strict=True):
        if "prefill_chunk" not in run:
            raise SystemExit(
                f"{path}: no prefill_chunk field (bench_detect.py records it since 2026-11-26); add the chunk that "
                "run used, or rerun it"
            )
    for key in SAME_RUN_KEYS:
        values = {json.dumps(r.get(key), sort_keys=True) for r in runs}
        if len(values) > 1:
            raise SystemExit(f"the runs differ in {key!r} ({sorted(values)}): compare runs of one setting")
    return sorted(runs, key=lambda r: r["prefill_chunk"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", type=Path, nargs="+", help="bench_detect.py summary JSONs, one per chunk")
    ap.add_argument("--out", type=Path, required=True, help="page stem (writes .md, .json, .png)")
    args = ap.parse_args()
    runs = load_runs(args.runs)
    base = runs[0]["fast_total_s"]
    rows = []
    for r in runs:
        fast = r["phases"]["fast"]
        rows.append(
            dict(
                chunk=r["prefill_chunk"], tokens=fast["prefill_tokens"], prefill_s=fast["prefill_s"],
                decode_s=fast["decode_s"], fast_s=r["fast_total_s"], vs_first=r["fast_total_s"] / base,
                reference_s=r["reference_total_s"], speedup=r["speedup"],
                agreement=f"{r['identical_answers']} answers, Spearman {r['spearman_over_heads']:.4f}",
            )
        )  # fmt: skip
    first = runs[0]
    where = first["machine"].get("gpu") or first["machine"].get("cpu", "?")
    title = f"`retmask detect` by prefill chunk ({first['model']}, {first['dtype']}, {where})"
    grid = first["grid"]
    lines = [
        f"# {title}",
        "",
        f"{grid['tests']} tests = lengths {grid['lengths']} x depths {grid['depths']} x {grid['needles']} "
        f"needles; one `bench/bench_detect.py --chunk N` run per chunk, run one after another on one machine. "
        f"Fast side = `retmask detect`'s path; 'vs {runs[0]['prefill_chunk']}' is its total time over "
        f"chunk {runs[0]['prefill_chunk']}'s. The reference side does not depend on the chunk: its time "
        "shows the machine's drift between runs.",
        "",
        markdown_table(
            [
                "chunk",
                "prompt tokens computed",
                "prefill s",
                "decode s",
                "fast total s",
                f"vs {runs[0]['prefill_chunk']}",
                "reference s",
                "speed-up",
                "agreement with the reference",
            ],
            [
                [
                    str(r["chunk"]),
                    str(r["tokens"]),
                    f"{r['prefill_s']:.2f}",
                    f"{r['decode_s']:.2f}",
                    f"{r['fast_s']:.2f}",
                    f"{r['vs_first']:.2f}",
                    f"{r['reference_s']:.1f}",
                    f"{r['speedup']:.1f}x",
                    r["agreement"],
                ]
                for r in rows
            ],
        ),  # fmt: skip
        *page_tail(args.out, first["machine"]),
        "",
    ]
    write_page(
        args.out, lines, {"runs": [str(p) for p in args.runs], "rows": rows, "machine": first["machine"]}
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    labels = [str(r["chunk"]) for r in rows]
    prefill = [r["prefill_s"] for r in rows]
    ax.bar(labels, prefill, label="prefill")
    ax.bar(labels, [r["decode_s"] for r in rows], bottom=prefill, label="decode (verification passes)")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['tokens'] / 1000:.0f}K tok", (i, r["fast_s"]), ha="center", va="bottom", fontsize=7)
    ax.set(xlabel="prefill chunk (tokens)", ylabel="fast side, seconds")
    ax.legend(fontsize=8)
    save_figure(fig, args.out.with_suffix(".png"), title.replace("`", ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
