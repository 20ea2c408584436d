"""The patched runtime on a GPU build, against the same library on the CPU (pytest -m gpu; tools/gpu_check.sh).

Tiny random-weight models of every architecture early exit supports, each loaded twice by the same library:
on the CPU, and offloaded to the GPU fully or in part. -ngl counts the output layer, so the partial offloads'
-ngl 3 puts two of the four layers and the output on the GPU: llama.cpp's way the last two (CPU, then GPU), SpecEE's
(--offload-first) the first two (GPU, then CPU, then the output back on the GPU). The graph then has splits on both
backends, a stop must skip the ones after it, and a resume pick up in the right one. Each side's layers are read
from llama.cpp's own map (Model.layer_devices()) and checked to be the sides the test names; the exits are placed
on a layer of each. Stops, resumes, native exits on either side of the split, exact mode's verification batches
and every KV mode must give the CPU's logits (to the rounding of another backend's kernels), and greedy decoding
the CPU's tokens except at near-ties (the bench's divergence rule).

The tiny models' heads are 16 wide, which CUDA's flash-attention kernels do not take: llama.cpp's `auto` then runs
attention without them. So each architecture comes again with heads of 64 and flash attention on, where the depth
mask of a stopped token goes through the device's flash-attention kernel.

The tests skip on a build with no GPU device (every build has RPC, which llama_supports_gpu_offload counts);
SPECEE_GPU_TESTS_ON_CPU=1 runs them there anyway (both loads then run on the CPU, the map has one side, and each
side's exit layer is a stand-in), which is how tools/gpu_check.sh is rehearsed on a machine with no GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from specee_edge.bench.quality import NEAR_TIE
from specee_edge.exits import ExitKind
from specee_edge.runtime import Context, Model, rpc
from specee_edge.runtime.placement import Placement, describe_devices
from tests.conftest import SUPPORTED_VARIANTS, tiny_model_path
from tests.test_exits import PROMPT, always, drafted_context
from tests.test_runtime import TINY_PROMPT, early_exit_context, forced_exit_run, greedy, stop_at, top_k

pytestmark = pytest.mark.gpu

N_LAYER = 4  # the tiny models'
CPU, DEVICE = "CPU", "device"  # the sides of a split
# by name: the placement, and the sides llama.cpp's map must give its repeating layers, in the order a token runs
# through them (the output layer is on the GPU in each)
OFFLOADS = {"partial": (Placement(3), (CPU, DEVICE)),
            "first": (Placement(3, offload_first=True), (DEVICE, CPU)),
            "full": (Placement(99), (DEVICE,))}
STAND_INS = {CPU: 1, DEVICE: 2}  # each side's exit layer where every layer is on the CPU (the rehearsal)
WIDE_HEADS = {"n_embd": 128, "n_head": 2, "n_head_kv": 1}  # heads of 64: CUDA's flash attention takes them
# by name: the tiny model's shape and the flash attention its contexts ask for
VARIANTS = {**{name: (shape, "auto") for name, shape in SUPPORTED_VARIANTS.items()},
            **{f"{name}-fa64": ({**shape, **WIDE_HEADS}, "on") for name, shape in SUPPORTED_VARIANTS.items()}}
STEPS = 16
GGML_BACKEND_DEVICE_TYPES_GPU = (1, 2)  # ggml_backend_dev_type's GPU and IGPU


def device_present() -> bool:
    """Whether ggml has a GPU device (dedicated or integrated) to offload to."""
    return any(rpc.libggml.ggml_backend_dev_by_type(kind) for kind in GGML_BACKEND_DEVICE_TYPES_GPU)


def offload_available() -> bool:
    return device_present() or os.environ.get("SPECEE_GPU_TESTS_ON_CPU") == "1"


def side_runs(devices: list[str]) -> tuple[str, ...]:
    """The sides of the repeating layers in llama.cpp's map (Model.layer_devices(): each layer's device, then the
    output's), in the order a token runs through them: ("CPU", "device") for llama.cpp's partial offload."""
    runs: list[str] = []
    for device in devices[:-1]:
        side = CPU if device == "CPU" else DEVICE
        if not runs or runs[-1] != side:
            runs.append(side)
    return tuple(runs)


def exit_layers(devices: list[str]) -> dict[str, int]:
    """Per side of llama.cpp's map, the layer its tests exit at: the side's last layer before the model's last."""
    layers = {}
    for il, device in enumerate(devices[: N_LAYER - 1]):
        layers[CPU if device == "CPU" else DEVICE] = il
    return layers


@pytest.fixture(scope="module", params=list(OFFLOADS))
def offload(request) -> str:
    if not offload_available():
        pytest.skip("this llama-cpp-python build has no GPU device (SPECEE_GPU_TESTS_ON_CPU=1 runs these anyway)")
    return request.param


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def flash_attn(variant) -> str:
    return VARIANTS[variant][1]


@pytest.fixture(scope="module")
def models(tiny_dir, variant, offload) -> tuple[Model, Model]:
    """The same tiny model on the CPU and offloaded."""
    shape, _ = VARIANTS[variant]
    path = tiny_model_path(tiny_dir, variant.split("-")[0], **shape)
    cpu, gpu = Model(path), Model(path, placement=OFFLOADS[offload][0])
    assert cpu.info.n_layer == N_LAYER
    return cpu, gpu


@pytest.fixture(scope="module")
def sides(models, offload) -> dict[str, int]:
    """The exit layer on each side of the offloaded model's split, read from llama.cpp's own map, which must have
    the sides the test names (where every layer is on the CPU, the rehearsal, each side's stand-in)."""
    devices = models[1].layer_devices()
    expected = OFFLOADS[offload][1]
    if not device_present():
        assert set(devices) == {"CPU"}, describe_devices(devices)
        return {side: STAND_INS[side] for side in expected}
    layers = exit_layers(devices)
    assert (side_runs(devices), devices[-1] != "CPU", set(layers)) == (expected, True, set(expected)), \
        describe_devices(devices)
    return layers


def on_side(sides: dict[str, int], side: str) -> int:
    """The exit layer on `side` (a test of a side the offload does not have is skipped)."""
    if side not in sides:
        pytest.skip(f"no layer on the {side} side")
    return sides[side]


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal up to another backend's rounding: 2% of the largest logit."""
    np.testing.assert_allclose(actual, expected, atol=0.02 * np.abs(expected).max())


def logits_after(ctx: Context, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The logits after the prompt, then after each of `tokens` fed one at a time."""
    ctx.decode(prompt)
    steps = [ctx.logits().copy()]
    for token in tokens:
        ctx.decode([token])
        steps.append(ctx.logits().copy())
    return np.array(steps)


def test_greedy_is_the_cpus_but_at_near_ties(models, flash_attn):
    cpu, gpu = models
    prompt = cpu.tokenize(TINY_PROMPT)
    reference = greedy(Context(cpu, n_ctx=128, flash_attn=flash_attn), prompt, STEPS)
    # both fed the CPU's tokens: each step compared on the same text
    on_cpu = logits_after(Context(cpu, n_ctx=128, flash_attn=flash_attn), prompt, reference[:-1])
    on_gpu = logits_after(Context(gpu, n_ctx=128, flash_attn=flash_attn), prompt, reference[:-1])
    assert_close(on_gpu, on_cpu)
    for step, (c, g) in enumerate(zip(on_cpu, on_gpu)):
        if int(np.argmax(g)) != int(np.argmax(c)):
            top2 = np.sort(c)[-2:]
            assert top2[1] - top2[0] < NEAR_TIE, f"step {step}: the GPU's token differs where the CPU's was clear"


@pytest.mark.parametrize("side", [CPU, DEVICE])
def test_stop_and_resume_give_the_cpus_logits(models, sides, side, flash_attn):
    layer = on_side(sides, side)
    cpu, gpu = models
    prompt = cpu.tokenize(TINY_PROMPT)
    results = []
    for model in (cpu, gpu):
        ctx = early_exit_context(model, "mask", flash_attn=flash_attn)
        ctx.set_probe_layers([layer])
        ctx.set_probe_callback(stop_at(layer))
        ctx.decode(prompt)
        first = int(np.argmax(ctx.logits()))
        ctx.set_candidates(top_k(ctx.logits(), 4))
        assert ctx.decode([first]) == layer
        stopped = ctx.logits().copy()
        ctx.set_probe_callback(None)
        assert ctx.resume() is None
        assert ctx.cell_depth(ctx.n_past - 1) == N_LAYER - 1
        results.append((first, stopped, ctx.logits().copy()))
    (cpu_first, cpu_stop, cpu_resumed), (gpu_first, gpu_stop, gpu_resumed) = results
    assert gpu_first == cpu_first
    assert_close(gpu_stop, cpu_stop)
    assert_close(gpu_resumed, cpu_resumed)
    plain = Context(cpu, n_ctx=128, flash_attn=flash_attn)
    plain.decode(prompt + [cpu_first])
    assert_close(gpu_resumed, plain.logits())  # a resumed token is a token that never stopped


@pytest.mark.parametrize("kind", [ExitKind.HEAD_FREE, ExitKind.VERIFIED])
@pytest.mark.parametrize("side", [CPU, DEVICE])
def test_native_exits_fire_on_either_side_of_the_split(models, sides, side, kind, flash_attn):
    layer = on_side(sides, side)
    steps = []
    for model in models:
        ctx = drafted_context(model, flash_attn=flash_attn)  # the same random draft head on both
        always(model, ctx, [layer], kind)
        ctx.decode(PROMPT)
        ctx.decode([4])
        steps.append((ctx.step_info(), ctx.logits().copy()))
    (cpu_step, cpu_logits), (gpu_step, gpu_logits) = steps
    if kind == ExitKind.HEAD_FREE:
        assert cpu_step.exit_layer == layer  # always fires (a verified exit leaves only where the head agrees)
    assert (gpu_step.exit_layer, gpu_step.exit_kind, gpu_step.heads) == (cpu_step.exit_layer, cpu_step.exit_kind,
                                                                         cpu_step.heads)
    assert set(gpu_step.candidates) == set(cpu_step.candidates)
    scored = np.isfinite(cpu_logits)  # a head-free exit scores its candidates alone
    np.testing.assert_array_equal(np.isfinite(gpu_logits), scored)
    assert_close(gpu_logits[scored], cpu_logits[scored])


def test_a_verification_batch_gives_the_cpus_rows_and_next_draft(models, sides, flash_attn):
    n_rows = len(PROMPT) - 4
    runs = []
    for model in models:
        ctx = drafted_context(model, flash_attn=flash_attn)
        always(model, ctx, [sides[DEVICE]], ExitKind.HEAD_FREE)
        ctx.decode(PROMPT[:4])
        ctx.decode(PROMPT[4:], output_all=True)  # exact mode's verification batch
        rows = np.array([ctx.logits(i) for i in range(n_rows)])
        ctx.truncate(4 + 1)  # the round accepted its first row only: the next draft starts from it
        ctx.draft_from_row(0)
        ctx.decode([PROMPT[0]])
        runs.append((rows, set(ctx.step_info().candidates)))
    (cpu_rows, cpu_next), (gpu_rows, gpu_next) = runs
    assert_close(gpu_rows, cpu_rows)
    assert gpu_next == cpu_next


@pytest.mark.parametrize("mode", ["mask", "fill", "full"])
def test_kv_modes_give_the_cpus_logits(models, sides, mode, flash_attn):
    cpu, gpu = models
    prompt = cpu.tokenize(TINY_PROMPT)
    continuation = greedy(Context(cpu, n_ctx=128, flash_attn=flash_attn), prompt, STEPS)
    on_cpu, on_gpu = (forced_exit_run(early_exit_context(model, mode, flash_attn=flash_attn), prompt, continuation,
                                      exit_layer=sides[DEVICE])
                      for model in (cpu, gpu))
    assert_close(on_gpu, on_cpu)
