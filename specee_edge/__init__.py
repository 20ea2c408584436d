"""specee-edge: speculative early exiting (SpecEE) for llama.cpp models on PCs and laptops."""

__version__ = "0.1.0"
