"""What a check after a layer that lives on an RPC worker costs, against the same check on one machine.

Two copies of the model: one on this machine, one split (the last -ngl layers on the --rpc workers). On
each, lanes decode the same tokens one at a time in turns (runtime/costs.py's lanes: a native check that
never fires after one layer, or a head-free stop there); the medians give, per check,

    extra = (split checked@l - split plain) - (one-machine checked@l - one-machine plain)

the time a probe read across the network adds to a token on top of what the check costs anyway, for a
layer l on the client and a layer on a worker; and the replies each lane waited for per token.

    .venv/bin/python tools/rpc_round_trip.py --rpc 127.0.0.1:50052,127.0.0.1:50053 -ngl 20 --tokens 48
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass

from specee_edge.default_model import default_model_path
from specee_edge.engine import GREEDY, Engine, EngineConfig
from specee_edge.runtime import Model, rpc
from specee_edge.runtime.costs import CostLane, DraftSetup, checked_context, lane_context
from specee_edge.runtime.placement import Placement

PROMPT = "Explain what a compiler does, step by step."


@dataclass
class LaneFigures:
    name: str
    ms: float             # median per token
    replies: float        # per token (0 on one machine)


def lanes(model: Model, setup: DraftSetup, layers: dict[str, int], n_threads: int, k: int) -> list[CostLane]:
    ctx = {"n_ctx": 512, "n_threads": n_threads, "k": k}
    out = [CostLane("plain", lane_context(model, kv_mode=None, **ctx), model.info.n_layer)]
    for where, il in layers.items():
        out.append(CostLane(f"checked@{where}", checked_context(model, setup, [il], **ctx), model.info.n_layer))
        out.append(CostLane(f"stop@{where}", checked_context(model, setup, [il], threshold=-1.0, **ctx), il + 1))
    return out


def run(lane_sets: dict[str, tuple[list[CostLane], tuple[rpc.Endpoint, ...]]], prompt: list[int],
        tokens: list[int]) -> dict[str, list[LaneFigures]]:
    """Every lane of every set steps each token in turn; per lane, the median ms and replies per token."""
    replies = {key: [rpc.Replies()] * len(lanes_) for key, (lanes_, _) in lane_sets.items()}
    for lanes_, _ in lane_sets.values():
        for lane in lanes_:
            lane.start(prompt)
    for token in tokens:
        for key, (lanes_, workers) in lane_sets.items():
            for i, lane in enumerate(lanes_):
                before = rpc.replies(workers)
                lane.step(token)
                replies[key][i] = replies[key][i] + (rpc.replies(workers) - before)
    return {key: [LaneFigures(lane.name, statistics.median(lane.samples), r.count / len(tokens))
                  for lane, r in zip(lanes_, replies[key])]
            for key, (lanes_, _) in lane_sets.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rpc", required=True, help="HOST:PORT[,HOST:PORT...]")
    parser.add_argument("-ngl", "--n-gpu-layers", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    workers = rpc.parse_endpoints(args.rpc)

    engine = Engine(config=EngineConfig(n_ctx=512, n_threads=args.threads))
    prompt = engine.tokenize(engine.format_chat([{"role": "user", "content": PROMPT}]))
    engine.set_early_exit(False)
    tokens = [r.id for r in engine.stream(prompt, max_tokens=args.tokens, sampling=GREEDY)]
    mlp = engine.policy.predictors[max(engine.policy.predictors)]
    setup = DraftSetup(engine.policy.draft.runtime_args(), (mlp.weights, mlp.biases))
    k = engine.policy.k
    n_layer = engine.n_layer
    engine.close()

    first_remote = n_layer + 1 - args.n_gpu_layers
    layers = {"client": first_remote - 2, "worker": (first_remote + n_layer) // 2}
    local = Model(default_model_path(), placement=Placement())
    rpc.connect(workers)
    split = Model(default_model_path(), placement=Placement(args.n_gpu_layers, (1.0,) * len(workers)))
    figures = run({"one machine": (lanes(local, setup, layers, args.threads, k), ()),
                   "split": (lanes(split, setup, layers, args.threads, k), workers)}, prompt, tokens[:-1])
    bare = [rpc.round_trip_ms(w) for w in workers]

    by_name = {key: {f.name: f for f in rows} for key, rows in figures.items()}
    print(f"layers 0-{first_remote - 1} on this machine, {first_remote}-{n_layer - 1} and the head on {args.rpc};"
          f" {len(tokens) - 1} tokens; a bare round trip {statistics.mean(bare):.3f} ms")
    print(f"{'lane':<16}{'one machine ms':>16}{'split ms':>12}{'replies/token':>15}")
    for name in by_name["split"]:
        one, two = by_name["one machine"][name], by_name["split"][name]
        print(f"{name:<16}{one.ms:>16.3f}{two.ms:>12.3f}{two.replies:>15.2f}")
    extra = {}
    for where, il in layers.items():
        for kind in ("checked", "stop"):
            lane = f"{kind}@{where}"
            extra[lane] = ((by_name["split"][lane].ms - by_name["split"]["plain"].ms)
                           - (by_name["one machine"][lane].ms - by_name["one machine"]["plain"].ms))
            print(f"{lane} (layer {il}): the split adds {extra[lane]:+.3f} ms over the same lane on one machine")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": layers, "bare_round_trip_ms": bare, "extra_ms": extra,
                       "lanes": {key: [vars(f) for f in rows] for key, rows in figures.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
