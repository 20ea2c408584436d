"""Where a model's layers run (specee_edge/runtime/placement.py): llama.cpp's -ngl map and SpecEE's first-layers map,
the flags that pin the same split in llama-server and llama-cpp-python, and the patched loader on this build.

The first-layers map on real devices is tested over RPC workers on loopback (tests/test_rpc.py) and on a GPU
backend (tests/test_offload.py, `make test-vulkan`): there llama.cpp's own layer-to-device map is read back
through llama_specee_layer_device and must be the one Placement.offloaded predicts.
"""

from __future__ import annotations

import pytest

from specee_edge.errors import SpecEEError
from specee_edge.runtime import Context, Model
from specee_edge.runtime.placement import (ALL_LAYERS, OFFLOAD_FIRST_KEY, Placement, describe_devices, first_crossing,
                                           parse_gpu_layers, parse_tensor_overrides, parse_tensor_split)
from tests.conftest import supported_model_path
from tests.test_runtime import TINY_PROMPT, greedy

N_LAYER = 32  # Llama-2-7B's, the paper's model


def test_ngl_counts_the_output_layer_and_offloads_the_last_layers_as_llama_cpp_does():
    offloaded = Placement(17).offloaded(N_LAYER)
    assert len(offloaded) == N_LAYER + 1 and offloaded[-1]  # the output layer is one of the 17
    assert [il for il, on in enumerate(offloaded[:-1]) if on] == list(range(16, 32))


def test_offload_first_takes_the_first_layers_and_the_same_count():
    offloaded = Placement(17, offload_first=True).offloaded(N_LAYER)
    assert offloaded[-1]
    assert [il for il, on in enumerate(offloaded[:-1]) if on] == list(range(16))
    assert sum(offloaded) == sum(Placement(17).offloaded(N_LAYER))  # same -ngl, same device memory


@pytest.mark.parametrize("first", [False, True])
def test_no_layers_one_layer_and_all_layers_mean_the_same_either_way(first):
    assert not any(Placement(0, offload_first=first).offloaded(N_LAYER))
    assert Placement(1, offload_first=first).offloaded(N_LAYER) == [False] * N_LAYER + [True]  # the output only
    assert all(Placement(ALL_LAYERS, offload_first=first).offloaded(N_LAYER))
    assert all(Placement(N_LAYER + 1, offload_first=first).offloaded(N_LAYER))


def test_llama_server_gets_the_same_split_pinned():
    assert Placement(0).llama_server_args() == ["-ngl", "0", "--fit", "off"]
    args = Placement(17, (3.0, 1.0), offload_first=True).llama_server_args()
    assert args == ["-ngl", "17", "--fit", "off", "-ts", "3,1", "--override-kv", f"{OFFLOAD_FIRST_KEY}=bool:true"]


def test_the_command_lines_values_parse_with_one_line_errors():
    assert parse_gpu_layers("all") == parse_gpu_layers("-1") == ALL_LAYERS
    assert parse_gpu_layers("16") == 16
    assert parse_tensor_split("3,1") == (3.0, 1.0) and parse_tensor_split(None) == ()
    for bad in ("half", "-2"):
        with pytest.raises(SpecEEError, match="-ngl/--n-gpu-layers"):
            parse_gpu_layers(bad)
    with pytest.raises(SpecEEError, match="-ts/--tensor-split"):
        parse_tensor_split("3;1")


def test_a_placement_reads_as_runs_of_layers():
    devices = ["CUDA0"] * 15 + ["CPU"] * 17 + ["CUDA0"]
    assert describe_devices(devices) == "layers 0-14 on CUDA0, layers 15-31 on CPU; the output on CUDA0"
    assert describe_devices(["CPU"] * 4 + ["CPU"]) == "layers 0-3 on CPU; the output on CPU"


def test_without_devices_offload_first_loads_on_the_cpu_and_decodes_the_same_tokens(tiny_dir):
    """The patched loader takes the key (as an override) on a CPU build, where nothing can be offloaded: every layer
    stays on the CPU and the tokens are those of a plain load."""
    path = supported_model_path(tiny_dir, "llama")
    tokens = {}
    for first in (False, True):
        model = Model(path, placement=Placement(ALL_LAYERS, offload_first=first))
        if set(model.layer_devices()) != {"CPU"}:
            model.close()
            pytest.skip("this build has a device to offload to (tests/test_offload.py covers it)")
        ctx = Context(model, n_ctx=64, n_threads=1)
        tokens[first] = greedy(ctx, model.tokenize(TINY_PROMPT), 8)
        ctx.close()
        model.close()
    assert tokens[True] == tokens[False]


def test_tensor_overrides_parse_as_llama_cpps_and_reach_llama_server():
    assert parse_tensor_overrides(["ffn_.*=CPU,attn_q=CPU", "output=CPU"]) == (
        ("ffn_.*", "CPU"), ("attn_q", "CPU"), ("output", "CPU"))
    assert parse_tensor_overrides(None) == ()
    for bad in ("ffn_.*", "=CPU", "ffn="):
        with pytest.raises(SpecEEError, match="-ot/--override-tensor"):
            parse_tensor_overrides([bad])
    args = Placement(99, tensor_overrides=(("ffn_.*", "CPU"),)).llama_server_args()
    assert args[-2:] == ["-ot", "ffn_.*=CPU"]


def test_a_users_tensor_override_is_taken_as_given(tiny_dir):
    """-ot moves the weights it matches and nothing else: the model loads and decodes the same tokens; an unknown
    buffer type is one line naming the ones there are."""
    path = supported_model_path(tiny_dir, "llama")
    tokens = []
    for overrides in ((), (("blk\\.1\\..*", "CPU"),)):
        model = Model(path, placement=Placement(ALL_LAYERS, tensor_overrides=overrides))
        ctx = Context(model, n_ctx=64, n_threads=1)
        tokens.append(greedy(ctx, model.tokenize(TINY_PROMPT), 8))
        ctx.close()
        model.close()
    assert tokens[0] == tokens[1]
    with pytest.raises(SpecEEError, match="no buffer type CUDA7 here; there are .*CPU"):
        Model(path, placement=Placement(tensor_overrides=(("ffn_.*", "CUDA7"),)))


def test_the_first_crossing_is_the_first_layer_on_another_device():
    assert first_crossing(["CUDA0"] * 4 + ["CPU"] * 4 + ["CUDA0"]) == 4  # --offload-first: the output back on the GPU
    assert first_crossing(["CPU"] * 6 + ["CUDA0"] * 2 + ["CUDA0"]) == 6  # stock -ngl 3
    assert first_crossing(["CPU"] * 8 + ["CPU"]) is None
    assert first_crossing(["CPU"] * 8 + ["CUDA0"]) is None  # only the output offloaded: no layer crosses
