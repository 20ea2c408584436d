"""One copy of the weights and a check before loading (issue: a first GPU run that fits the GPU): the bench's engines
share one loaded Model, a run that would not fit a device's free memory stops with one line before it loads more,
the cost lanes run in groups that fit, and llama-server's lanes are checked to split the model as the others do.
The device memory figures are stubbed where this machine has no device; the models, contexts and lanes are real."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specee_edge.bench import run as bench_run
from specee_edge.bench.llama_server import OFFLOAD_FIRST_LOGGED, ServerSetup, placement_not_taken
from specee_edge.bench.run import BenchConfig, check_device_memory, draft_setup, server_names
from specee_edge.engine import Engine, EngineConfig
from specee_edge.engine.sampling import GREEDY
from specee_edge.errors import SpecEEError
from specee_edge.gguf_index import GGUFIndex
from specee_edge.runtime import Model, device_memory
from specee_edge.runtime.costs import TokenCosts, cost_lanes, time_rounds
from specee_edge.runtime.device_memory import CPU, MARGIN, Footprint, check_fits, fitting, footprint
from specee_edge.runtime.placement import Placement
from tests.conftest import SHIPPED_PACK, tiny_model_path

GIB = 1 << 30
THREADS = 2


def test_the_footprint_counts_each_layer_where_it_runs(tiny_dir):
    """Every repeating layer's tensors on its layer's device, the output and its norm on the output's, the token
    embeddings nowhere (llama.cpp keeps them on the CPU) unless the output is tied to them; K/V at f16, a cell of
    each layer on that layer's device."""
    path = tiny_model_path(tiny_dir, "llama", n_layer=4)
    index = GGUFIndex(path)
    size = {t.name: t.n_bytes for t in index.tensors}
    layer = lambda il: sum(n for name, n in size.items() if name.startswith(f"blk.{il}."))  # noqa: E731
    cell = 2 * 2 * 16 * 2  # K and V, 2 KV heads of 16, 2 bytes each

    split = footprint(index, ["CPU", "CPU", "GPU0", "GPU1", "GPU0"])
    assert split.weights == {"GPU0": layer(2) + size["output.weight"] + size["output_norm.weight"],
                             "GPU1": layer(3)}
    assert split.kv_per_cell == {"GPU0": cell, "GPU1": cell}
    assert split.need(copies=3, cells=100) == {"GPU0": 3 * split.weights["GPU0"] + 100 * cell,
                                               "GPU1": 3 * split.weights["GPU1"] + 100 * cell}
    assert not footprint(index, [CPU] * 5).offloaded  # the CPU's weights are the file's shared memory map

    tied = GGUFIndex(tiny_model_path(tiny_dir, "llama", n_layer=4, tied_embeddings=True))
    only_output = footprint(tied, [CPU] * 4 + ["GPU0"]).weights["GPU0"]
    assert only_output == tied.tensor("token_embd.weight").n_bytes + tied.tensor("output_norm.weight").n_bytes


def test_a_need_that_does_not_fit_is_one_line_naming_device_and_figures():
    with pytest.raises(SpecEEError) as raised:
        check_fits("the pass", {"CUDA0": 7 * GIB, "CUDA1": GIB}, {"CUDA0": 7 * GIB, "CUDA1": 4 * GIB},
                   "3 copies", "lower -ngl")
    message = str(raised.value)
    assert "\n" not in message and "7.00 GiB on CUDA0, 7.00 GiB free" in message and "CUDA1" not in message
    assert message.startswith("the pass does not fit") and message.endswith("lower -ngl")
    check_fits("the pass", {"CUDA0": GIB}, {"CUDA0": int(GIB * (1 + MARGIN)) + 1}, "", "")  # fits, with the margin
    check_fits("the pass", {"CUDA0": 0}, {}, "", "")  # nothing on a device: nothing to check


def test_fitting_counts_what_fits_every_device():
    assert fitting({"A": 10 * GIB, "B": 3 * GIB}, {"A": GIB, "B": GIB}) == int(3 / (1 + MARGIN))
    assert fitting({"A": GIB}, {"A": 2 * GIB}) == 0
    assert fitting({}, {}) is None and fitting({"A": GIB}, {"A": 0}) is None


def test_engines_share_one_loaded_model(default_model):
    """Two engines on one Model answer as an engine with a model of its own does; closing one leaves the model, and
    the other engine, working; the model stays open until its owner closes it."""
    config = EngineConfig(n_ctx=512, n_threads=THREADS)
    own = Engine(default_model.info.path, pack=SHIPPED_PACK, config=config)
    expected = own.generate(own.prompt_tokens("Name a colour."), max_tokens=12, sampling=GREEDY).tokens
    own.close()
    first, second = (Engine(default_model, pack=SHIPPED_PACK, config=config) for _ in range(2))
    assert first.model is second.model is default_model
    first.close()
    assert second.generate(second.prompt_tokens("Name a colour."), max_tokens=12, sampling=GREEDY).tokens == expected
    second.close()
    assert default_model.layer_devices()  # still open: llama.cpp reads it


def faked(model: Model, devices: list[str], monkeypatch: pytest.MonkeyPatch, free: dict[str, int]) -> None:
    """`model` read as if llama.cpp had put its layers on `devices`, which have `free` bytes free."""
    monkeypatch.setattr(model, "layer_devices", lambda: devices)
    monkeypatch.setattr(device_memory, "free_bytes", lambda: dict(free))


def test_the_bench_checks_every_pass_against_free_memory_before_loading(default_model, monkeypatch):
    """The default model's layers 10-29 and output faked onto a 'GPU0': a pass that needs more than it has free is
    refused before anything more is loaded, naming the pass and the device; with room for it, the footprint comes
    back (and with it llama-server's lanes run in a pass of their own)."""
    n_layer = default_model.info.n_layer
    devices = [CPU] * 10 + ["GPU0"] * (n_layer - 10) + ["GPU0"]
    placed = footprint(GGUFIndex(default_model.info.path), devices)
    config = BenchConfig(model=default_model.info.path, peer=True, sampled=True, repeat=True)
    engines = 2
    python_need = placed.need(copies=2, cells=(2 + 2 + 2 * engines) * bench_run.ENGINE_CTX)["GPU0"]

    faked(default_model, devices, monkeypatch, {"GPU0": int(python_need * (1 + MARGIN)) - 1})
    with pytest.raises(SpecEEError, match=r"^the bench's pass of the llama-cpp-python and specee-edge lanes does not "
                                          r"fit: it needs [\d.]+ GiB on GPU0.*2 more copies.*8 contexts"):
        check_device_memory(config, default_model, engines, [])
    faked(default_model, devices, monkeypatch, {"GPU0": int(python_need * (1 + MARGIN)) + 1})
    assert check_device_memory(config, default_model, engines, []) == placed and placed.offloaded

    servers = BenchConfig(model=default_model.info.path, llama_server=Path("llama-server"), spec_types=["ngram-mod"])
    server_need = placed.need(copies=3, cells=(3 + 2 * engines) * bench_run.ENGINE_CTX)["GPU0"]
    faked(default_model, devices, monkeypatch, {"GPU0": int(server_need * (1 + MARGIN)) - 1})
    with pytest.raises(SpecEEError, match=r"^the bench's llama-server pass does not fit.*3 llama-servers'"):
        check_device_memory(servers, default_model, engines, server_names(servers))

    monkeypatch.undo()
    assert not check_device_memory(config, default_model, engines, []).offloaded  # all on the CPU: nothing to check


def test_cost_lanes_in_groups_time_every_lane_over_the_same_tokens(default_model):
    """Lanes timed three at a time (their contexts opened and closed by group) give every lane as many samples as
    all at once, each lane's samples from its own group's turns, and fit the same parts' shapes; the model passed
    in stays open."""
    engine = Engine(default_model, pack=SHIPPED_PACK, config=EngineConfig(n_ctx=256, n_threads=THREADS))
    setup, k = draft_setup(engine), engine.policy.k
    prompt = engine.prompt_tokens("Count to five.")
    answer = engine.generate(prompt, max_tokens=10, sampling=GREEDY).tokens
    engine.close()
    make = lambda model: cost_lanes(model, setup, n_ctx=64, n_threads=THREADS, k=k)  # noqa: E731
    fed = [([*prompt, *answer[:-1]], len(prompt))]
    opened = []

    def lanes_kept(model: Model):
        opened.extend(made := make(model))
        return made

    grouped = time_rounds(default_model, lanes_kept, fed, rounds=1, seed=0, group=3)
    (lanes,) = grouped
    assert len(lanes) > 3 and all(len(lane.samples) == len(answer) - 1 for lane in lanes)
    assert all(lane.ctx is not None and lane.ctx._ctx is None for lane in opened)  # every group's contexts closed
    costs = TokenCosts.fit(grouped)
    assert costs.plain_ms > 0 and np.isfinite(costs.layer_ms)
    assert default_model.layer_devices()


LOG = """load_tensors: offloading output layer to GPU
load_tensors: offloading 19 repeating layers to GPU
load_tensors: offloaded 20/31 layers to GPU
load_tensors:   CPU_Mapped model buffer size =    93.81 MiB
load_tensors: RPC0[127.0.0.1:50052] model buffer size =    61.20 MiB
"""


def test_a_server_that_did_not_split_as_the_bench_does_is_named():
    """llama.cpp's own log lines (llama-model.cpp's load_tensors, patches/0013's): the server's lane is kept only
    where it offloaded the layers asked, put weights on each device the bench's model uses, and, for
    --offload-first, took the first layers there (a stock llama-server ignores the key)."""
    setup = lambda placement, devices=("RPC0[127.0.0.1:50052]",): ServerSetup(  # noqa: E731
        Path("llama-server"), Path("m.gguf"), threads=2, n_ctx=512, placement=placement, devices=devices)
    assert placement_not_taken(LOG, setup(Placement(n_gpu_layers=20))) is None
    assert placement_not_taken(LOG, setup(Placement(n_gpu_layers=25))) == "it offloaded 20 of 31 layers, not 25"
    assert placement_not_taken("", setup(Placement(n_gpu_layers=20))) == "its log does not say that it offloaded any layer"
    assert placement_not_taken(LOG, setup(Placement(n_gpu_layers=20), ("CUDA0",))) == "it put no weights on CUDA0"
    first = Placement(n_gpu_layers=20, offload_first=True)
    assert "--offload-first" in placement_not_taken(LOG, setup(first))
    assert placement_not_taken(f"llama_model_load: {OFFLOAD_FIRST_LOGGED}\n{LOG}", setup(first)) is None
    assert placement_not_taken("", setup(Placement(), ())) is None  # nothing offloaded: nothing to check
    argv = setup(first).args(8080, [])  # a split server logs where it put the layers: verbosity 4
    assert argv[argv.index("-lv") + 1] == "4" and "-lv" not in setup(Placement(), ()).args(8080, [])
