"""Write, read and validate specee packs (gguf-py). Anything wrong in a pack raises PackError."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from specee_edge.errors import ModelLoadError, SpecEEError
from specee_edge.exits import ExitKind
from specee_edge.gguf_index import GGUFIndex
from specee_edge.pack.format import (
    DRAFT_PREFIX,
    DRAFT_VOCAB_MAP,
    FEATURES,
    FORMAT_VERSION,
    KEY_DRAFT_KIND,
    KEY_FEATURES,
    KEY_K,
    KEY_OFFLINE_LAYERS,
    KEY_OFFSETS,
    KEY_PREDICTOR_LAYERS,
    KEY_PROVENANCE,
    KEY_TARGET_ARCH,
    KEY_TARGET_FINGERPRINT,
    KEY_TARGET_N_EMBD,
    KEY_TARGET_N_LAYER,
    KEY_TARGET_N_VOCAB,
    KEY_THRESHOLD,
    KEY_DEFAULT_QUALITY,
    EXACT_QUALITY,
    KEY_LEVELS,
    MAX_DRAFT,
    KEY_TEMPERATURES,
    KEY_LOOKUP_MAX_N,
    KEY_VERSION,
    KEY_WINDOW,
    LEVEL_FIGURES,
    OFF,
    OLDEST_VERSION,
    PACK_ARCH,
    DraftHead,
    LayerExit,
    Pack,
    QualityLevel,
    Schedule,
    TargetIdentity,
    level_key,
    predictor_tensor,
)
from specee_edge.pack.mlp import MLPPredictor

QUANT_TYPES = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16,
               "q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
MAX_LAYERS = 4096
EMPTY_ARRAYS_ALLOWED = (KEY_PREDICTOR_LAYERS, KEY_OFFLINE_LAYERS, KEY_OFFSETS)  # GGUF cannot store []
MAX_VOCAB = 10_000_000
MAX_HIDDEN = 1 << 16


class PackError(SpecEEError):
    """A pack that cannot be used: unreadable, inconsistent or from an unknown format version."""


# --- writing ---------------------------------------------------------------------------------


def _add_weight(writer: gguf.GGUFWriter, name: str, array: np.ndarray, quant: str) -> None:
    """Matrices whose rows fit the block size are quantized; vectors and norms stay F32."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    qtype = QUANT_TYPES[quant]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if array.ndim < 2 or qtype == GGMLQuantizationType.F32 or array.shape[-1] % block:
        writer.add_tensor(name, array)
    elif qtype == GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def write_pack(path: str | os.PathLike, pack: Pack, *, predictor_type: str = "f32", draft_quant: str = "q8_0") -> Path:
    """Write atomically: a temporary file in the same folder, renamed when complete."""
    if predictor_type not in ("f32", "f16") or draft_quant not in QUANT_TYPES:
        raise PackError(f"predictors are f32 or f16 and draft heads {'/'.join(QUANT_TYPES)}")
    validate(pack)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    writer = gguf.GGUFWriter(tmp, PACK_ARCH)
    t = pack.target
    writer.add_uint32(KEY_VERSION, FORMAT_VERSION)
    writer.add_string(KEY_TARGET_ARCH, t.arch)
    writer.add_uint32(KEY_TARGET_N_LAYER, t.n_layer)
    writer.add_uint32(KEY_TARGET_N_EMBD, t.n_embd)
    writer.add_uint32(KEY_TARGET_N_VOCAB, t.n_vocab)
    writer.add_string(KEY_TARGET_FINGERPRINT, t.fingerprint)
    writer.add_uint32(KEY_K, pack.k)
    writer.add_float32(KEY_THRESHOLD, pack.threshold)
    writer.add_array(KEY_FEATURES, list(FEATURES))
    # GGUF has no empty arrays: add_array skips them and reading takes a missing one as empty
    writer.add_array(KEY_PREDICTOR_LAYERS, sorted(pack.predictors))
    if pack.lookup_max_n:
        writer.add_uint32(KEY_LOOKUP_MAX_N, pack.lookup_max_n)
    if pack.temperatures:
        writer.add_array(KEY_TEMPERATURES, [float(pack.temperatures.get(il, 1.0)) for il in sorted(pack.predictors)])
    if pack.levels:
        writer.add_array(KEY_LEVELS, [float(level.quality) for level in pack.levels])
        writer.add_float32(KEY_DEFAULT_QUALITY, float(pack.level().quality))
    for i, level in enumerate(pack.levels):
        exits = [level.exits.get(il, OFF) for il in sorted(pack.predictors)]
        writer.add_array(level_key(i, "thresholds"), [float(e.threshold) for e in exits])
        writer.add_array(level_key(i, "kinds"), [int(e.kind) for e in exits])
        if level.offline:  # GGUF has no empty arrays: a missing one reads as empty
            writer.add_array(level_key(i, "offline"), list(level.offline))
        for name in LEVEL_FIGURES:
            writer.add_float32(level_key(i, name), float(getattr(level, name)))
    writer.add_array(KEY_OFFLINE_LAYERS, list(pack.schedule.offline))
    writer.add_uint32(KEY_WINDOW, pack.schedule.window)
    writer.add_array(KEY_OFFSETS, list(pack.schedule.offsets))
    writer.add_string(KEY_DRAFT_KIND, pack.draft.kind if pack.draft else "none")
    writer.add_string(KEY_PROVENANCE, json.dumps(pack.provenance, sort_keys=True))

    for layer, predictor in sorted(pack.predictors.items()):
        for j, (w, b) in enumerate(zip(predictor.weights, predictor.biases)):
            dtype = np.float16 if predictor_type == "f16" else np.float32
            writer.add_tensor(predictor_tensor(layer, j, "weight"), np.ascontiguousarray(w, dtype=dtype))
            writer.add_tensor(predictor_tensor(layer, j, "bias"), np.ascontiguousarray(b, dtype=np.float32))
    if pack.draft:
        for name, array in pack.draft.tensors.items():
            _add_weight(writer, DRAFT_PREFIX + name, array, draft_quant)
        if pack.draft.vocab_map is not None:
            writer.add_tensor(DRAFT_VOCAB_MAP, np.ascontiguousarray(pack.draft.vocab_map, dtype=np.int32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path


# --- reading ---------------------------------------------------------------------------------


def _field(reader: gguf.GGUFReader, key: str, kind: type, path: Path):
    field = reader.get_field(key)
    if field is None and kind is list and key in EMPTY_ARRAYS_ALLOWED:
        return []
    if field is None:
        raise PackError(f"{path.name}: missing key {key}")
    value = field.contents()
    if kind is list:
        if not isinstance(value, list):
            raise PackError(f"{path.name}: {key} must be an array")
        return value
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise PackError(f"{path.name}: {key} must be a {kind.__name__}, found {type(value).__name__}")
    return value


def _tensor(t) -> np.ndarray:
    array = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    expected = [int(n) for n in reversed(t.shape)]
    if int(np.prod(expected)) != array.size:
        raise ValueError(f"tensor {t.name}: {array.size} values for shape {expected}")
    return array.reshape(expected)


def read_pack(path: str | os.PathLike) -> Pack:
    """Read and validate a pack. Raises PackError with a one-line reason."""
    path = Path(path)
    if not path.is_file():
        raise PackError(f"pack not found: {path}")
    try:
        # gguf-py's reader walks an array element by element and never stops where a damaged length
        # points past the file's end (it grows its lists until memory runs out): the bounds-checked
        # index walks the header first
        GGUFIndex(path)
        reader = gguf.GGUFReader(path)
        tensors = {t.name: t for t in reader.tensors}
    except ModelLoadError as e:
        raise PackError(f"cannot read pack {path.name}: {str(e).split(': ', 1)[-1]}") from None
    except Exception as e:  # gguf-py raises many kinds on a damaged file
        raise PackError(f"cannot read pack {path.name}: corrupt or truncated GGUF ({type(e).__name__})") from None

    arch = reader.get_field("general.architecture")
    if arch is None or arch.contents() != PACK_ARCH:
        found = arch.contents() if arch is not None else "unknown"
        raise PackError(f"{path.name} is not a specee pack (its architecture is {found!r})")
    version = _field(reader, KEY_VERSION, int, path)
    if version < OLDEST_VERSION:
        raise PackError(f"{path.name} is a version {version} pack (no quality levels): recalibrate it with"
                        f" `specee-edge calibrate MODEL.gguf -o {path.name}`")
    if version > FORMAT_VERSION:
        raise PackError(f"{path.name} has pack format version {version}; this specee-edge reads version {FORMAT_VERSION}"
                        " (a newer specee-edge wrote it)")

    try:
        pack = _decode(reader, tensors, path)
    except PackError:
        raise
    except Exception as e:
        raise PackError(f"cannot read pack {path.name}: {type(e).__name__}: {e}") from None
    validate(pack, name=path.name)
    return pack


def _decode(reader: gguf.GGUFReader, tensors: dict, path: Path) -> Pack:
    target = TargetIdentity(
        arch=_field(reader, KEY_TARGET_ARCH, str, path),
        n_layer=_field(reader, KEY_TARGET_N_LAYER, int, path),
        n_embd=_field(reader, KEY_TARGET_N_EMBD, int, path),
        n_vocab=_field(reader, KEY_TARGET_N_VOCAB, int, path),
        fingerprint=_field(reader, KEY_TARGET_FINGERPRINT, str, path),
    )
    features = _field(reader, KEY_FEATURES, list, path)
    if features != list(FEATURES):
        raise PackError(f"{path.name}: unknown feature layout {features}")

    predictors = {}
    for layer in _field(reader, KEY_PREDICTOR_LAYERS, list, path):
        weights, biases, j = [], [], 0
        while predictor_tensor(layer, j, "weight") in tensors:
            weight, bias = predictor_tensor(layer, j, "weight"), predictor_tensor(layer, j, "bias")
            if bias not in tensors:
                raise PackError(f"{path.name}: missing tensor {bias}")
            weights.append(_tensor(tensors[weight]))
            biases.append(_tensor(tensors[bias]))
            j += 1
        if not weights:
            raise PackError(f"{path.name}: missing tensor {predictor_tensor(layer, 0, 'weight')}")
        predictors[int(layer)] = MLPPredictor(weights, biases)

    draft = None
    kind = _field(reader, KEY_DRAFT_KIND, str, path)
    if kind != "none":
        draft_tensors = {
            name[len(DRAFT_PREFIX):]: _tensor(t)
            for name, t in tensors.items()
            if name.startswith(DRAFT_PREFIX) and name != DRAFT_VOCAB_MAP
        }
        if not draft_tensors:
            raise PackError(f"{path.name}: draft head {kind!r} has no tensors")
        vocab_map = np.asarray(tensors[DRAFT_VOCAB_MAP].data, dtype=np.int64) if DRAFT_VOCAB_MAP in tensors else None
        head = tensors.get(DRAFT_PREFIX + "head.weight")
        quant = head.tensor_type.name.lower() if head is not None else "f32"
        draft = DraftHead(kind, draft_tensors, vocab_map, quant)

    def per_layer(key: str) -> dict[int, float]:
        values = _field(reader, key, list, path)
        if len(values) != len(predictors):
            raise PackError(f"{path.name}: {key} has {len(values)} values for {len(predictors)} predictors")
        return dict(zip(sorted(predictors), (float(v) for v in values)))

    def level_exits(i: int) -> dict[int, LayerExit]:
        thresholds = per_layer(level_key(i, "thresholds"))
        if reader.get_field(level_key(i, "kinds")) is None:  # format 2: every exit verified
            return {il: LayerExit(ExitKind.VERIFIED, t) if t < 1.0 else OFF for il, t in thresholds.items()}
        kinds = per_layer(level_key(i, "kinds"))
        try:
            return {il: LayerExit(ExitKind(int(kinds[il])), t) for il, t in thresholds.items()}
        except ValueError:
            raise PackError(f"{path.name}: {level_key(i, 'kinds')} holds an unknown exit kind") from None

    temperatures = per_layer(KEY_TEMPERATURES) if reader.get_field(KEY_TEMPERATURES) is not None else {}
    levels, default_quality = [], None
    if reader.get_field(KEY_LEVELS) is not None:
        for i, quality in enumerate(_field(reader, KEY_LEVELS, list, path)):
            offline = reader.get_field(level_key(i, "offline"))
            levels.append(QualityLevel(
                round(float(quality), 6),  # stored as float32: 0.9 reads back as 0.89999998
                level_exits(i),
                [int(x) for x in offline.contents()] if offline is not None else [],
                **{name: float(_field(reader, level_key(i, name), float, path)) for name in LEVEL_FIGURES
                   if name in LEVEL_FIGURES[:4] or reader.get_field(level_key(i, name)) is not None}))
        default_quality = round(float(_field(reader, KEY_DEFAULT_QUALITY, float, path)), 6)
    try:
        provenance = json.loads(_field(reader, KEY_PROVENANCE, str, path))
    except json.JSONDecodeError:
        raise PackError(f"{path.name}: {KEY_PROVENANCE} is not JSON") from None
    return Pack(
        target=target,
        k=_field(reader, KEY_K, int, path),
        threshold=float(_field(reader, KEY_THRESHOLD, float, path)),
        schedule=Schedule(
            offline=[int(x) for x in _field(reader, KEY_OFFLINE_LAYERS, list, path)],
            window=_field(reader, KEY_WINDOW, int, path),
            offsets=[int(x) for x in _field(reader, KEY_OFFSETS, list, path)],
        ),
        predictors=predictors,
        draft=draft,
        provenance=provenance if isinstance(provenance, dict) else {},
        levels=levels,
        default_quality=default_quality,
        temperatures=temperatures,
        lookup_max_n=_field(reader, KEY_LOOKUP_MAX_N, int, path) if reader.get_field(KEY_LOOKUP_MAX_N) is not None else 0,
    )


# --- validation ------------------------------------------------------------------------------


def validate(pack: Pack, *, name: str = "pack") -> None:
    """Every consistency rule the engine relies on; raises PackError naming the first broken one."""
    t = pack.target

    def fail(reason: str):
        raise PackError(f"{name}: {reason}")

    if not (1 <= t.n_layer <= MAX_LAYERS and 1 <= t.n_embd <= 1 << 16 and 1 <= t.n_vocab <= MAX_VOCAB):
        fail(f"implausible target shape (n_layer {t.n_layer}, n_embd {t.n_embd}, n_vocab {t.n_vocab})")
    if not 1 <= pack.k <= 8:
        fail(f"k = {pack.k} candidates; must be 1..8")
    if not 0.0 < pack.threshold < 1.0:
        fail(f"threshold {pack.threshold} is not in (0, 1)")
    if not 0 <= pack.lookup_max_n <= 8:
        fail(f"prompt lookup n-grams of up to {pack.lookup_max_n} tokens; must be 0..8")
    if set(pack.temperatures) - set(pack.predictors) or not all(0.05 <= v <= 20.0 for v in pack.temperatures.values()):
        fail("temperatures must be in [0.05, 20] and belong to predictor layers")
    qualities = [level.quality for level in pack.levels]
    if qualities != sorted(set(qualities)) or not all(0.5 < lv.quality < 1.0 or (lv.quality == EXACT_QUALITY and lv.exact)
                                                      for lv in pack.levels):
        fail(f"quality levels must ascend within (0.5, 1), the exact level last at 1: {qualities}")
    for level in pack.levels:
        if level.exact != (level.quality == EXACT_QUALITY) or not 0 <= level.max_draft <= MAX_DRAFT:
            fail(f"quality {level.quality:g}: only the level of quality 1 is exact, with 1..{MAX_DRAFT} drafts a round")
    if pack.levels and pack.default_quality not in qualities:
        fail(f"the default quality {pack.default_quality} is not one of the levels {qualities}")
    last = t.n_layer - 1
    offline_sets = [pack.schedule.offline, *(level.offline for level in pack.levels)]
    for layer in [*pack.predictors, *(il for offline in offline_sets for il in offline)]:
        if not 0 <= layer <= last:
            fail(f"layer {layer} is out of range [0, {t.n_layer}) for a {t.n_layer}-layer target")
    for offline in offline_sets:
        if missing := set(offline) - set(pack.predictors):
            fail(f"an offline schedule names layers without a predictor: {sorted(missing)}")
    for level in pack.levels:
        if set(level.exits) != set(pack.predictors) or not all(0.0 < e.threshold <= 1.0 for e in level.exits.values()):
            fail(f"quality {level.quality:g}: thresholds must be in (0, 1], one per predictor layer")
        if level.exits.get(last, OFF).kind == ExitKind.VERIFIED:
            fail(f"quality {level.quality:g}: the last layer's exit cannot be verified (its exit head is the output head)")
    if not 0 <= pack.schedule.window <= 64 or any(abs(o) > t.n_layer for o in pack.schedule.offsets):
        fail("implausible online window or offsets")

    for layer, predictor in pack.predictors.items():
        if len(predictor.weights) != len(predictor.biases):
            fail(f"predictor {layer}: weights and biases differ in count")
        n_in = 3 * pack.k
        for j, (w, b) in enumerate(zip(predictor.weights, predictor.biases)):
            if w.ndim != 2 or b.shape != (w.shape[0],) or w.shape[1] != n_in or w.shape[0] > MAX_HIDDEN:
                fail(f"predictor {layer}, layer {j}: shapes {w.shape} / {b.shape} do not chain from {n_in} inputs")
            if not (np.isfinite(w).all() and np.isfinite(b).all()):
                fail(f"predictor {layer}, layer {j}: NaN or infinite weights")
            n_in = w.shape[0]
        if n_in != 1:
            fail(f"predictor {layer}: {n_in} outputs; must be 1")

    if pack.draft:
        for tensor_name, array in pack.draft.tensors.items():
            if not np.isfinite(array).all():
                fail(f"draft tensor {tensor_name}: NaN or infinite weights")
        vocab_map = pack.draft.vocab_map
        if vocab_map is not None and (vocab_map.ndim != 1 or vocab_map.min(initial=0) < 0 or vocab_map.max(initial=0) >= t.n_vocab):
            fail(f"draft vocabulary map has ids outside [0, {t.n_vocab})")
