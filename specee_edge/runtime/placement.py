"""Where a model's layers run: llama.cpp's -ngl and -ts, and which end of the model goes to the devices.

llama.cpp's -ngl N offloads N "layers" counting the output layer as one: the output layer and the last N - 1
repeating layers go to the devices (the RPC workers first, then the GPUs: llama.cpp puts RPC servers at the front
of its device list), the rest stays on the CPU. SpecEE's placement (--offload-first) offloads the output layer and
the FIRST N - 1 repeating layers instead, so that a model too big for the GPU runs its first layers there and a
token that leaves early skips the layers left on the slower CPU. It is patches/0013-model-offload-first-layers.patch,
switched by the GGUF key OFFLOAD_FIRST_KEY: a model loaded here gets it as a metadata override, llama-server from
the same tree as `--override-kv`. The count is llama.cpp's either way, so the same -ngl needs the same device
memory; the K/V cache, the norms and the early-exit draft head follow each layer's device. Which device each layer
got is llama.cpp's to say: Model.layer_devices() reads its map back, and nothing here restates it.

One Placement per process (set_default: -ngl, -ts and --offload-first as parsed by the command line) is read by
every model the process loads (the engine's, the bench's and calibration's cost lanes) and by the bench's
llama-server and llama-cpp-python lanes, so that every lane of a run splits the model the same way.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from llama_cpp import llama_cpp as _llama

from specee_edge.errors import ModelLoadError, SpecEEError
from specee_edge.runtime import rpc

OFFLOAD_FIRST_KEY = "specee.offload_first"
ALL_LAYERS = 999  # -ngl all: more than any model has, so llama.cpp offloads every layer and the output


class _TensorBufferOverride(ctypes.Structure):
    """struct llama_model_tensor_buft_override (llama.h): weights whose name matches `pattern` go to `buft`."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass(frozen=True)
class Placement:
    n_gpu_layers: int = 0  # llama.cpp's -ngl: the output layer counts as one
    tensor_split: tuple[float, ...] = ()  # -ts: the offloaded layers' shares per device (empty: by free memory)
    offload_first: bool = False  # SpecEE's: the first repeating layers go to the devices, not the last
    # -ot, the user's own, taken as given: (tensor name pattern, buffer type), e.g. ("ffn_.*", "CPU"); they move
    # the weights they match, after the layers were placed (the KV cache and the layer map stay)
    tensor_overrides: tuple[tuple[str, str], ...] = ()

    def kv_overrides(self) -> dict[str, bool]:
        """The GGUF metadata overrides that make llama.cpp load the model this way."""
        return {OFFLOAD_FIRST_KEY: True} if self.offload_first else {}

    def llama_server_args(self) -> list[str]:
        """llama-server's flags for the same split, pinned: its automatic fitting (`--fit`, on by default in this
        llama.cpp) would otherwise choose its own number of layers and context on a GPU build."""
        args = ["-ngl", str(self.n_gpu_layers), "--fit", "off"]
        if self.tensor_split:
            args += ["-ts", ",".join(f"{share:g}" for share in self.tensor_split)]
        args += [arg for key, value in self.kv_overrides().items()
                 for arg in ("--override-kv", f"{key}=bool:{str(value).lower()}")]
        if self.tensor_overrides:
            args += ["-ot", ",".join(f"{pattern}={buft}" for pattern, buft in self.tensor_overrides)]
        return args

    def apply(self, params: _llama.llama_model_params) -> list[object]:
        """Set `params` for this placement; returns the ctypes buffers `params` points into, which must outlive
        the model load."""
        params.n_gpu_layers = self.n_gpu_layers
        keep: list[object] = []
        if self.tensor_split:
            if (len(self.tensor_split) > _llama.LLAMA_MAX_DEVICES or min(self.tensor_split) < 0
                    or not sum(self.tensor_split) > 0):
                raise ModelLoadError(f"-ts/--tensor-split takes at most {_llama.LLAMA_MAX_DEVICES} shares >= 0, not all 0;"
                                  f" got {','.join(f'{x:g}' for x in self.tensor_split)}")
            split = (ctypes.c_float * _llama.LLAMA_MAX_DEVICES)(*self.tensor_split)
            params.tensor_split = split
            keep.append(split)
        overrides = self.kv_overrides()
        if overrides:
            array = (_llama.llama_model_kv_override * (len(overrides) + 1))()  # the last, zeroed, ends the list
            for entry, (key, value) in zip(array, overrides.items()):
                entry.key = key.encode()
                entry.tag = _llama.LLAMA_KV_OVERRIDE_TYPE_BOOL
                entry.value.val_bool = value
            params.kv_overrides = array
            keep.append(array)
        if self.tensor_overrides:
            types = buffer_types()
            unknown = sorted({buft for _, buft in self.tensor_overrides if buft not in types})
            if unknown:
                raise ModelLoadError(f"-ot/--override-tensor: no buffer type {', '.join(unknown)} here; there are "
                                     f"{', '.join(sorted(types))}")
            array = (_TensorBufferOverride * (len(self.tensor_overrides) + 1))()  # the last, zeroed, ends the list
            for entry, (pattern, buft) in zip(array, self.tensor_overrides):
                entry.pattern, entry.buft = pattern.encode(), types[buft]
            params.tensor_buft_overrides = ctypes.cast(array, ctypes.c_void_p)
            keep.append(array)
        return keep


def buffer_types() -> dict[str, int]:
    """Every device's buffer type by its name, as llama.cpp's -ot takes them ("CPU", "CUDA0", "RPC0[host:port]")."""
    ggml = rpc.libggml
    types = {}
    for i in range(ggml.ggml_backend_dev_count()):
        buft = ggml.ggml_backend_dev_buffer_type(ggml.ggml_backend_dev_get(i))
        if buft:
            types[ggml.ggml_backend_buft_name(buft).decode()] = buft
    return types


def parse_tensor_overrides(values: list[str] | None) -> tuple[tuple[str, str], ...]:
    """-ot: PATTERN=BUFFER_TYPE, comma-separated, the flag given any number of times (llama.cpp's spelling)."""
    overrides = []
    for item in (part for value in values or () for part in value.split(",") if part):
        pattern, sep, buft = item.partition("=")
        if not sep or not pattern or not buft:
            raise SpecEEError(f"-ot/--override-tensor takes PATTERN=BUFFER_TYPE such as 'ffn_.*=CPU', got {item!r}")
        overrides.append((pattern, buft))
    return tuple(overrides)


def describe_devices(devices: list[str]) -> str:
    """A line for people from each layer's device then the output's (Model.layer_devices()), e.g.
    "layers 0-14 on CUDA0, layers 15-31 on CPU; the output on CUDA0"."""
    *layers, output = devices
    runs: list[list] = []  # [device, first, last]
    for il, device in enumerate(layers):
        if runs and runs[-1][0] == device:
            runs[-1][2] = il
        else:
            runs.append([device, il, il])
    spans = [f"layer {a} on {device}" if a == b else f"layers {a}-{b} on {device}" for device, a, b in runs]
    return f"{', '.join(spans)}; the output on {output}"


def first_crossing(devices: list[str]) -> int | None:
    """The first repeating layer on another device than layer 0, from each layer's device then the output's
    (Model.layer_devices()): where a token's hidden state crosses between devices; None on one device. A model
    split over more devices crosses again later: the costs price only this first crossing apart."""
    *layers, _output = devices
    return next((il for il, device in enumerate(layers) if device != layers[0]), None)


def parse_gpu_layers(value: str) -> int:
    """-ngl: a number, or all. auto and -1 mean all here too: llama.cpp fits them to the free device memory
    (its --fit), which this runtime does not do."""
    if value.strip().lower() in ("all", "auto", "-1"):
        return ALL_LAYERS
    try:
        layers = int(value)
    except ValueError:
        raise SpecEEError(f"-ngl/--n-gpu-layers takes a number or all, got {value!r}") from None
    if layers < 0:
        raise SpecEEError(f"-ngl/--n-gpu-layers takes a number >= 0 or all, got {value!r}")
    return layers


def parse_tensor_split(value: str | None) -> tuple[float, ...]:
    """-ts: comma-separated shares such as 3,1 (None or empty: by free memory)."""
    try:
        return tuple(float(x) for x in value.split(",")) if value else ()
    except ValueError:
        raise SpecEEError(f"-ts/--tensor-split takes comma-separated shares such as 3,1, got {value!r}") from None


_default = Placement()


def default() -> Placement:
    """The placement of every model this process loads unless told otherwise (none offloaded until set)."""
    return _default


def set_default(placement: Placement) -> None:
    global _default
    _default = placement
