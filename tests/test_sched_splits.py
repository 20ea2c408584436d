"""Patch 0001 on a graph with two splits, on the CPU: a stop skips every later split; resume finishes.

Two CPU backends stand in for CPU + GPU: the graph x -> a1 -> a2 | a3 -> a4 runs a1, a2 on the first
and a3, a4 on the second, so the scheduler makes two splits, as with partial GPU offload. The second
backend gets a copy of the CPU buffer type: with the very same one, the scheduler would move its
nodes back to the first backend.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

LIB_DIR = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(llama_cpp.__file__).parent / "lib")

eval_callback_t = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _load() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    base = ctypes.CDLL(str(LIB_DIR / "libggml-base.so"))
    cpu = ctypes.CDLL(str(LIB_DIR / "libggml-cpu.so"))
    p = ctypes.c_void_p
    signatures = {
        (base, "ggml_init"): ([InitParams], p),
        (base, "ggml_free"): ([p], None),
        (base, "ggml_new_tensor_1d"): ([p, ctypes.c_int, ctypes.c_int64], p),
        (base, "ggml_add"): ([p, p, p], p),
        (base, "ggml_set_name"): ([p, ctypes.c_char_p], p),
        (base, "ggml_get_name"): ([p], ctypes.c_char_p),
        (base, "ggml_set_input"): ([p], None),
        (base, "ggml_set_output"): ([p], None),
        (base, "ggml_new_graph"): ([p], p),
        (base, "ggml_build_forward_expand"): ([p, p], None),
        (base, "ggml_backend_sched_new"): ([p, p, ctypes.c_int, ctypes.c_size_t, ctypes.c_bool, ctypes.c_bool], p),
        (base, "ggml_backend_sched_free"): ([p], None),
        (base, "ggml_backend_sched_set_tensor_backend"): ([p, p, p], None),
        (base, "ggml_backend_sched_alloc_graph"): ([p, p], ctypes.c_bool),
        (base, "ggml_backend_sched_get_n_splits"): ([p], ctypes.c_int),
        (base, "ggml_backend_sched_set_eval_callback"): ([p, eval_callback_t, p], None),
        (base, "ggml_backend_sched_graph_compute"): ([p, p], ctypes.c_int),
        (base, "ggml_backend_sched_is_stopped"): ([p], ctypes.c_bool),
        (base, "ggml_backend_sched_graph_compute_resume"): ([p], ctypes.c_int),
        (base, "ggml_backend_tensor_set"): ([p, p, ctypes.c_size_t, ctypes.c_size_t], None),
        (base, "ggml_backend_tensor_get"): ([p, p, ctypes.c_size_t, ctypes.c_size_t], None),
        (base, "ggml_backend_free"): ([p], None),
        (base, "ggml_backend_cpu_buffer_type"): ([], p),
        (cpu, "ggml_backend_cpu_init"): ([], p),
    }
    for (lib, name), (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return base, cpu


GGML_TYPE_F32 = 0
X = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
SENTINEL = np.full(4, -7.0, dtype=np.float32)


class TwoSplitGraph:
    def __init__(self):
        self.base, self.cpu = _load()
        b = self.base
        self.ctx = b.ggml_init(InitParams(1 << 20, None, True))
        self.x = b.ggml_new_tensor_1d(self.ctx, GGML_TYPE_F32, 4)
        b.ggml_set_name(self.x, b"x")
        b.ggml_set_input(self.x)
        self.nodes = {}
        cur = self.x
        for name in ("a1", "a2", "a3", "a4"):
            cur = b.ggml_add(self.ctx, cur, cur)
            b.ggml_set_name(cur, name.encode())
            self.nodes[name] = cur
        b.ggml_set_output(self.nodes["a4"])
        self.gf = b.ggml_new_graph(self.ctx)
        b.ggml_build_forward_expand(self.gf, self.nodes["a4"])

        self.backends = [self.cpu.ggml_backend_cpu_init(), self.cpu.ggml_backend_cpu_init()]
        array = (ctypes.c_void_p * 2)(*self.backends)
        # struct ggml_backend_buffer_type: 6 interface pointers, the device, the context
        self._buft_copy = ctypes.create_string_buffer(8 * ctypes.sizeof(ctypes.c_void_p))
        ctypes.memmove(self._buft_copy, b.ggml_backend_cpu_buffer_type(), len(self._buft_copy))
        bufts = (ctypes.c_void_p * 2)(b.ggml_backend_cpu_buffer_type(), ctypes.addressof(self._buft_copy))
        self.sched = b.ggml_backend_sched_new(array, bufts, 2, 64, False, False)
        for name, backend in (("a1", 0), ("a2", 0), ("a3", 1), ("a4", 1)):
            b.ggml_backend_sched_set_tensor_backend(self.sched, self.nodes[name], self.backends[backend])
        assert b.ggml_backend_sched_alloc_graph(self.sched, self.gf)
        self.observed: list[str] = []

    def stop_after(self, stop_name: str | None) -> None:
        def callback(t, ask, _user_data):
            name = self.base.ggml_get_name(t).decode()
            if ask:
                return name == stop_name
            self.observed.append(name)
            return False  # stop

        self._callback = eval_callback_t(callback)
        self.base.ggml_backend_sched_set_eval_callback(self.sched, self._callback, None)

    def set(self, tensor, values: np.ndarray) -> None:
        self.base.ggml_backend_tensor_set(tensor, values.ctypes.data, 0, values.nbytes)

    def get(self, name: str) -> np.ndarray:
        out = np.empty(4, dtype=np.float32)
        self.base.ggml_backend_tensor_get(self.nodes[name], out.ctypes.data, 0, out.nbytes)
        return out

    def close(self) -> None:
        b = self.base
        b.ggml_backend_sched_free(self.sched)
        for backend in self.backends:
            b.ggml_backend_free(backend)
        b.ggml_free(self.ctx)


@pytest.fixture
def graph():
    g = TwoSplitGraph()
    yield g
    g.close()


@pytest.mark.parametrize("stop_name", ["a1", "a2"])  # inside the first split, and at its last node
def test_stop_skips_later_splits_and_resume_finishes(graph, stop_name):
    b = graph.base
    assert b.ggml_backend_sched_get_n_splits(graph.sched) == 2
    graph.stop_after(stop_name)
    graph.set(graph.x, X)
    graph.set(graph.nodes["a4"], SENTINEL)

    assert b.ggml_backend_sched_graph_compute(graph.sched, graph.gf) == 0
    assert graph.observed == [stop_name]
    assert b.ggml_backend_sched_is_stopped(graph.sched)
    # stock ggml only left the first split's node loop: the second split then wrote a4 from garbage
    np.testing.assert_array_equal(graph.get("a4"), SENTINEL)

    graph.stop_after(None)
    assert b.ggml_backend_sched_graph_compute_resume(graph.sched) == 0
    assert not b.ggml_backend_sched_is_stopped(graph.sched)
    np.testing.assert_array_equal(graph.get("a4"), 16 * X)


def test_without_a_stop_the_graph_runs_through(graph):
    b = graph.base
    graph.stop_after(None)
    graph.set(graph.x, X)
    assert b.ggml_backend_sched_graph_compute(graph.sched, graph.gf) == 0
    assert not b.ggml_backend_sched_is_stopped(graph.sched)
    np.testing.assert_array_equal(graph.get("a4"), 16 * X)
    assert b.ggml_backend_sched_graph_compute_resume(graph.sched) != 0  # nothing to resume
