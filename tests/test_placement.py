"""Where a model's layers run (specee_edge/runtime/placement.py): the flags that pin the same split in llama-server
and llama-cpp-python, the command line's values, and the patched loader on this build.

Which device each layer gets is llama.cpp's map, read back through llama_specee_layer_device (Model.layer_devices()),
never restated here: it is checked where there are devices, over RPC workers on loopback (tests/test_rpc.py) and on a
GPU backend (tests/test_gpu.py and tests/test_offload.py: each side of a split is where the test names it).
"""

from __future__ import annotations

import dataclasses

import pytest

from specee_edge.engine import Engine, EngineConfig
from specee_edge.errors import SpecEEError
from specee_edge.pack import read_pack, write_pack
from specee_edge.runtime import Context, Model
from specee_edge.runtime.placement import (ALL_LAYERS, OFFLOAD_FIRST_KEY, Placement, describe_devices, first_crossing,
                                           parse_gpu_layers, parse_tensor_overrides, parse_tensor_split)
from tests.conftest import SHIPPED_PACK, supported_model_path
from tests.test_runtime import TINY_PROMPT, greedy


def test_llama_server_gets_the_same_split_pinned():
    assert Placement(0).llama_server_args() == ["-ngl", "0", "--fit", "off"]
    args = Placement(17, (3.0, 1.0), offload_first=True).llama_server_args()
    assert args == ["-ngl", "17", "--fit", "off", "-ts", "3,1", "--override-kv", f"{OFFLOAD_FIRST_KEY}=bool:true"]


def test_the_command_lines_values_parse_with_one_line_errors():
    assert parse_gpu_layers("all") == parse_gpu_layers("auto") == parse_gpu_layers("-1") == ALL_LAYERS  # no fitting
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


def test_a_pack_priced_with_its_layers_elsewhere_says_so_in_one_line(default_model, tmp_path):
    """Calibration records where the layers ran when it timed the costs (TokenCosts.placement): a pack run with them
    placed otherwise gets one line, the same placement or a pack that recorded none gets nothing."""
    from specee_edge.cli.render import level_warning

    pack = read_pack(SHIPPED_PACK)
    here = default_model.placement_text()
    notes = {}
    for name, placement in (("same", here), ("split", "layers 0-14 on CUDA0, layers 15-29 on CPU; the output on CUDA0"),
                            ("none", None)):
        costs = {**pack.provenance.get("costs_ms", {}), "placement": placement}
        path = write_pack(tmp_path / f"{name}.specee.gguf",
                          dataclasses.replace(pack, provenance={**pack.provenance, "costs_ms": costs}))
        engine = Engine(default_model.info.path, pack=path, config=EngineConfig(n_ctx=256, n_threads=1))
        notes[name] = (engine.placement_note(), level_warning(engine))
        engine.close()
    assert notes["same"][0] is notes["none"][0] is None and notes["same"][1] == notes["none"][1]
    note, warning = notes["split"]
    assert note.startswith("the pack was priced with layers 0-14 on CUDA0") and f"not {here}" in note
    assert "\n" not in note and note in warning

