"""The patched runtime on a GPU build, against the same library on the CPU (pytest -m gpu; tools/gpu_check.sh).

Tiny random-weight models of every architecture early exit supports, each loaded twice by the same library:
on the CPU, and offloaded to the GPU fully or in part (the last 2 of their 4 layers: the graph then has
splits on both backends, a stop must skip the ones after it, and a resume pick up in the right one).
Stops, resumes, native exits on either side of the split, exact mode's verification batches and every KV
mode must give the CPU's logits (to the rounding of another backend's kernels), and greedy decoding the
CPU's tokens except at near-ties (the bench's divergence rule).

The tests skip on a build with no GPU backend; SPECEE_GPU_TESTS_ON_CPU=1 runs them there anyway (both
loads then run on the CPU), which is how tools/gpu_check.sh is rehearsed on a machine with no GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from llama_cpp import llama_cpp as _llama

from specee_edge.bench.quality import NEAR_TIE
from specee_edge.exits import ExitKind
from specee_edge.runtime import Context, Model
from specee_edge.runtime.placement import Placement
from tests.conftest import SUPPORTED_VARIANTS, supported_model_path
from tests.test_exits import PROMPT, always, drafted_context
from tests.test_runtime import TINY_PROMPT, early_exit_context, forced_exit_run, greedy, stop_at, top_k

pytestmark = pytest.mark.gpu

N_LAYER = 4  # the tiny models'
OFFLOADS = {"partial": 2, "full": 99}  # the last 2 layers on the GPU (the CPU keeps the head), or everything
CPU_SIDE, GPU_SIDE = 1, 2  # with partial offload, a layer on each side of the split
STEPS = 16


def offload_available() -> bool:
    return bool(_llama.llama_supports_gpu_offload()) or os.environ.get("SPECEE_GPU_TESTS_ON_CPU") == "1"


@pytest.fixture(scope="module", params=list(OFFLOADS))
def offload(request) -> int:
    if not offload_available():
        pytest.skip("this llama-cpp-python build has no GPU backend (SPECEE_GPU_TESTS_ON_CPU=1 runs these anyway)")
    return OFFLOADS[request.param]


@pytest.fixture(scope="module", params=list(SUPPORTED_VARIANTS))
def models(request, tiny_dir, offload) -> tuple[Model, Model]:
    """The same tiny model on the CPU and offloaded."""
    path = supported_model_path(tiny_dir, request.param)
    cpu, gpu = Model(path), Model(path, placement=Placement(offload))
    assert cpu.info.n_layer == N_LAYER
    return cpu, gpu


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


def test_greedy_is_the_cpus_but_at_near_ties(models):
    cpu, gpu = models
    prompt = cpu.tokenize(TINY_PROMPT)
    reference = greedy(Context(cpu, n_ctx=128), prompt, STEPS)
    # both fed the CPU's tokens: each step compared on the same text
    on_cpu = logits_after(Context(cpu, n_ctx=128), prompt, reference[:-1])
    on_gpu = logits_after(Context(gpu, n_ctx=128), prompt, reference[:-1])
    assert_close(on_gpu, on_cpu)
    for step, (c, g) in enumerate(zip(on_cpu, on_gpu)):
        if int(np.argmax(g)) != int(np.argmax(c)):
            top2 = np.sort(c)[-2:]
            assert top2[1] - top2[0] < NEAR_TIE, f"step {step}: the GPU's token differs where the CPU's was clear"


@pytest.mark.parametrize("layer", [CPU_SIDE, GPU_SIDE])
def test_stop_and_resume_give_the_cpus_logits(models, layer):
    cpu, gpu = models
    prompt = cpu.tokenize(TINY_PROMPT)
    results = []
    for model in (cpu, gpu):
        ctx = early_exit_context(model, "mask")
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
    plain = Context(cpu, n_ctx=128)
    plain.decode(prompt + [cpu_first])
    assert_close(gpu_resumed, plain.logits())  # a resumed token is a token that never stopped


@pytest.mark.parametrize("kind", [ExitKind.HEAD_FREE, ExitKind.VERIFIED])
@pytest.mark.parametrize("layer", [CPU_SIDE, GPU_SIDE])
def test_native_exits_fire_on_either_side_of_the_split(models, layer, kind):
    steps = []
    for model in models:
        ctx = drafted_context(model)  # the same random draft head on both
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


def test_a_verification_batch_gives_the_cpus_rows_and_next_draft(models):
    n_rows = len(PROMPT) - 4
    runs = []
    for model in models:
        ctx = drafted_context(model)
        always(model, ctx, [GPU_SIDE], ExitKind.HEAD_FREE)
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
def test_kv_modes_give_the_cpus_logits(models, mode):
    cpu, gpu = models
    prompt = cpu.tokenize(TINY_PROMPT)
    continuation = greedy(Context(cpu, n_ctx=128), prompt, STEPS)
    on_cpu, on_gpu = (forced_exit_run(early_exit_context(model, mode), prompt, continuation, exit_layer=GPU_SIDE)
                      for model in (cpu, gpu))
    assert_close(on_gpu, on_cpu)
