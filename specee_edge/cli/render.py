"""What chat and generate show: the footer line, the /stats table, exit-depth colours, /show info."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from specee_edge.engine import Engine, GenerationStats, SamplingParams, TokenRecord
from specee_edge.engine.exit import ExitPolicy
from specee_edge.exits import ExitKind, depth_band, depth_bands
from specee_edge.pack.format import IDENTICAL_FLOOR, LayerExit, quality_name

# Exit-depth colours, shallow to deep: (share of the last layer index reached, style).
DEPTH_STYLES: tuple[str, ...] = ("bold green", "cyan", "yellow", "magenta")  # one per band of exits.DEPTH_BAND_SHARES


def exit_setting(engine: Engine) -> str | None:
    """The quality level in use and a threshold overriding its thresholds (`quality 0.99, threshold 0.5`);
    None without a pack."""
    policy = engine.policy
    if policy is None:
        return None
    parts = [f"quality {quality_name(policy.quality)}"] if policy.quality is not None else []
    if policy.threshold is not None:
        parts.append(f"threshold {policy.threshold:g}")
    return ", ".join(parts) or None


def level_warning(engine: Engine) -> str | None:
    """One line when the level in use was measured to change whole answers: fewer than IDENTICAL_FLOOR of
    its held-out greedy answers (to code prompts, where there were some) came out identical to the full
    model's; or when the engine runs another KV mode than the one its figures were measured in; or, at any
    level, when the layers run where the pack's costs were not measured (Engine.placement_note)."""
    notes = [note] if engine.early_exit and (note := engine.placement_note()) else []
    policy = engine.policy
    level = policy.level if policy and engine.early_exit and policy.threshold is None else None
    if level is None or level.off or level.exact:  # exact mode keeps the full model's answers
        return "; ".join(notes) or None
    whole = level.whole_answers
    if 0 <= whole < IDENTICAL_FLOOR:
        what = "code answers" if level.identical_code >= 0 else "answers"
        notes.append(f"quality {level.quality:g} keeps {whole:.0%} of greedy {what} identical to the full model's"
                     f" (token agreement {level.agreement:.3f}); a higher --quality keeps more")
    measured = policy.pack.provenance.get("kv_mode")
    if measured and engine.kv_mode != measured:
        notes.append(f"its figures were measured with --kv-mode {measured}, not {engine.kv_mode}")
    return "; ".join(notes) or None


def footer(stats: GenerationStats, setting: str | None = None) -> str:
    """One line after each reply: prompt t/s, generation t/s; in exact mode what its controller chose, else the
    avg exit layer and exit %; and the exit setting."""
    parts = [f"prompt {stats.prompt_tok_s:.1f} t/s", f"generation {stats.decode_tok_s:.1f} t/s"]
    if stats.exact:
        parts.append(exact_choices(stats))
        if stats.rounds:  # drafts the full model accepted, tokens per verification batch
            parts += [f"accepted {stats.acceptance_rate:.0%}", f"{stats.tokens_per_round:.1f} tokens/round"]
    elif stats.early_exit:
        parts += [f"avg exit layer {stats.avg_exit_layer:.1f}/{stats.n_layer - 1}", f"exit {stats.exit_rate:.0%}"]
    else:
        parts.append("early exit off")
    if setting and (stats.exact or stats.early_exit):
        parts.append(setting)
    return "[ " + " | ".join(parts) + " ]"


def exact_choices(stats: GenerationStats) -> str:
    """Exact mode's choices in one phrase: the share of tokens from plain steps and from each kind of round."""
    shares = stats.choice_shares()
    cells = [f"{name} {shares[name]:.0%}" for name in ("plain", "lookup", "exit") if shares[name] or name == "plain"]
    drafts = f", {stats.mean_drafts:.1f} drafts/batch" if stats.rounds else ""
    return "exact: " + " · ".join(cells) + drafts


def exit_histogram(stats: GenerationStats) -> str:
    counts = Counter("full" if layer is None else layer for layer in stats.exit_layers)
    layers = sorted(k for k in counts if k != "full")
    cells = [f"{layer}×{counts[layer]}" for layer in layers] + ([f"full×{counts['full']}"] if "full" in counts else [])
    return " ".join(cells) or "-"


def by_rows(batch_ms: dict[int, float]) -> str:
    """Batch costs by row count: "2: 14.10, 4: 17.30" ("-" where none was measured)."""
    return ", ".join(f"{rows}: {ms:.2f}" for rows, ms in batch_ms.items()) or "-"


def stats_table(stats: GenerationStats) -> Table:
    """/stats and --verbose: the last reply in detail (SPEC.md §5 names)."""
    s = stats.summary()
    rows = [
        ("tokens", f"{s['n_prompt']} prompt, {s['n_decode']} decoded"),
        ("prompt", f"{s['prompt_tok_s']:.1f} t/s ({s['prompt_s'] * 1e3:.0f} ms)"),
        ("generation", f"{s['decode_tok_s']:.1f} t/s ({s['decode_s'] * 1e3:.0f} ms for {s['n_decode']} tokens)"),
        ("finish_reason", s["finish_reason"] or "-"),
        ("early exit", "on" if s["early_exit"] else "off"),
    ]
    if s["early_exit"]:
        rows += [
            ("avg_exit_layer", f"{s['avg_exit_layer']:.2f} (0-based; {stats.n_layer - 1} = every layer)"),
            ("exit_rate", f"{s['exit_rate']:.1%} ({s['exits']} of {s['n_decode']})"),
            ("predictor_calls_per_token", f"{s['predictor_calls_per_token']:.2f}"),
            ("verify_fail_rate", f"{s['verify_fail_rate']:.1%} ({s['verify_failures']} of {s['positives']} positives)"),
            ("draft_recall@k", f"{s['draft_recall_at_k']:.1%}"),
            ("exit layers", exit_histogram(stats)),
        ]
    if s["exact"]:
        c = s["controller"]
        rows += [
            ("exact mode", exact_choices(stats) + f"; {s['explore_rounds']} explorations"
                           f" ({s['explore_ms']:+.1f} ms beyond the choices they displaced)"),
            ("measured here", f"plain step {c.get('plain_ms') or 0:.2f} ms (+{c.get('regraph_ms') or 0:.2f} after a batch);"
                              f" lookup batch by rows {by_rows(c.get('batch_ms', {}))};"
                              f" exit batch by rows {by_rows(c.get('exit_batch_ms', {}))}"),
        ]
    if s["rounds"]:
        rows += [
            ("acceptance_rate", f"{s['acceptance_rate']:.1%} ({s['accepted']} of {s['drafts']} drafts)"),
            ("tokens_per_round", f"{s['tokens_per_round']:.2f} ({s['rounds']} verification batches)"),
        ]
    rows.append(("ms per token", ", ".join(f"{k} {v:.2f}" for k, v in s["ms_per_token"].items())))
    return _kv_table("last reply", rows)


def depth_style(exit_layer: int | None, n_layer: int) -> str:
    """The colour of a token that left after `exit_layer` (None: it ran every layer, plain)."""
    return "" if exit_layer is None else DEPTH_STYLES[depth_band(exit_layer, n_layer)]


def depth_legend(n_layer: int) -> Text:
    """The layer range of each colour, e.g. `exit depth: 0-14 15-19 20-24 25-28 full`."""
    legend = Text("exit depth: ")
    for low, high, band in depth_bands(n_layer):
        legend.append(f"{low}-{high}" if high > low else f"{low}", style=DEPTH_STYLES[band])
        legend.append(" ")
    legend.append(f"full ({n_layer - 1})")
    return legend


@dataclass
class TokenPrinter:
    """Streams a reply's pieces to a rich console; with colours, each piece in its exit depth's style."""

    console: Console
    n_layer: int
    color_exits: bool = False

    def __call__(self, record: TokenRecord) -> None:
        if not record.text:
            return
        style = depth_style(record.exit_layer, self.n_layer) if self.color_exits else ""
        self.console.print(Text(record.text, style=style), end="", soft_wrap=True, highlight=False)


def engine_info(engine: Engine, sampling: SamplingParams, max_tokens: int, system: str | None) -> Group:
    """/show info: model, pack, schedule, engine settings and sampling."""
    info = engine.model.info
    rows = [
        ("model", f"{info.path.name} ({info.arch}, {info.n_layer} layers, n_embd {info.n_embd}, vocab {info.n_vocab})"),
        ("model path", str(info.path)),
    ]
    policy = engine.policy
    if policy is None:  # exact mode still drafts, by prompt lookup, unless SpecEE is off
        rows.append(("pack", "none: exact mode with prompt-lookup drafts, no exits" if engine.exact else
                             "none: plain decoding"))
    else:
        pack = policy.pack
        rows += [
            ("pack", str(policy.pack_path)),
            ("candidates (k)", str(pack.k)),
            ("quality", _quality_text(policy)),
            ("predictor layers", ", ".join(map(str, sorted(pack.predictors))) or "none"),
            ("offline schedule", ", ".join(map(str, sorted(policy.schedule.offline))) or "none"),
            ("online schedule", f"offsets {pack.schedule.offsets} around each of the last {pack.schedule.window} exits"),
            ("exits", _exits_text(policy.exits)),
        ]
        provenance = pack.provenance
        if provenance:
            labels = {"created": "pack created", "command": "made with", "predictor": "predictors", "draft": "draft"}
            rows += [(label, str(provenance[key])) for key, label in labels.items() if key in provenance]
    config = engine.config
    rows += [
        ("early exit", ("on" if engine.early_exit else "off") + f", kv mode {engine.kv_mode}"),
        ("context", f"{engine.ctx.n_ctx} tokens, {engine.ctx.n_past} in use; {config.n_threads} threads"),
        ("placement", engine.model.placement_text()),
        ("sampling", f"temp {sampling.temperature:g}, top_k {sampling.top_k}, top_p {sampling.top_p:g}, min_p {sampling.min_p:g}, "
                     f"repeat_penalty {sampling.repeat_penalty:g}, seed {'random' if sampling.seed is None else sampling.seed}, "
                     f"n_predict {max_tokens}"),
        ("system prompt", system if system is not None else "(the chat template's default)"),
    ]
    return Group(_kv_table("info", rows))


def _quality_text(policy: ExitPolicy) -> str:
    levels = policy.pack.levels
    if policy.quality is None:
        return "none (the pack has no quality levels)"
    default = " (the pack's default)" if policy.quality == policy.pack.level().quality else ""
    return f"{quality_name(policy.quality)}{default}; the pack offers {', '.join(quality_name(lv.quality) for lv in levels)}"


def _exits_text(exits: dict[int, LayerExit]) -> str:
    """`verified 20, 22 (0.9 to 0.95); head-free 29 (0.8)`, or what the level turns off."""
    if not exits:
        return "none (no predictors)"
    parts = []
    for kind in (ExitKind.VERIFIED, ExitKind.HEAD_FREE):
        layers = sorted(il for il, e in exits.items() if e.kind == kind)
        if layers:
            thresholds = sorted({exits[il].threshold for il in layers})
            span = f"{thresholds[0]:g}" if len(thresholds) == 1 else f"{thresholds[0]:g} to {thresholds[-1]:g}"
            parts.append(f"{kind.label} {', '.join(map(str, layers))} ({span})")
    return "; ".join(parts) or "every layer off"


def _kv_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left", box=None, padding=(0, 2, 0, 0))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, value)
    return table
