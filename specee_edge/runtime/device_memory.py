"""What a run will hold in device memory, checked against what the devices have free before it loads it.

A layer offloaded with -ngl costs its weights once per loaded copy of the model and its K/V once per context, on
the device llama.cpp put it on (Model.layer_devices()). A run that loads several copies (the bench: llama-cpp-python's
Llama lanes, llama-server's) or many contexts (the cost lanes) can need several times one copy: the check says, in
one line, what does not fit where, before anything of it is loaded. Weights on the CPU are the model file's memory
map, which every copy in a process and every llama-server shares through the page cache: no device is checked there.

The figures are llama.cpp's sizes as the GGUF gives them: each repeating layer's tensors on its layer's device, the
output layer and its norm on the output's (a model that ties its output to the token embeddings holds a copy of
them there), the token embeddings on the CPU, where llama.cpp keeps them; K/V at f16 (llama.cpp's default cache
type), a cell of each layer on that layer's device. Compute buffers are not counted: a need is raised by MARGIN.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from specee_edge.errors import SpecEEError
from specee_edge.gguf_index import GGUFIndex
from specee_edge.runtime import rpc

MARGIN = 0.10  # compute buffers and allocator slack, unaccounted: a need must fit with this share to spare
KV_BYTES = 2  # f16, llama.cpp's default K and V cache type
CPU = "CPU"
GIB = float(1 << 30)
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.")
_OUTPUT_TENSORS = ("output.weight", "output_norm.weight", "output_norm.bias", "output.bias")

_ggml = rpc.libggml
for _name, _args, _res in (("ggml_backend_dev_name", [ctypes.c_void_p], ctypes.c_char_p),
                           ("ggml_backend_dev_type", [ctypes.c_void_p], ctypes.c_int)):
    getattr(_ggml, _name).argtypes = _args
    getattr(_ggml, _name).restype = _res


def free_bytes() -> dict[str, int]:
    """Each device's free memory now, by its ggml name ("CUDA0", "Vulkan0", "RPC0[127.0.0.1:50052]"), the CPU
    left out. An RPC worker reports its own machine's."""
    free = {}
    for i in range(_ggml.ggml_backend_dev_count()):
        dev = _ggml.ggml_backend_dev_get(i)
        if _ggml.ggml_backend_dev_type(dev) == rpc.GGML_BACKEND_DEVICE_TYPE_CPU:
            continue
        left, total = ctypes.c_size_t(), ctypes.c_size_t()
        _ggml.ggml_backend_dev_memory(dev, ctypes.byref(left), ctypes.byref(total))
        free[_ggml.ggml_backend_dev_name(dev).decode()] = left.value
    return free


@dataclass(frozen=True)
class Footprint:
    """One copy of a model as placed: its offloaded weights' bytes and one context cell's K/V bytes, per device
    (the CPU left out)."""

    weights: dict[str, int] = field(default_factory=dict)
    kv_per_cell: dict[str, int] = field(default_factory=dict)

    @property
    def offloaded(self) -> bool:
        """Whether any of it is on a device of its own (a GPU, an RPC worker)."""
        return bool(self.weights)

    def need(self, copies: int, cells: int) -> dict[str, int]:
        """Bytes per device for `copies` loaded copies and contexts of `cells` cells in all."""
        devices = self.weights.keys() | self.kv_per_cell.keys()
        return {d: copies * self.weights.get(d, 0) + cells * self.kv_per_cell.get(d, 0) for d in devices}


def footprint(index: GGUFIndex, devices: Sequence[str]) -> Footprint:
    """The footprint of the model `index` describes, placed as `devices` says: each layer's device, then the
    output's (Model.layer_devices(), or a plan of it)."""
    arch = index.value("general.architecture")
    *layers, output = devices
    weights: dict[str, int] = {}

    def add(device: str, n_bytes: int) -> None:
        if device != CPU:
            weights[device] = weights.get(device, 0) + n_bytes

    for tensor in index.tensors:
        layer = _LAYER_TENSOR.match(tensor.name)
        if layer and int(layer.group(1)) < len(layers):
            add(layers[int(layer.group(1))], tensor.n_bytes)
        elif tensor.name in _OUTPUT_TENSORS:
            add(output, tensor.n_bytes)
    embeddings = index.tensor("token_embd.weight")
    if index.tensor("output.weight") is None and embeddings is not None:
        add(output, embeddings.n_bytes)  # tied: llama.cpp puts a copy of the embeddings where the output runs
    kv: dict[str, int] = {}
    for il, device in enumerate(layers):
        if device != CPU:
            kv[device] = kv.get(device, 0) + KV_BYTES * kv_width(index, arch, il)
    return Footprint(weights, kv)


def kv_width(index: GGUFIndex, arch: str, il: int) -> int:
    """Layer il's K and V elements per cell: its KV heads times the key and the value length."""
    heads = per_layer(index.value(f"{arch}.attention.head_count"), il)
    kv_heads = per_layer(index.value(f"{arch}.attention.head_count_kv"), il) or heads
    head_dim = index.value(f"{arch}.embedding_length") // max(heads, 1)
    key = index.value(f"{arch}.attention.key_length") or head_dim
    value = index.value(f"{arch}.attention.value_length") or head_dim
    return kv_heads * (key + value)


def per_layer(value, il: int) -> int:
    """A GGUF hyperparameter given once or per layer, at layer il (0 where missing)."""
    if value is None:
        return 0
    return int(value[il]) if hasattr(value, "__len__") else int(value)


def check_fits(what: str, need: Mapping[str, int], free: Mapping[str, int], parts: str, hint: str) -> None:
    """Raises SpecEEError, one line, where `need` (bytes per device) does not fit `free` with MARGIN to spare:
    what needs it, where, how much against how much, `parts` (what the need is made of) and `hint` (what to change)."""
    short = [(device, n, free.get(device, 0)) for device, n in need.items()
             if n > 0 and n * (1 + MARGIN) > free.get(device, 0)]
    if short:
        where = "; ".join(f"{n / GIB:.2f} GiB on {device}, {left / GIB:.2f} GiB free" for device, n, left in short)
        raise SpecEEError(f"{what} does not fit: it needs {where} ({parts}, and {MARGIN:.0%} to spare); {hint}")


def fitting(free: Mapping[str, int], each: Mapping[str, int]) -> int | None:
    """How many of something that takes `each` bytes per device fit in `free` with MARGIN to spare (None: it takes
    no device memory, any number fits)."""
    counts = [int(free.get(device, 0) / (n * (1 + MARGIN))) for device, n in each.items() if n > 0]
    return min(counts) if counts else None
