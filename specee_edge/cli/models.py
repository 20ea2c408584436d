"""`specee-edge models`: the model GGUFs on this machine, in specee-edge's cache and other tools' stores."""

from __future__ import annotations

from rich.measure import Measurement
from rich.table import Column, Table

from specee_edge.cli.app import app, console
from specee_edge.errors import ModelLoadError


@app.command()
def models() -> None:
    """List the model GGUFs found (specee-edge's cache, the Hugging Face cache, llama.cpp's, Ollama's and LM
    Studio's stores): the name that loads each (`specee-edge chat NAME`), its architecture, size, whether
    early exit supports it, and its pack."""
    from specee_edge.archs import ARCHS
    from specee_edge.gguf_index import GGUFIndex
    from specee_edge.pack.locate import find_pack, pack_origin
    from specee_edge.stores import split_size, stored_models

    found = stored_models()
    if not found:
        console.print("no model GGUFs found: `specee-edge pull NAME`, or -hf USER/REPO[:QUANT] on chat, fetch one")
        return
    rows = []
    for model in found:
        try:
            arch = str(GGUFIndex(model.path).value("general.architecture"))
        except ModelLoadError:
            rows.append((model.name, model.store, "unreadable", _size(model.path.stat().st_size), "-", "-"))
            continue
        pack = find_pack(model.path)
        rows.append((model.name, model.store, arch, _size(split_size(model.path)), "yes" if arch in ARCHS else "no",
                     "-" if pack is None else pack_origin(pack, model.path)))
    table = Table(Column("name", no_wrap=True), "store", "arch", "size", "early exit", "pack", show_edge=False)
    for row in rows:
        table.add_row(*row)
    if Measurement.get(console, console.options.update_width(10**6), table).maximum <= console.width:
        console.print(table)
        return
    for name, store, arch, size, early_exit, pack in rows:  # too narrow: each name whole on its line, the rest below
        console.print(name, style="bold", highlight=False, soft_wrap=True)
        console.print(f"  {store} · {arch} · {size} · early exit {early_exit} · pack {pack}", highlight=False)


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.0f} MB"
