"""How a stopped token's time grows with the layers it runs, against what calibration's cost model fits.

Calibration times native head-free stops (mask mode) at a quarter, half and three quarters of the depth and
prices every exit on a parabola through them (specee_edge/runtime/costs.py; it was a line). This times the
same stop at more depths, in turns with a plain token, on freshly loaded models, and prints how far each
stop's median lies from the line and from the parabola through the three, so that what either misprices at
the depths where a model's exits are can be read off.

    .venv/bin/python tools/stop_curve.py                     # the default model, its shipped pack
    .venv/bin/python tools/stop_curve.py MODEL.gguf --pack PACK.specee.gguf --every 2 --rounds 5
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from rich.console import Console
from rich.table import Table

from specee_edge.bench.run import draft_setup
from specee_edge.default_model import default_model_path
from specee_edge.engine.engine import AUTO, Engine, EngineConfig
from specee_edge.engine.sampling import GREEDY
from specee_edge.runtime.costs import CostLane, checked_context, lane_context, stop_layers, time_rounds
from specee_edge.runtime.model import Model

PROMPT = "Explain how a hash map works, with an example in Python."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="a GGUF (default: the default model)")
    parser.add_argument("--pack", default=None, help="its pack (default: the one beside it or shipped)")
    parser.add_argument("--every", type=int, default=4, help="a stop every N layers")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each on a freshly loaded model")
    parser.add_argument("--tokens", type=int, default=96, help="timed tokens per round")
    parser.add_argument("-t", "--threads", type=int, default=2)
    args = parser.parse_args()
    model_path = args.model or default_model_path()

    engine = Engine(model_path, pack=args.pack or AUTO, config=EngineConfig(n_threads=args.threads))
    try:
        setup, k, n_layer = draft_setup(engine), engine.policy.k, engine.model.info.n_layer
        prompt = engine.prompt_tokens(PROMPT)
        tokens = prompt + engine.generate(prompt, max_tokens=args.tokens, sampling=GREEDY).tokens
    finally:
        engine.close()
    depths = sorted({*range(args.every - 1, n_layer, args.every), n_layer - 1, *stop_layers(n_layer)})
    n_ctx = len(tokens) + 8

    def lanes(model: Model) -> list[CostLane]:
        stops = [CostLane(f"stop@{il}", checked_context(model, setup, [il], threshold=-1.0, n_ctx=n_ctx,
                                                         n_threads=args.threads, k=k), il + 1) for il in depths]
        plain = lane_context(model, n_ctx=n_ctx, n_threads=args.threads, k=k, kv_mode=None)
        return [CostLane("plain", plain, n_layer), *stops]

    rounds = time_rounds(model_path, lanes, [(tokens, len(prompt))], rounds=args.rounds, seed=0)
    samples: dict[str, list[float]] = {}
    for lanes_of_round in rounds:
        for lane in lanes_of_round:
            samples.setdefault(lane.name, []).extend(lane.samples)
    ms = {name: float(np.median(values)) for name, values in samples.items()}
    timed = len(tokens) - len(prompt)
    fitted = stop_layers(n_layer)
    x, y = np.array(fitted, float) + 1, np.array([ms[f"stop@{il}"] for il in fitted])
    slope, intercept = np.polyfit(x, y, 1)  # the cost model before the curvature
    parabola = np.polyfit(x, y, 2)  # calibration's curve, but for the curvature it shares with the fill stops

    table = Table(title=f"a head-free stop (mask mode), median ms over {args.rounds} rounds of {timed} tokens; a plain "
                        f"token {ms['plain']:.3f} ms")
    for column in ("layers run", "measured", "- line (% of plain)", "- parabola (% of plain)"):
        table.add_column(column, justify="right")
    for il in depths:
        measured = ms[f"stop@{il}"]
        off = [measured - (intercept + slope * (il + 1)), measured - np.polyval(parabola, il + 1)]
        table.add_row(f"{il + 1}{' *' if il in fitted else ''}", f"{measured:.3f}",
                      *(f"{ms_off:+.3f} ({100 * ms_off / ms['plain']:+.1f})" for ms_off in off))
    console = Console()
    console.print(table)
    console.print(f"* the stops calibration times; the line through them: {intercept:.3f} ms + {slope:.4f} ms per "
                  "layer (the cost model before the curvature), the parabola: what calibration fits now")
    return 0


if __name__ == "__main__":
    sys.exit(main())
