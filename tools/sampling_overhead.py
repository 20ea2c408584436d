"""The engine with early exit off against llama-cpp-python's Llama, both sampling with chat's defaults.

Decoding tokens/s including sampling, the two alternating prompt by prompt (each prompt and seed the same in
both): what the engine's own per-token work costs beyond llama.cpp's.

    .venv/bin/python tools/sampling_overhead.py MODEL.gguf [--tokens 96] [--rounds 2] [-t 2]
"""

from __future__ import annotations

import argparse
import time

from llama_cpp import Llama

from specee_edge.engine import Engine, EngineConfig, SamplingParams

PROMPTS = ("The history of the bicycle", "Write a Python function that sorts a list",
           "Once upon a time, in a small village", "Explain photosynthesis to a child")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("-t", "--threads", type=int, default=2)
    args = parser.parse_args()
    engine = Engine(args.model, config=EngineConfig(n_ctx=2048, n_threads=args.threads, early_exit=False))
    llm = Llama(model_path=args.model, n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    sampling = SamplingParams()
    totals = {"engine": [0, 0.0], "Llama": [0, 0.0]}  # tokens after the first, seconds
    for _ in range(args.rounds):
        for seed, text in enumerate(PROMPTS):
            prompt = engine.tokenize(text)
            engine.reset()
            stream = engine.stream(prompt, max_tokens=args.tokens, sampling=SamplingParams(seed=seed))
            next(stream)  # the prompt pass
            start, n = time.perf_counter(), sum(1 for _ in stream)
            totals["engine"][0] += n
            totals["engine"][1] += time.perf_counter() - start
            llm.reset()
            llm.set_seed(seed)
            tokens = llm.generate(prompt, top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p,
                                  temp=sampling.temperature, repeat_penalty=sampling.repeat_penalty)
            next(tokens)
            start, n = time.perf_counter(), 0
            for token in tokens:
                n += 1
                if n >= args.tokens - 1 or engine.model.is_eog(token):
                    break
            totals["Llama"][0] += n
            totals["Llama"][1] += time.perf_counter() - start
    engine.close()
    llm.close()
    rate = {name: n / seconds for name, (n, seconds) in totals.items()}
    print(f"engine {rate['engine']:.1f} tok/s, Llama {rate['Llama']:.1f} tok/s, ratio {rate['engine'] / rate['Llama']:.3f}")


if __name__ == "__main__":
    main()
