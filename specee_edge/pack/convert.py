"""Convert predictors from other formats into a pack bound to its target model.

Sources (the kind is told by the file, not by a flag):
  *.joblib / *.pkl   scikit-learn MLPClassifier: a dict {layer: classifier}, or one classifier given
                     as FILE:LAYER. joblib unpickles: convert only files you trust.
  *.npz              numpy arrays `layer<L>.weight<j>` [out, in] and `layer<L>.bias<j>` [out]
  *.safetensors      the SpecEE paper's predictors (`model.layers.<L>.pred.{up,down}.{weight,bias}`)

Draft heads are not converted: the engine runs only the linear draft head `specee-edge calibrate`
trains, so an EAGLE head (`fc.weight`, `layers.0.*`) is refused rather than packed unusable.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import numpy as np

from specee_edge.errors import SpecEEError
from specee_edge.pack.format import Pack, Schedule, TargetIdentity
from specee_edge.pack.safetensors import read_safetensors
from specee_edge.pack.mlp import MLPPredictor

PAPER_KEY = re.compile(r"^model\.layers\.(\d+)\.pred\.(up|down)\.(weight|bias)$")
NPZ_KEY = re.compile(r"^layer(\d+)\.(weight|bias)(\d+)$")


def predictors_from_sklearn(source: str) -> dict[int, MLPPredictor]:
    import joblib
    from sklearn.neural_network import MLPClassifier

    path, _, layer = source.partition(":")
    try:
        obj = joblib.load(path)
    except Exception as e:
        raise SpecEEError(f"cannot load {path} with joblib: {type(e).__name__}: {e}") from None
    if isinstance(obj, MLPClassifier):
        if not layer.isdigit():
            raise SpecEEError(f"{path} holds one classifier: give its layer as {path}:LAYER")
        obj = {int(layer): obj}
    if not isinstance(obj, dict) or not all(isinstance(c, MLPClassifier) for c in obj.values()):
        raise SpecEEError(f"{path}: expected an MLPClassifier or a dict {{layer: MLPClassifier}}")
    predictors = {}
    for il, clf in obj.items():
        if getattr(clf, "activation", None) != "relu" or getattr(clf, "out_activation_", None) != "logistic":
            raise SpecEEError(f"{path}: layer {il}: need a fitted binary MLPClassifier with ReLU hidden layers")
        predictors[int(il)] = MLPPredictor(
            [np.asarray(w, dtype=np.float32).T for w in clf.coefs_],
            [np.asarray(b, dtype=np.float32) for b in clf.intercepts_],
        )
    return predictors


def predictors_to_npz(path: Path, predictors: dict[int, MLPPredictor]) -> None:
    """The format predictors_from_npz reads (calibration keeps its trained MLPs this way)."""
    arrays = {}
    for il, predictor in predictors.items():
        for j, (w, b) in enumerate(zip(predictor.weights, predictor.biases)):
            arrays[f"layer{il}.weight{j}"] = w
            arrays[f"layer{il}.bias{j}"] = b
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def predictors_from_npz(path: Path) -> dict[int, MLPPredictor]:
    parts: dict[int, dict[tuple[str, int], np.ndarray]] = {}
    with np.load(path, allow_pickle=False) as data:
        for key in data.files:
            m = NPZ_KEY.match(key)
            if not m:
                raise SpecEEError(f"{path}: unexpected array {key!r} (expected layer<L>.weight<j> / layer<L>.bias<j>)")
            parts.setdefault(int(m[1]), {})[(m[2], int(m[3]))] = np.asarray(data[key], dtype=np.float32)
    return {il: _chain(path, il, p) for il, p in parts.items()}


def _chain(path: Path, il: int, parts: dict[tuple[str, int], np.ndarray]) -> MLPPredictor:
    n = len(parts) // 2
    try:
        return MLPPredictor([parts[("weight", j)] for j in range(n)], [parts[("bias", j)] for j in range(n)])
    except KeyError as e:
        raise SpecEEError(f"{path}: layer {il} lacks {e.args[0][0]}{e.args[0][1]}") from None


def predictors_from_paper(tensors: dict[str, np.ndarray], path: Path) -> dict[int, MLPPredictor]:
    layers: dict[int, dict[str, np.ndarray]] = {}
    for key, array in tensors.items():
        m = PAPER_KEY.match(key)
        if m:
            layers.setdefault(int(m[1]), {})[f"{m[2]}.{m[3]}"] = array.astype(np.float32)
    predictors = {}
    for il, p in layers.items():
        if len(p) != 4:
            raise SpecEEError(f"{path}: layer {il} lacks some of pred.up/down weight/bias")
        predictors[il] = MLPPredictor([p["up.weight"], p["down.weight"]], [p["up.bias"], p["down.bias"]])
    return predictors


def convert(
    sources: list[str],
    target: TargetIdentity,
    *,
    threshold: float = 0.5,
    command: str | None = None,
    note: Callable[[str], None] = lambda line: None,
) -> Pack:
    """Gather the predictors in `sources` into a pack for `target`; `note` gets one line per thing left out."""
    predictors: dict[int, MLPPredictor] = {}
    last = target.n_layer - 1
    for source in sources:
        path = Path(source.partition(":")[0] if not Path(source).exists() else source)
        if not path.exists():
            raise SpecEEError(f"source not found: {path}")
        suffix = path.suffix.lower()
        if suffix in (".joblib", ".pkl"):
            found = predictors_from_sklearn(source)
        elif suffix == ".npz":
            found = predictors_from_npz(path)
        elif suffix == ".safetensors":
            tensors = read_safetensors(path)
            if "fc.weight" in tensors:
                raise SpecEEError(f"{path}: an EAGLE draft head; the engine runs only the linear draft head"
                                  " that `specee-edge calibrate` trains")
            found = predictors_from_paper(tensors, path)
            if not found:
                raise SpecEEError(f"{path}: no SpecEE predictors (model.layers.<L>.pred.*)")
        else:
            raise SpecEEError(f"{path}: unknown source type {suffix!r} (.joblib, .pkl, .npz or .safetensors)")
        if overlap := set(found) & set(predictors):
            raise SpecEEError(f"{path}: predictors for layers {sorted(overlap)} were already given")
        # The paper's files have one for every layer; the last layer always runs, so its predictor never fires
        if found.pop(last, None) is not None:
            note(f"{path}: left out the predictor of layer {last}: the paper's rule never exits at the last layer")
        predictors.update(found)

    if not predictors:
        raise SpecEEError("no predictors in the sources")
    if out_of_range := sorted(il for il in predictors if not 0 <= il < last):
        raise SpecEEError(
            f"predictors for layers {out_of_range} do not fit the target ({target.arch}, {target.n_layer} layers:"
            f" predictors go on layers 0..{last - 1})"
        )
    n_features = {p.n_features for p in predictors.values()}
    if len(n_features) != 1 or next(iter(n_features)) % 3:
        raise SpecEEError(f"predictors take {sorted(n_features)} features; all must take 3k (logits, probs, delta)")
    return Pack(
        target=target,
        k=next(iter(n_features)) // 3,
        threshold=threshold,
        schedule=Schedule(offline=sorted(predictors)),
        predictors=predictors,
        provenance={
            "tool": "specee-edge convert",
            "command": command or " ".join(sys.argv),
            "sources": [str(s) for s in sources],
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": {name: version(name) for name in ("specee-edge", "gguf", "numpy")},
        },
    )
