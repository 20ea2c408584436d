"""Rename or drop the lossy levels of an existing pack whose stored agreement interval falls short of their
name, by the rule calibration now applies itself (calibrate/levels.py keep_promises).

A pack calibrated before that rule stored Wilson's interval over steps, which counts a reply's steps as
independent and is too narrow: a level renamed by it still promises at most what that interval says, and
only a new calibration measures the interval over prompts.

    .venv/bin/python tools/keep_promises.py PACK [-o OUT]    (OUT: PACK itself by default)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from specee_edge.calibrate.levels import keep_promises, shipped_quality
from specee_edge.pack import Pack, read_pack, write_pack
from specee_edge.pack.format import quality_name


def promised(pack: Pack) -> tuple[Pack, list[str]]:
    """The pack with its lossy levels renamed or dropped, and a line for each change."""
    lossy = [level for level in pack.levels if not level.exact]
    shipped = keep_promises(lossy)
    changes = [f"{level.quality:g} -> {'dropped' if new is None else f'{new.quality:g}'} "
               f"(stored interval {level.agreement_interval()[0]:.4f}-{level.agreement_interval()[1]:.4f})"
               for level, new in zip(lossy, shipped) if new is None or new.quality != level.quality]
    kept = sorted((level for level in shipped if level is not None), key=lambda level: level.quality)
    default = pack.default_quality
    if default is not None and default in [level.quality for level in lossy]:
        default = shipped_quality(shipped, [level.quality for level in lossy].index(default))
    provenance = pack.provenance | {"promises": "lossy levels renamed by their stored interval: " + "; ".join(changes)}
    levels = kept + [level for level in pack.levels if level.exact]
    if default is None:
        default = levels[-1].quality
    return dataclasses.replace(pack, levels=levels, default_quality=default,
                               provenance=provenance if changes else pack.provenance), changes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack", type=Path)
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args()
    pack = read_pack(args.pack)
    new, changes = promised(pack)
    for line in changes or ["every level holds its name"]:
        print(line)
    if changes:
        write_pack(args.output or args.pack, new, draft_quant=pack.draft.quant if pack.draft else "q8_0")
        print(f"wrote {args.output or args.pack}: levels {', '.join(quality_name(lv.quality) for lv in new.levels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
