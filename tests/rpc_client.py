"""The client side of tests/test_rpc.py, run in its own process: registering RPC workers with ggml lasts
as long as the process, and the test process goes on to load models that must not see them.

    python -m tests.rpc_client compare PACK LAYERS HOST:PORT,...   one JSON line: tokens, exits, replies, devices
    python -m tests.rpc_client kill PACK LAYERS HOST:PORT,...      waits for a line on stdin mid-reply
    python -m tests.rpc_client local_stop PACK LAYERS HOST:PORT,...  the replies a token stopped before the first
                                                                    remote layer waits for
    python -m tests.rpc_client costs PACK LAYERS HOST:PORT,...     the cost lanes' parts on the split model (JSON)

LAYERS is -ngl's count (llama.cpp's placement: the last layers on the workers), or first:N for SpecEE's (the
first layers on the workers, --offload-first).
"""

from __future__ import annotations

import hashlib
import json
import sys

from specee_edge.default_model import default_model_path
from specee_edge.engine import GREEDY, Engine, EngineConfig
from specee_edge.errors import SpecEEError
from specee_edge.pack import parse_quality
from specee_edge.runtime import Model, placement, rpc
from specee_edge.runtime.placement import first_crossing
from specee_edge.runtime.costs import CostLane, DraftSetup, checked_context, measure_costs

QUESTIONS = ("Explain why the sky is blue.",)  # its answers exit on both sides of the split, flash attention on or off
MODES = {"plain": None, "lossy": "0.9", "exact": "exact"}  # the shipped pack's 0.9 level; exact as the test adds it
TOKENS = 16
# engines draft at every chance (speculation="always"): the two runs must not choose by what steps cost
THREADS = 1  # the workers run a thread each: two more would wait on each other on a busy 2-core machine


def answer(engine: Engine, mode: str, question: str, max_tokens: int = TOKENS) -> dict:
    engine.set_early_exit(MODES[mode] is not None)
    if MODES[mode] is not None:
        engine.set_quality(parse_quality(MODES[mode]))
    engine.reset()
    prompt = engine.tokenize(engine.format_chat([{"role": "user", "content": question}]))
    records = list(engine.stream(prompt, max_tokens=max_tokens, sampling=GREEDY))
    # where each token's step left: a lossy exit's layer, or where an accepted draft's step exited (exact mode)
    return {"tokens": [r.id for r in records], "exits": [r.exit_layer if r.draft_layer is None else r.draft_layer
                                                         for r in records],
            "last_logits": hashlib.sha256(engine.logits().tobytes()).hexdigest()}  # the next token's, bit for bit


def all_answers(engine: Engine) -> dict[str, list[dict]]:
    return {mode: [answer(engine, mode, q) for q in QUESTIONS] for mode in MODES}


def use_workers(layers: str, endpoints: tuple[rpc.Endpoint, ...]) -> placement.Placement:
    """Connect the workers and make LAYERS (see the module docstring) every later model's placement."""
    first = layers.startswith("first:")
    chosen = placement.Placement(int(layers.removeprefix("first:")), (1.0,) * len(endpoints), offload_first=first)
    rpc.connect(endpoints)
    placement.set_default(chosen)
    return chosen


def compare(pack: str, layers: str, endpoints: tuple[rpc.Endpoint, ...]) -> dict:
    local = Engine(pack=pack, config=EngineConfig(n_ctx=512, n_threads=THREADS, speculation="always"))
    on_one_machine = all_answers(local)
    local.close()
    use_workers(layers, endpoints)
    split = Engine(pack=pack, config=EngineConfig(n_ctx=512, n_threads=THREADS, speculation="always"))
    across, used = {}, {}
    for mode in MODES:
        start = rpc.replies(endpoints)
        across[mode] = [answer(split, mode, q) for q in QUESTIONS]
        used[mode] = rpc.replies(endpoints) - start
    bare_ms = [rpc.round_trip_ms(e) for e in endpoints]
    devices = split.model.layer_devices()
    split.close()
    steps = {mode: sum(len(a["tokens"]) for a in across[mode]) for mode in MODES}
    return {"local": on_one_machine, "rpc": across,
            "replies_per_token": {m: used[m].count / steps[m] for m in MODES},
            "wait_ms_per_token": {m: used[m].wait_ms / steps[m] for m in MODES},
            "bare_round_trip_ms": bare_ms, "n_layer": split.n_layer, "devices": devices}


def kill(pack: str, layers: str, endpoints: tuple[rpc.Endpoint, ...]) -> dict:
    use_workers(layers, endpoints)
    engine = Engine(pack=pack, config=EngineConfig(n_ctx=512, n_threads=THREADS, speculation="always"))
    engine.set_quality(parse_quality("0.9"))
    prompt = engine.tokenize(engine.format_chat([{"role": "user", "content": QUESTIONS[0]}]))
    stream = engine.stream(prompt, max_tokens=64, sampling=GREEDY)
    first = [next(stream).id for _ in range(4)]
    print("mid-reply", flush=True)
    sys.stdin.readline()  # the test kills a worker now
    errors = []
    try:
        for _ in stream:
            pass
    except SpecEEError as e:
        errors.append(f"{type(e).__name__}: {e}")
    try:
        engine.generate(prompt, max_tokens=4, sampling=GREEDY)
    except SpecEEError as e:
        errors.append(f"{type(e).__name__}: {e}")
    engine.close()
    placement.set_default(placement.Placement())  # layers on this machine again: a fresh engine works
    local = Engine(pack=pack, config=EngineConfig(n_ctx=512, n_threads=THREADS, speculation="always"))
    after = local.generate(prompt, max_tokens=8, sampling=GREEDY).tokens
    local.close()
    return {"first": first, "errors": errors, "local_after": after}


def local_stop(pack: str, layers: str, endpoints: tuple[rpc.Endpoint, ...]) -> dict:
    """A context with the pack's draft head and a check after a layer on this machine that stops every token
    (head-free): the replies a token waits for although the workers' layers never run."""
    engine = Engine(pack=pack, config=EngineConfig(n_ctx=512, n_threads=THREADS))
    prompt = engine.tokenize(engine.format_chat([{"role": "user", "content": QUESTIONS[0]}]))
    tokens = engine.generate(prompt, max_tokens=TOKENS, sampling=GREEDY).tokens
    mlp = engine.policy.predictors[max(engine.policy.predictors)]
    setup = DraftSetup(engine.policy.draft.runtime_args(), (mlp.weights, mlp.biases))
    k = engine.policy.k
    engine.close()
    use_workers(layers, endpoints)
    model = Model(default_model_path())
    layer = first_crossing(model.layer_devices()) - 2  # two before the first remote layer, by llama.cpp's own map
    lane = CostLane("stop", checked_context(model, setup, [layer], threshold=-1.0, n_ctx=512, n_threads=THREADS, k=k),
                    layer + 1)
    lane.start(prompt)
    before = rpc.replies(endpoints)
    exits = []
    for token in tokens:
        lane.step(token)
        exits.append(lane.ctx.exit_layer)
    used = rpc.replies(endpoints) - before
    return {"layer": layer, "exits": exits, "replies_per_token": used.count / len(tokens)}


def costs(pack: str, layers: str, endpoints: tuple[rpc.Endpoint, ...]) -> dict:
    """The cost lanes (runtime/costs.py) on the split model, one round: the parts, each side's and the crossing's."""
    engine = Engine(pack=pack, config=EngineConfig(n_ctx=512, n_threads=THREADS))
    prompt = engine.tokenize(engine.format_chat([{"role": "user", "content": QUESTIONS[0]}]))
    tokens = engine.generate(prompt, max_tokens=TOKENS, sampling=GREEDY).tokens
    mlp = engine.policy.predictors[max(engine.policy.predictors)]
    setup = DraftSetup(engine.policy.draft.runtime_args(), (mlp.weights, mlp.biases))
    k = engine.policy.k
    engine.close()
    use_workers(layers, endpoints)
    measured = measure_costs(default_model_path(), setup, [(prompt + tokens, len(prompt))], n_threads=THREADS, k=k,
                             rounds=1)
    return measured.to_dict()


if __name__ == "__main__":
    command, pack_path, layers, workers = sys.argv[1:5]
    run = {"compare": compare, "kill": kill, "local_stop": local_stop, "costs": costs}[command]
    print(json.dumps(run(pack_path, layers, rpc.parse_endpoints(workers))), flush=True)
