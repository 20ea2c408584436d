"""The default model offloaded to a GPU backend and driven by the engine, against the same library on the CPU
(pytest -m gpu: `make test-vulkan` runs it on Mesa's lavapipe).

tests/test_gpu.py checks the runtime's parts on tiny random models; here the engine answers with the real
model and its pack, offloaded fully and in part: llama.cpp's way (its last DEVICE_LAYERS layers) and SpecEE's
(--offload-first: its first FIRST_DEVICE_LAYERS, the CPU keeping the last six), so that the pack's exits, which
fire from layer 20 on, leave on both sides of the split. Exact mode's rounds, lookup and exit drafts checked in
batches on the device, must give the CPU's greedy tokens except at near-ties (the bench's divergence rule), and
a lossy level's exits must fire on layers on either side of the split: each side read from llama.cpp's own
layer map and checked to be where the test names it.
"""

from __future__ import annotations

import pytest

from specee_edge.bench.quality import NEAR_TIE, divergence_margins
from specee_edge.default_model import default_model_path
from specee_edge.engine import GREEDY, Engine, EngineConfig
from specee_edge.runtime import Context
from specee_edge.runtime.placement import Placement, describe_devices, first_crossing
from tests.test_controller_runtime import EDIT
from tests.test_exact import assert_cache_holds_the_reply, prompt_of
from tests.test_gpu import CPU, DEVICE, device_present, offload_available, side_runs

pytestmark = pytest.mark.gpu

DEVICE_LAYERS = 6  # partial offload: layers 25..29 of SmolLM2's 30 and the head on the device, 0..24 on the CPU
FIRST_DEVICE_LAYERS = 25  # --offload-first: layers 0..23 and the head on the device, 24..29 on the CPU
OFFLOADS = {"partial": Placement(DEVICE_LAYERS), "first": Placement(FIRST_DEVICE_LAYERS, offload_first=True),
            "full": Placement(99)}
# what each offload must be, by llama.cpp's own map: the sides in the order the layers run through them, and the
# first layer on the second side (the output layer is on the device in every one)
SPLITS = {"partial": ((CPU, DEVICE), 25), "first": ((DEVICE, CPU), 24), "full": ((DEVICE,), None)}
QUESTIONS = [EDIT, "Write a short story about a robot who learns to paint.", "Explain how a bicycle works."]
N_TOKENS = 48


def engine(placement: Placement | None, **config) -> Engine:
    return Engine(default_model_path(), config=EngineConfig(n_ctx=1024, n_threads=2, placement=placement,
                                                            **config))


def answers(engine: Engine) -> tuple[list[list[int]], list[list[int]], list[int | None]]:
    """Greedy answers to QUESTIONS: the prompts, the replies and every token's exit layer."""
    prompts, replies, exit_layers = [], [], []
    for question in QUESTIONS:
        prompt = prompt_of(engine, question)
        records = list(engine.stream(prompt, max_tokens=N_TOKENS, sampling=GREEDY))
        assert_cache_holds_the_reply(engine, prompt, [r.id for r in records])
        engine.reset()
        prompts.append(prompt)
        replies.append([r.id for r in records])
        exit_layers += [r.exit_layer for r in records]
    return prompts, replies, exit_layers


@pytest.fixture(scope="module", params=list(OFFLOADS))
def offload(request) -> str:
    if not offload_available():
        pytest.skip("this llama-cpp-python build has no GPU backend (make test-vulkan builds one)")
    return request.param


@pytest.fixture(scope="module")
def placement(offload) -> Placement:
    return OFFLOADS[offload]


def test_exact_rounds_on_the_device_give_the_cpus_tokens_but_at_near_ties(placement):
    """Speculation "always": every chance to draft is a batch on the device, lookup and exit drafts both."""
    offloaded, on_cpu = engine(placement, speculation="always"), engine(Placement(), speculation="always")
    try:
        prompts, replies, _ = answers(offloaded)
        stats = offloaded.stats
        _, expected, _ = answers(on_cpu)
        assert offloaded.exact and stats.rounds > 0
        reference = Context(on_cpu.model, n_ctx=1024, n_threads=2)
        margins = divergence_margins(reference, prompts, expected, replies)
        reference.close()
        assert all(margin < NEAR_TIE for margin in margins), margins
    finally:
        offloaded.close()
        on_cpu.close()


def test_a_lossy_levels_exits_fire_on_both_sides_of_the_split(offload, placement):
    """Each side is where the test names it by llama.cpp's own map (Model.layer_devices()), and exits leave from
    layers on each side the map has."""
    if not device_present():
        pytest.skip("every layer is on the CPU here (SPECEE_GPU_TESTS_ON_CPU): there are no sides to check")
    offloaded = engine(placement, quality=0.9)
    try:
        assert not offloaded.exact
        devices = offloaded.model.layer_devices()
        _, _, exit_layers = answers(offloaded)
    finally:
        offloaded.close()
    sides, split = SPLITS[offload]
    assert (side_runs(devices), first_crossing(devices), devices[-1] != "CPU") == (sides, split, True), \
        describe_devices(devices)
    exits = [layer for layer in exit_layers if layer is not None]
    for side in sides:
        assert any((devices[layer] == "CPU") == (side == CPU) for layer in exits), (side, exits)
