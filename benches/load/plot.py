#!/usr/bin/env python3
"""Draws the benchmark page's plot from recorded figures, with no dependency beyond Python.

Reads benches/load/figures.csv (decisions a second of sluice and of the transport floor per
scenario, each row naming the run of docs/src/benchmarks/log.md it was copied from) and writes
docs/src/benchmarks/throughput.svg: one pair of bars per scenario, the floor (where one ran beside it) and sluice.
Figures are never measured here; a new run adds its medians to the CSV and draws again.
"""

import argparse
import csv
import html
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def svg(rows):
    bar, gap, left, width = 14, 14, 290, 420
    top = 40
    height = top + len(rows) * (2 * bar + gap) + 40
    most = max(int(r[k]) for r in rows for k in ("floor_per_s", "sluice_per_s") if r[k])
    scale = width / most
    commits = sorted({r["commit"] for r in rows})
    dates = sorted({r["date"] for r in rows})
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 90}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="10" y="20" font-size="14">Decisions a second, release build of {", ".join(commits)} '
        f'({", ".join(dates)}), medians of three rounds</text>',
    ]
    y = top
    for r in rows:
        out.append(f'<text x="{left - 8}" y="{y + bar + 4}" text-anchor="end">'
                   f'{html.escape(r["scenario"])}</text>')
        for key, colour, name in (("floor_per_s", "#bbbbbb", "floor"),
                                  ("sluice_per_s", "#2b6cb0", "sluice")):
            if not r[key]:  # no floor was run beside this scenario
                y += bar
                continue
            value = int(r[key])
            w = value * scale
            out.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar}" fill="{colour}">'
                       f'<title>{name}: {value:,}/s</title></rect>')
            out.append(f'<text x="{left + w + 4:.1f}" y="{y + bar - 3}">{value:,}</text>')
            y += bar
        y += gap
    out.append(f'<rect x="{left}" y="{height - 26}" width="12" height="12" fill="#bbbbbb"/>'
               f'<text x="{left + 16}" y="{height - 16}">transport floor</text>'
               f'<rect x="{left + 130}" y="{height - 26}" width="12" height="12" fill="#2b6cb0"/>'
               f'<text x="{left + 146}" y="{height - 16}">sluice</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--figures", default=ROOT / "benches/load/figures.csv", type=Path)
    ap.add_argument("--out", default=ROOT / "docs/src/benchmarks/throughput.svg", type=Path)
    args = ap.parse_args()
    with args.figures.open(newline="") as f:
        rows = list(csv.DictReader(f))
    args.out.write_text(svg(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
