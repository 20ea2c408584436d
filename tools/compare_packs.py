"""Two calibrations of one model, side by side: do they agree on which levels are on, and does each timed
cost lie inside the other's 95% interval?

That last test is strict: even where both intervals are honest 95% intervals of the same width, one run's
point lies inside the other's interval only 83% of the time (the two points differ by the noise of both),
so 9 parts checked both ways all pass in a minority of repeats. The table also gives the test that holds
95% of the time where nothing is wrong: the two runs differ by less than the 95% half-width of their
difference (the two half-widths added in quadrature). A machine that runs a few per cent faster in one
run than in the other moves every part alike, which no interval from within one run can see; the
decisions price ratios to a plain token, so the costs are compared again in shares of a plain token.

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
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from specee_edge.pack import read_pack
from specee_edge.pack.format import quality_name
from specee_edge.runtime.costs import PARTS


@dataclass
class Compared:
    table: Table
    parts: int
    inside: int  # each run's point inside the other's interval
    within: int  # the difference within its 95% half-width


def cost_table(c: list[dict], title: str, unit: list[float], skip: tuple[str, ...] = ()) -> Compared:
    """Each part of the two runs' costs (pack provenance costs_ms), each run's divided by its `unit`."""
    table = Table(title=title)
    for column in ("part", "first", "second", "inside both ways", "difference (95% half-width)", "within"):
        table.add_column(column, justify="right")
    compared = Compared(table, 0, 0, 0)
    # older packs have no mask_ms
    for part in (part for part in PARTS if part not in skip and all(part in run["intervals"] for run in c)):
        (x0, (lo0, hi0)), (x1, (lo1, hi1)) = ((run[part] / u, [v / u for v in run["intervals"][part]])
                                              for run, u in zip(c, unit))
        inside = lo1 <= x0 <= hi1 and lo0 <= x1 <= hi0
        difference, half_width = x1 - x0, math.hypot((hi0 - lo0) / 2, (hi1 - lo1) / 2)
        within = abs(difference) <= half_width
        compared.parts += 1
        compared.inside += inside
        compared.within += within
        table.add_row(part, f"{x0:.3f} ({lo0:.3f}-{hi0:.3f})", f"{x1:.3f} ({lo1:.3f}-{hi1:.3f})",
                      "yes" if inside else "no", f"{difference:+.3f} ({half_width:.3f})", "yes" if within else "no")
    return compared


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

    c = [pack.provenance["costs_ms"] for pack in packs]
    in_ms = cost_table(c, "costs (ms): each run's point against the other's 95% interval, and their difference",
                       [1.0, 1.0])
    # a machine that runs a few per cent faster in one run moves every part alike; the decisions price ratios
    shares = cost_table(c, "the same in shares of a plain token (%; the plain token's own noise left out)",
                        [run["plain_ms"] / 100 for run in c], skip=("plain_ms",))
    console = Console()
    console.print(levels, in_ms.table, shares.table)
    console.print(f"same levels on and off: {'yes' if same_levels else 'no'}; same names: {'yes' if same_names else 'no'}")
    for what, compared in (("in ms", in_ms), ("in shares of a plain token", shares)):
        console.print(f"{what}: inside the other's interval both ways {compared.inside} of {compared.parts}, difference "
                      f"within its 95% half-width {compared.within} of {compared.parts}")
    inside_all = in_ms.inside == in_ms.parts
    return 0 if same_levels and inside_all else 1


if __name__ == "__main__":
    sys.exit(main())
