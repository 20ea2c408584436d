"""`specee-edge info`: a readable summary of a model GGUF or a pack."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from rich.console import Group
from rich.table import Table
from rich.text import Text

from specee_edge.errors import RuntimeMissingError
from specee_edge.gguf_index import GGUFIndex
from specee_edge.exits import ExitKind
from specee_edge.pack.format import PACK_ARCH, ROUND_MAX_DRAFTS, Pack, QualityLevel, quality_name
from specee_edge.pack.io import read_pack
from specee_edge.pack.locate import find_pack, pack_origin
from specee_edge.pack.task_figures import figures_path, read_figures
from specee_edge.pack.target import target_identity


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.1f} MiB"


def _kv_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    return table


def summarize(path: Path) -> Group:
    reader = GGUFIndex(path)
    if reader.value("general.architecture") == PACK_ARCH:
        return _pack_summary(path)
    return _model_summary(path, reader)


def _early_exit_support(path: Path) -> str:
    """Only the patched runtime knows (it decides per architecture in C); info works without it."""
    try:
        from specee_edge.runtime import Model
    except RuntimeMissingError:
        return "unknown: the patched runtime is not installed (specee-edge setup)"
    return "supported" if Model(path).info.supports_early_exit else "not supported for this architecture"


def _model_summary(path: Path, reader: GGUFIndex) -> Group:
    identity = target_identity(path, reader)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    n_params = sum(int(t.n_elements) for t in reader.tensors)
    return Group(_kv_table(f"model {path.name}", [
        ("architecture", identity.arch),
        ("layers", str(identity.n_layer)),
        ("n_embd", str(identity.n_embd)),
        ("vocabulary", str(identity.n_vocab)),
        ("parameters", f"{n_params / 1e6:.1f} M"),
        ("file size", _size(path.stat().st_size)),
        ("tensor types", ", ".join(f"{name} x{n}" for name, n in types.most_common())),
        ("early exit", _early_exit_support(path)),
        ("fingerprint", identity.fingerprint[:16]),
        ("pack", _pack_found(path)),
    ]))


def _pack_found(path: Path) -> str:
    """The pack chat, serve and bench load for this model without --pack, and where it was found."""
    pack = find_pack(path)
    return "none: `specee-edge calibrate` makes one" if pack is None else f"{pack} ({pack_origin(pack, path)})"


def _draft_text(pack: Pack) -> str:
    if pack.draft is None:
        return "none"
    text = f"{pack.draft.kind}, {len(pack.draft.tensors)} tensors"
    if pack.draft.vocab_map is not None:
        text += f", reduced vocabulary of {len(pack.draft.vocab_map)}"
    return text


def _pack_summary(path: Path) -> Group:
    pack = read_pack(path)
    t = pack.target
    # a pack with quality levels takes its thresholds and offline layers from them
    schedule = [
        ("quality levels", f"{', '.join(quality_name(lv.quality) for lv in pack.levels)} (default {quality_name(pack.level().quality)})"),
    ] if pack.levels else [
        ("exit threshold", f"{pack.threshold:g}"),
        ("offline layers", ", ".join(map(str, pack.schedule.offline))),
    ]
    head = _kv_table(f"pack {path.name}", [
        ("target", t.describe()),
        ("candidates (k)", f"{pack.k}" + (f", the first from prompt lookup (n-grams up to {pack.lookup_max_n})"
                                          if pack.lookup_max_n else ", all from the draft head")),
        *schedule,
        ("online window", f"last {pack.schedule.window} exits, offsets {pack.schedule.offsets}"),
        ("draft head", _draft_text(pack)),
        ("file size", _size(path.stat().st_size)),
    ])
    predictors = Table(title="predictors", title_justify="left")
    for column in ("layer", "shape", "parameters", "temperature"):
        predictors.add_column(column, justify="right")
    for layer, p in sorted(pack.predictors.items()):
        n = sum(w.size + b.size for w, b in zip(p.weights, p.biases))
        predictors.add_row(str(layer), " -> ".join(map(str, p.shape)), f"{n:,}", f"{pack.temperatures.get(layer, 1.0):.3g}")
    provenance = _kv_table("provenance", [(k, str(v)) for k, v in sorted(pack.provenance.items())])
    return Group(head, *([_levels_table(pack), _task_figures(path, pack)] if pack.levels else []), predictors, provenance)


def _task_figures(path: Path, pack: Pack) -> Table | Text:
    """What `specee-edge eval --store` measured of each level against plain decoding, beside the level's agreement
    and speed from calibration; a line where nothing was stored (a pack from before eval, or never evaluated)."""
    stored = read_figures(path)
    if stored is None:
        return Text(f"task figures: none stored for this pack ({figures_path(path).name} beside it): "
                    "`specee-edge eval --tasks humaneval,loglik --store` measures them")
    title = f"task figures (specee-edge eval, {stored.path.name})"
    if not stored.current:
        title += ": measured on another version of this pack (its sha256 differs)"
    table = Table(title=title, title_justify="left")
    table.add_column("quality", justify="right", no_wrap=True)
    for column in ("agreement", "speed\n(calibration)"):
        table.add_column(column, justify="right")
    humaneval, loglik = stored.tasks.get("humaneval"), stored.tasks.get("loglik")
    if humaneval:
        for column in ("pass@1\n(- plain)", "time per\nanswer\n/ plain", "log-lik\n- plain\n(code)"):
            table.add_column(column, justify="right")
    if loglik:
        table.add_column("log-lik\n- plain\n(prompts)", justify="right")
    levels = {quality_name(level.quality): level for level in pack.levels}
    for name in dict.fromkeys(name for task in stored.tasks.values() for name in task.levels):
        level = levels.get(name)
        row = [name, "1 (exact)" if level is not None and level.exact else "" if level is None else f"{level.agreement:.3f}",
               "" if level is None else f"{level.speedup:.3f}x"]
        if humaneval:
            figures = humaneval.levels.get(name, {})
            row += [_figure(figures, "pass_at_1", "{:.3f}") + _figure(figures, "pass_at_1_diff", " ({:+.3f})"),
                    _figure(figures, "time_ratio", "{:.3f}x"), _figure(figures, "log_likelihood_gap", "{:+.3f}")]
        if loglik:
            row.append(_figure(loglik.levels.get(name, {}), "log_likelihood_gap", "{:+.3f}"))
        table.add_row(*row)
    table.caption = "; ".join(
        f"{task.task}: {task.problems} {'problems' if task.task == 'humaneval' else 'prompts'}, up to {task.tokens} tokens, "
        f"{'greedy' if task.temperature == 0 else f'temperature {task.temperature:g}'} ({task.command})"
        for task in stored.tasks.values()) + "; each difference is against plain decoding (exits off) on the same problems"
    return table


def _figure(figures: dict, key: str, spec: str) -> str:
    value = figures.get(key)
    return "" if value is None else spec.format(value)


def _levels_table(pack: Pack) -> Table:
    """The quality levels: the exits each switches on, and what calibration measured for it through the
    engine on held-out prompts (the KV mode named in the title)."""
    default = pack.level().quality
    mode = pack.provenance.get("kv_mode", "fill")
    table = Table(title=f"quality levels (--quality; * the default; measured on held-out prompts, --kv-mode {mode})",
                  title_justify="left")
    table.add_column("quality", justify="right", no_wrap=True, vertical="bottom")
    table.add_column("exits (layers)", overflow="fold", vertical="bottom")
    # headers broken between words, so that the table fits 80 columns
    for column in ("agreement\n(95% interval)", "exit\nrate", "head-\nfree", "speed\n(predicted)", "identical\nanswers\n(code)"):
        table.add_column(column, justify="right", vertical="bottom")
    for level in pack.levels:
        low, high = level.agreement_interval()
        interval = f"{level.agreement:.3f}" + (f"\n({low:.3f}-{high:.3f})" if level.steps else "")
        if not level.off and low < level.quality - 1e-6:  # a pack from before names were checked against it
            interval += "\nshort of its name"
        identical = "-" if level.identical < 0 else f"{level.identical:.2f}" + (
            f" ({level.identical_code:.2f})" if level.identical_code >= 0 else "")
        speed = f"{level.speedup:.3f}x"
        if level.exact:  # the full model's own answers: agreement 1 by construction, speed measured end to end
            interval, identical = "1 (exact)", "all"
            # a record of calibration's measurement: the engine's controller decides each round on the machine it runs on
            paid = lambda greedy: "faster" if level.drafts(greedy) else "not faster"
            speed += (f" greedy, {paid(True)} at calibration" +
                      (f"\n{level.speedup_sampled:.3f}x sampled, {paid(False)}" if level.speedup_sampled else ""))
        table.add_row(f"{quality_name(level.quality)}{' *' if level.quality == default else ''}", _exits_cell(level),
                      interval, f"{level.exit_rate:.3f}", f"{level.head_free_rate:.3f}", speed, identical)
    promise = ("a lossy level q: at each step of a reply, the token it emits is the one the full model would pick on"
               " the same text, in at least q of the steps (q is at most the low end of the held-out agreement's 95%"
               " interval, bootstrapped over prompts); whole answers still drift after a first difference (identical)")
    exact = ("; exact: exits and prompt lookup draft, the full model verifies them in batches; its speed was measured"
             " against plain decoding on the calibrating machine, but whether a round drafts, and how many, is"
             " decided at run time from what steps, batches and acceptance cost on the machine it runs on (the"
             " controller); the lossy levels' speed is predicted from measured costs")
    table.caption = promise + (exact if any(lv.exact for lv in pack.levels) else "")
    return table


def _exits_cell(level: QualityLevel) -> str:
    """What the engine does at this level: a lossy level's exits, or exact mode's drafts. Exact mode drafts by prompt
    lookup (up to ROUND_MAX_DRAFTS a round), and by exits where the level turns layers on (up to the level's
    max_draft), in the rounds its controller prices below a plain step on the running machine, whatever calibration
    measured (greedy or sampled alike); only `--speculation always` holds lookup to max_draft too."""
    if level.off and not level.exact:
        return "none: decodes plainly"
    parts = []
    if level.exact:
        exit_drafts = "" if level.off else f", exits up to {level.max_draft:g} (stop below confidence {level.draft_stop:g})"
        parts.append(f"drafts where the controller finds it pays: prompt lookup up to {ROUND_MAX_DRAFTS} a round"
                     f"{exit_drafts} (calibrated: up to {level.max_draft:g}, accepted {level.acceptance:.2f},"
                     f" {level.tokens_per_round:.2f} tokens a batch)")
    if level.off:
        parts.append("prompt lookup alone, every exit off")
    for kind in (ExitKind.VERIFIED, ExitKind.HEAD_FREE):
        layers = [il for il in level.on_layers if level.exits[il].kind == kind]
        if layers:
            parts.append(f"{kind.label} " + ", ".join(f"{il}@{level.exits[il].threshold:.2f}" for il in layers))
    return "; ".join(parts)
