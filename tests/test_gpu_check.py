"""What tools/gpu_check.sh stands on, checked on the CPU: the pruned sdist's contents, build_runtime's offline
options, real-size models written from a tiled block, and the cost table's lanes and predictions on a tiny
model through the runtime."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from specee_edge import build_runtime
from specee_edge.pack import read_pack
from specee_edge.runtime import Context, Model
from specee_edge.runtime.placement import Placement
from tests.conftest import SHIPPED_PACK, load_tool
from tests.tiny_gguf import ARCHS, TinyConfig, write_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bundle(monkeypatch):
    return load_tool("gpu_bundle", monkeypatch)


def test_the_pruned_sdist_keeps_what_the_build_reads(bundle, tmp_path):
    source = tmp_path / "llama_cpp_python-0.3.36"
    llama = source / "vendor" / "llama.cpp"
    kept = ["CMakeLists.txt", "pyproject.toml", "README.md", "llama_cpp/llama.py", "vendor/llama.cpp/src/llama.cpp",
            "vendor/llama.cpp/cmake/license.cmake", "vendor/llama.cpp/ggml/src/ggml.c",
            "vendor/llama.cpp/ggml/src/ggml-cuda/mmq.cu", "vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp",
            "vendor/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp", "vendor/llama.cpp/vendor/nlohmann/json.hpp",
            "vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp",  # a patch edits it: kept, so that it applies
            # llama-server's (tools/build_llama_server.py --sdist)
            "vendor/llama.cpp/common/common.cpp", "vendor/llama.cpp/tools/server/server.cpp",
            "vendor/llama.cpp/tools/ui/CMakeLists.txt", "vendor/llama.cpp/vendor/cpp-httplib/httplib.h"]
    dropped = ["docs/index.md", "tests/test_llama.py", "vendor/llama.cpp/models/ggml-vocab-llama.gguf",
               "vendor/llama.cpp/ggml/src/ggml-vulkan/vulkan-shaders/add.comp",
               "vendor/llama.cpp/ggml/src/ggml-metal/ggml-metal.m", "vendor/llama.cpp/tools/ui/src/app.html",
               "vendor/llama.cpp/tools/server/tests/unit/test_basic.py"]
    for name in kept + dropped:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(name)
    bundle.prune(source)
    assert all((source / name).is_file() for name in kept)
    assert not any((source / name).exists() for name in dropped)
    assert llama.is_dir()


def test_models_cut_into_pieces_join_whole_and_checked(bundle, tmp_path):
    """Each piece travels in a device call of its own; joined on the GPU machine, every model is byte for byte the
    original, and a piece not there yet, or a wrong one, is one line, not a broken model."""
    models = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    models[0].write_bytes(bytes(range(256)) * 9000)  # 2.2 MiB: three pieces of 1 MiB
    models[1].write_bytes(b"gguf" * 100)
    written = bundle.cut_models(models, tmp_path / "pieces", piece_mib=1)
    folders = {path.parent.name for path in written if path.name != bundle.MANIFEST}
    assert folders == {f"piece-{i:02d}" for i in range(4)}
    joined = bundle.join_models(tmp_path / "pieces", tmp_path / "joined")
    assert [path.read_bytes() for path in joined] == [path.read_bytes() for path in models]
    (tmp_path / "pieces" / "piece-01" / "a.gguf.part01").write_bytes(b"not the part")
    with pytest.raises(SystemExit):
        bundle.join_models(tmp_path / "pieces", tmp_path / "joined")
    assert not (tmp_path / "joined" / "a.gguf").exists()
    bundle.cut_models(models, tmp_path / "pieces-2", piece_mib=1)
    shutil.rmtree(tmp_path / "pieces-2" / "piece-02")
    with pytest.raises(SystemExit):
        bundle.join_models(tmp_path / "pieces-2", tmp_path / "joined-2")
    assert not (tmp_path / "joined-2" / "a.gguf").exists()


def test_build_runtime_refuses_a_missing_sdist(tmp_path):
    result = subprocess.run([sys.executable, "tools/build_runtime.py", "--sdist", str(tmp_path / "none.tar.gz")],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert "no sdist at" in result.stderr and "Traceback" not in result.stderr


def test_build_runtime_installs_into_a_target_without_the_network(tmp_path):
    wheel = tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    command = build_runtime.install_command(wheel, tmp_path / "site")
    assert command[-1] == str(wheel) and "--no-index" in command and "--no-deps" in command
    assert command[command.index("--target") + 1] == str(tmp_path / "site")
    assert "--force-reinstall" in build_runtime.install_command(wheel, None)


def tensor_layout(path: Path) -> list[tuple[str, tuple[int, ...], int]]:
    return [(t.name, tuple(int(n) for n in t.shape), int(t.tensor_type)) for t in gguf.GGUFReader(path).tensors]


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gpt2"])
@pytest.mark.parametrize("weight_type", ["f16", "q4_1"])
def test_a_tiled_model_has_the_drawn_models_layout_and_runs(tmp_path, arch, weight_type):
    wide = {"n_head": 2, "n_embd_head": 64, "n_head_kv": 1} if arch in ("gemma3", "qwen3", "llama") else {}
    config = TinyConfig(arch=arch, weight_type=weight_type, **wide)
    drawn = write_tiny_model(tmp_path / "drawn.gguf", config)
    tiled = write_tiny_model(tmp_path / "tiled.gguf", config, tiled=True)
    assert tensor_layout(tiled) == tensor_layout(drawn)
    assert tiled.stat().st_size == drawn.stat().st_size
    model = Model(tiled)
    ctx = Context(model, n_ctx=64)
    ctx.decode(model.tokenize("hello world"))
    logits = ctx.logits()
    assert np.all(np.isfinite(logits)) and np.ptp(logits) > 0
    ctx.close()
    model.close()


def test_heads_wider_than_the_stream_are_refused_where_llama_cpp_cannot_run_them():
    with pytest.raises(ValueError, match="gpt2's heads"):
        write_tiny_model("/nonexistent.gguf", TinyConfig(arch="gpt2", n_embd_head=32))


def test_the_cost_table_times_every_lane_and_predicts_each_level(tmp_path, monkeypatch):
    tool = load_tool("gpu_costs", monkeypatch)
    shape = tool.Shape("tiny", TinyConfig("llama", n_vocab=512, weight_type="q4_1", n_embd=64, n_ff=128), SHIPPED_PACK.name)
    path = write_tiny_model(tmp_path / "tiny.gguf", shape.config, tiled=True)
    pack = read_pack(SHIPPED_PACK)
    measured = tool.measure(path, shape, pack, placement=Placement(), threads=1, rounds=1, tokens=3)
    assert list(measured.batch_ms) == list(tool.BATCH_ROWS)
    assert all(ms > 0 for ms in [*measured.batch_ms.values(), measured.resume_ms, measured.costs.plain_ms])
    rows = tool.predictions(measured, pack)
    predicted = [lv for lv in pack.levels if (lv.exact and lv.acceptance > 0) or not (lv.exact or lv.off)]
    assert [row["level"] for row in rows] == ["exact" if lv.exact else f"{lv.quality:g}" for lv in predicted]
    # with nothing exiting, a level's token is a full token paying the draft and its checks: never faster
    idle = dataclasses.replace(next(lv for lv in pack.levels if not lv.exact), exit_rate=0.0, head_free_rate=0.0,
                               layer_speedup=1.0)
    costs = dataclasses.replace(measured.costs, fixed_ms=1.0, layer_ms=0.1, curve_ms=0.0, draft_ms=0.2,
                                check_ms=0.05, plain_ms=1.0 + 4 * 0.1 + 0.3, head_ms=0.3)
    token = tool.lossy_token_ms(costs, idle, pack.target.n_layer)
    assert token == pytest.approx(costs.plain_ms + 0.2 + 0.05 * len(idle.on_layers))
