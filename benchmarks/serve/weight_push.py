"""Cost of a weight push to one rollout worker, per parameter: cohort.serve.weights between two processes on this
machine (gloo over 127.0.0.1), for models of several sizes.

Measures, on the trainer's side, flatten (the tensors of each dtype laid end to end) + broadcast + wait, and on
the worker's side receive + apply (copy into its model); prints one JSON line per size.

    python benchmarks/serve/weight_push.py [--sizes 1e6 1e7 5e7] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp

from cohort.serve import weights


def model_of(n_params: int) -> torch.nn.Module:
    """Returns a stack of 1024-wide Linear layers with about n_params parameters (float32)."""
    width = 1024
    layers = max(1, round(n_params / (width * width + width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def worker(port: int, n_params: int, repeats: int, threads: int, results) -> None:
    torch.set_num_threads(threads)
    model = model_of(n_params)
    store = weights.join_store("127.0.0.1", port, 60)
    channel = weights.Channel(store, "bench/", 1, "127.0.0.1", 60)
    spec, _ = weights.flatten(weights.push_tensors(model, full=True))
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        buffers = weights.empty_buffers(spec)
        channel.wait(channel.broadcast(buffers))
        weights.apply(model, spec, buffers)
        times.append(time.perf_counter() - t0)
    results.put(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 5e7])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ctx = mp.get_context("spawn")
    for size in args.sizes:
        model = model_of(int(size))
        n = sum(p.numel() for p in model.parameters())
        store = weights.host_store("127.0.0.1", 60)
        results = ctx.Queue()
        proc = ctx.Process(target=worker, args=(store.port, int(size), args.repeats, args.threads, results))
        proc.start()
        channel = weights.Channel(store, "bench/", 0, "127.0.0.1", 60)
        times = []
        for _ in range(args.repeats + 1):  # the first push warms the pair's buffers up
            t0 = time.perf_counter()
            _, buffers = weights.flatten(weights.push_tensors(model, full=True))
            channel.wait(channel.broadcast(buffers))
            times.append(time.perf_counter() - t0)
        received = results.get(timeout=600)
        proc.join(60)
        median = statistics.median(times[1:])
        print(
            json.dumps(
                {
                    "params": n,
                    "mib": round(n * 4 / 2**20, 1),
                    "push_s_median": round(median, 4),
                    "ns_per_param": round(median / n * 1e9, 2),
                    "receive_apply_s_median": round(statistics.median(received), 4),
                    "gib_per_s": round(n * 4 / 2**30 / median, 2),
                    "threads": args.threads,
                    "host": socket.gethostname(),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
