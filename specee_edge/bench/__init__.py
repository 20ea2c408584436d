"""`specee-edge bench`: SpecEE against vanilla llama.cpp on the same prompts, the oracle bound, quality."""

from specee_edge.bench.report import BenchResult, ModeResult, plot_bench
from specee_edge.bench.run import BenchConfig, Reporter, run_bench

__all__ = ["BenchConfig", "BenchResult", "ModeResult", "Reporter", "plot_bench", "run_bench"]
