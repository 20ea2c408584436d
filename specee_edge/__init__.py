"""specee-edge: speculative early exiting (SpecEE) for llama.cpp models on PCs and laptops."""

from specee_edge.libstdcxx import load_libstdcxx_first

__version__ = "0.1.0"

load_libstdcxx_first()
