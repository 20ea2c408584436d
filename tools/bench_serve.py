"""What serving costs: tokens/s of one streaming client of `specee-edge serve` against `specee-edge generate`.

    .venv/bin/python tools/bench_serve.py [--model M] [--quality Q] [-n 128] [--rounds 5] [-t 2]

Both run the same model, pack, level, thread count and greedy prompt, in turns (generate, then one streamed
request), so that a change in machine speed hits both alike. generate's figure is its own decode rate
(`--json` stats); the client's is what it sees: tokens after the first over the time from the first
token's chunk to the last's, so the HTTP stack, JSON and SSE framing are all inside it.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

CLI = str(Path(sys.executable).with_name("specee-edge"))
PROMPT = "Write a long story about a lighthouse keeper and a storm."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate_rate(args: argparse.Namespace) -> tuple[float, int]:
    cmd = [CLI, "generate", "-p", PROMPT, "-n", str(args.n_predict), "--temp", "0", "-t", str(args.threads), "--json"]
    cmd += (["--model", args.model] if args.model else []) + (["--quality", args.quality] if args.quality else [])
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return out["stats"]["decode_tok_s"], out["stats"]["n_decode"] + 1


def client_rate(url: str, args: argparse.Namespace) -> tuple[float, int]:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.n_predict, "temperature": 0,
            "stream": True}
    if args.quality:
        body["quality"] = float(args.quality)
    lines = []  # parsed afterwards, so that the client's own work stays small while tokens arrive
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            lines.append((time.perf_counter(), line))
    arrivals = [t for t, line in lines if line.startswith("data: {") and '"exit_layer"' in line]  # a chunk per token
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]), len(arrivals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--quality", default=None)
    parser.add_argument("-n", "--n-predict", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-t", "--threads", type=int, default=2)
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [CLI, "serve", "--port", str(port), "-t", str(args.threads)]
    cmd += ([args.model] if args.model else []) + (["--quality", args.quality] if args.quality else [])
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        client_rate(url, args)  # warm-up: the server's first request pays for loading pages of the model
        rates: dict[str, list[float]] = {"generate": [], "serve (client)": []}
        tokens: dict[str, int] = {}
        with Progress(transient=True) as progress:
            task = progress.add_task("generate / serve, in turns", total=args.rounds)
            for _ in range(args.rounds):
                rate, tokens["generate"] = generate_rate(args)
                rates["generate"].append(rate)
                rate, tokens["serve (client)"] = client_rate(url, args)
                rates["serve (client)"].append(rate)
                progress.advance(task)
    finally:
        server.send_signal(2)
        server.wait(timeout=30)

    table = Table(title=f"one streaming client against generate ({args.rounds} rounds, {args.threads} threads)")
    for column in ("lane", "tokens", "tok/s (median)", "min", "max", "ratio"):
        table.add_column(column, justify="right")
    base = statistics.median(rates["generate"])
    for lane, values in rates.items():
        median = statistics.median(values)
        table.add_row(lane, str(tokens[lane]), f"{median:.1f}", f"{min(values):.1f}", f"{max(values):.1f}",
                      f"{median / base:.3f}")
    Console().print(table)


if __name__ == "__main__":
    main()
