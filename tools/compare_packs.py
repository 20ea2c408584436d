"""Two calibrations of one model, side by side: do they agree on which levels are on, and does each timed
cost lie inside the other's 95% interval?

That last test is strict: even where both intervals are honest 95% intervals of the same width, one run's
point lies inside the other's interval only 83% of the time (the two points differ by the noise of both),
so 9 parts checked both ways all pass in a minority of repeats. The table also gives the test that holds
95% of the time where nothing is wrong: the two runs differ by less than the 95% half-width of their
difference (the two half-widths added in quadrature).

Calibrate twice from the same work dir (the answers are reused, the costs and the engine's runs are not),
then compare:

    specee-edge calibrate MODEL --work-dir W -o a.specee.gguf
    specee-edge calibrate MODEL --work-dir W -o b.specee.gguf
    .venv/bin/python tools/compare_packs.py a.specee.gguf b.specee.gguf
"""

from __future__ import annotations

import argparse
import math
import sys

from rich.console import Console
from rich.table import Table

from specee_edge.pack import read_pack
from specee_edge.pack.format import quality_name
from specee_edge.runtime.costs import PARTS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    args = parser.parse_args()
    packs = [read_pack(args.first), read_pack(args.second)]
    report = [pack.provenance["report"] for pack in packs]

    levels = Table(title="levels: asked -> shipped as (on / off)")
    for column in ("asked", "first", "second", "same on/off", "same name"):
        levels.add_column(column, justify="right")
    same_levels = same_names = True
    for a, b in zip(report[0]["levels"], report[1]["levels"]):
        on = [bool(r["verified_layers"] or r["head_free_layers"]) for r in (a, b)]
        names = ["dropped" if not r["quality"] else f"{r['quality']:g}" for r in (a, b)]
        same_levels &= on[0] == on[1]
        same_names &= names[0] == names[1]
        levels.add_row(f"{a['asked']:g}", *(f"{name} {'on' if o else 'off'}" for name, o in zip(names, on)),
                       "yes" if on[0] == on[1] else "no", "yes" if names[0] == names[1] else "no")
    exact = [pack.levels[-1] for pack in packs]
    drafts = [(level.drafts(True), level.drafts(False)) for level in exact]
    same_levels &= drafts[0] == drafts[1]
    levels.add_row(quality_name(1.0), *(f"drafts greedy {g}, sampled {s}" for g, s in drafts),
                   "yes" if drafts[0] == drafts[1] else "no", "")

    costs = Table(title="costs (ms): each run's point against the other's 95% interval, and their difference")
    for column in ("part", "first", "second", "inside both ways", "difference (95% half-width)", "within"):
        costs.add_column(column, justify="right")
    inside_all = within_all = True
    c = [pack.provenance["costs_ms"] for pack in packs]
    for part in (part for part in PARTS if all(part in run["intervals"] for run in c)):  # older packs: no mask_ms
        (lo0, hi0), (lo1, hi1) = c[0]["intervals"][part], c[1]["intervals"][part]
        inside = lo1 <= c[0][part] <= hi1 and lo0 <= c[1][part] <= hi0
        difference, half_width = c[1][part] - c[0][part], math.hypot((hi0 - lo0) / 2, (hi1 - lo1) / 2)
        within = abs(difference) <= half_width
        inside_all &= inside
        within_all &= within
        costs.add_row(part, f"{c[0][part]:.3f} ({lo0:.3f}-{hi0:.3f})", f"{c[1][part]:.3f} ({lo1:.3f}-{hi1:.3f})",
                      "yes" if inside else "no", f"{difference:+.3f} ({half_width:.3f})", "yes" if within else "no")
    console = Console()
    console.print(levels, costs)
    console.print(f"same levels on and off: {'yes' if same_levels else 'no'}; same names: {'yes' if same_names else 'no'}; "
                  f"every cost inside the other's interval: {'yes' if inside_all else 'no'}; every difference within"
                  f" its 95% half-width: {'yes' if within_all else 'no'}")
    return 0 if same_levels and inside_all else 1


if __name__ == "__main__":
    sys.exit(main())
