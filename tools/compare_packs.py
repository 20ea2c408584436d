"""Two calibrations of one model, side by side: do they agree on which levels are on, and does each timed
cost lie inside the other's 95% interval?

Each level is shown with the speed-up that decided it: predicted on the calibration split, it is on only
where the low end of its 95% interval is above 1, so a level whose low end sits near 1 can be on in one
run and off in the next, and the tool names such a level with both runs' predictions.

That last test is strict: even where both intervals are honest 95% intervals of the same width, one run's
point lies inside the other's interval only 83% of the time (the two points differ by the noise of both),
so 9 parts checked both ways all pass in a minority of repeats. The table also gives the test that holds
95% of the time where nothing is wrong: the two runs differ by less than the 95% half-width of their
difference (the two half-widths added in quadrature). A machine that runs faster in one run than in the
other moves the parts together (those that read weights from memory most), which no interval from
within one run can see; the decisions price ratios to a plain token, so the costs are compared again in
shares of a plain token, with the intervals the pack stores for them (packs calibrated before those were
stored: the ms intervals divided by the plain token's point, which leaves its noise out). The exit status
is 0 where both runs turned the same levels on and off and every share lies inside the other run's
interval both ways, else 1.

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


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


Estimate = tuple[float, tuple[float, float]]  # a point and its 95% interval


def in_ms(costs: dict) -> dict[str, Estimate]:
    """Each part's ms (pack provenance costs_ms); older packs lack the later parts (mask_ms, curve_ms)."""
    return {part: (costs[part], tuple(costs["intervals"][part])) for part in PARTS if part in costs["intervals"]}


def in_shares(costs: dict) -> dict[str, Estimate]:
    """Each part but the plain token, in % of a plain token (older packs: see the module docstring)."""
    plain = costs["plain_ms"]
    stored = costs.get("share_intervals") or {part: [v / plain for v in interval]
                                              for part, interval in costs["intervals"].items() if part != "plain_ms"}
    return {part: (100 * costs[part] / plain, (100 * stored[part][0], 100 * stored[part][1]))
            for part in PARTS if part in stored}


def cost_table(runs: list[dict[str, Estimate]], title: str) -> Compared:
    """The parts both runs have, side by side."""
    table = Table(title=title)
    for column in ("part", "first", "second", "inside both ways", "difference (95% half-width)", "within"):
        table.add_column(column, justify="right")
    compared = Compared(table, 0, 0, 0)
    for part in (part for part in PARTS if all(part in run for run in runs)):
        (x0, (lo0, hi0)), (x1, (lo1, hi1)) = (run[part] for run in runs)
        inside = lo1 <= x0 <= hi1 and lo0 <= x1 <= hi0
        difference, half_width = x1 - x0, math.hypot((hi0 - lo0) / 2, (hi1 - lo1) / 2)
        within = abs(difference) <= half_width
        compared.parts += 1
        compared.inside += inside
        compared.within += within
        table.add_row(part, f"{x0:.3f} ({lo0:.3f}-{hi0:.3f})", f"{x1:.3f} ({lo1:.3f}-{hi1:.3f})",
                      yes_no(inside), f"{difference:+.3f} ({half_width:.3f})", yes_no(within))
    return compared


@dataclass
class LevelsCompared:
    table: Table
    same_on_off: bool
    same_names: bool
    flipped: list[str]  # a line for each level on in one run only: how far its predicted speed-up cleared 1


def predicted(level: dict) -> str:
    """A lossy level's speed-up predicted on the calibration split, with the low end of its 95% interval; "no
    exits" where no point of the search's path kept the level's quality in the engine (stored as 1x)."""
    speedup, low = level["calibration_speedup"], level["calibration_speedup_low"]
    return "no exits" if speedup == low == 1.0 else f"{speedup:.3f}x, low end {low:.3f}"


def level_table(reports: list[list[dict]], exact: list) -> LevelsCompared:
    """The levels of two packs side by side (their provenance report's levels, their exact levels): which are on,
    the name each ships under, and the speed-up that decided it (a level is on only where the low end is above 1)."""
    table = Table(title="levels: asked -> shipped as (on / off), predicted speed-up, low end of its 95% interval")
    for column in ("asked", "first", "second", "same on/off", "same name"):
        table.add_column(column, justify="right")
    compared = LevelsCompared(table, True, True, [])
    for a, b in zip(*reports):
        on = [bool(r["verified_layers"] or r["head_free_layers"]) for r in (a, b)]
        names = ["dropped" if not r["quality"] else f"{r['quality']:g}" for r in (a, b)]
        compared.same_on_off &= on[0] == on[1]
        compared.same_names &= names[0] == names[1]
        table.add_row(f"{a['asked']:g}", *(f"{name} {'on' if o else 'off'}, {predicted(r)}" for name, o, r in
                                          zip(names, on, (a, b))),
                      yes_no(on[0] == on[1]), yes_no(names[0] == names[1]))
        if on[0] != on[1]:
            kept, other = (a, b) if on[0] else (b, a)
            compared.flipped.append(f"{a['asked']:g}: on in the {'first' if on[0] else 'second'} run "
                                    f"({predicted(kept)}), off in the other ({predicted(other)})")
    drafts = [(level.drafts(True), level.drafts(False)) for level in exact]
    compared.same_on_off &= drafts[0] == drafts[1]
    table.add_row(quality_name(1.0), *(f"drafts: greedy {yes_no(g)}, sampled {yes_no(s)}" for g, s in drafts),
                  yes_no(drafts[0] == drafts[1]), "")
    return compared


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    args = parser.parse_args()
    packs = [read_pack(args.first), read_pack(args.second)]
    report = [pack.provenance["report"] for pack in packs]

    levels = level_table([r["levels"] for r in report], [pack.levels[-1] for pack in packs])
    c = [pack.provenance["costs_ms"] for pack in packs]
    ms = cost_table([in_ms(run) for run in c],
                    "costs (ms): each run's point against the other's 95% interval, and their difference")
    # a machine that runs faster for a whole run moves the parts in ms together; the decisions price ratios
    shares = cost_table([in_shares(run) for run in c], "the same in shares of a plain token (%)"
                        + ("" if all("share_intervals" in run for run in c) else "; the plain token's own noise left out"))
    console = Console()
    console.print(levels.table, ms.table, shares.table)
    console.print(f"same levels on and off: {yes_no(levels.same_on_off)}; "
                  f"same names: {yes_no(levels.same_names)}")
    for line in levels.flipped:
        console.print(f"  {line}")
    for what, compared in (("in ms", ms), ("in shares of a plain token", shares)):
        console.print(f"{what}: inside the other's interval both ways {compared.inside} of {compared.parts}, difference "
                      f"within its 95% half-width {compared.within} of {compared.parts}")
    return 0 if levels.same_on_off and shares.inside == shares.parts else 1


if __name__ == "__main__":
    sys.exit(main())
