"""The FLOP floor of a GRPO step and the matmul rate it is divided by.

Floor = the FLOPs a step cannot avoid once every lever is pulled (each group's prompt computed once,
no padding, no reference pass at beta = 0, no pi_old pass at mu = 1, no vocabulary-sized tensors
beyond the LM head's own matmul), divided by the machine's measured matmul rate on the model's shapes.

For one group with prompt length P and completion lengths c_1..c_G, the tokens that must be fed
through the model are the prompt once plus every completion token except the last (nothing is
predicted from the last one): n_in = P + sum_i (c_i - 1). One forward costs

    2 * P_ne * n_in                        (every weight matrix of the layers, once per input token)
  + 2 * h * V * sum_i c_i                  (the LM head, only where a completion token is predicted)
  + 4 * h * n_layers * sum(context sizes)  (attention scores and weighted values: QK^T and AV; a
                                            prompt token at position t sees t keys, completion token
                                            j of row i sees P + j keys)

with P_ne the non-embedding parameters (tied embeddings: the LM head is counted in the second line).
A step does generation (one forward over those tokens, the KV cache making it the same count),
the policy forward and backward (backward = 2 x forward) and, when beta > 0, a reference forward:

    floor_flops = (1 + 3 + [beta > 0]) * forward.
"""

from __future__ import annotations

import time

import torch

from cohort.fastpath.packed_linear import packed_linears


def forward_flops(
    meta: dict, prompt_lengths: list[int], completion_lengths: list[int], group_size: int
) -> dict:
    """Return {"linear", "lm_head", "attention", "total"} FLOPs of one forward over the floor's tokens."""
    h, V, L, P_ne = (
        meta["hidden_size"],
        meta["vocab_size"],
        meta["num_layers"],
        meta["parameters_nonembedding"],
    )
    linear = lm_head = attention = 0
    for g, P in enumerate(prompt_lengths):
        comps = completion_lengths[g * group_size : (g + 1) * group_size]
        n_in = P + sum(max(c - 1, 0) for c in comps)
        linear += 2 * P_ne * n_in
        lm_head += 2 * h * V * sum(comps)
        ctx = P * (P + 1) // 2 + sum((c - 1) * P + (c - 1) * c // 2 for c in comps if c > 1)
        attention += 4 * h * L * ctx
    return {
        "linear": linear,
        "lm_head": lm_head,
        "attention": attention,
        "total": linear + lm_head + attention,
    }


def step_floor_flops(meta: dict, prompt_lengths, completion_lengths, group_size: int, beta: float) -> float:
    """Return the FLOPs one GRPO step must do (generation + forward + backward [+ reference forward])."""
    fwd = forward_flops(meta, prompt_lengths, completion_lengths, group_size)["total"]
    return (4 + (1 if beta > 0 else 0)) * fwd


DECODE_ROWS = (32, 128)
"""Row counts at which the layer matmuls are also timed: one decode step multiplies only as many rows
as there are live sequences (32 in workloads (b) and (c), 128 in (a)), and small-M matmuls run far
below the large-M rate on a CPU."""


def matmul_rate(meta: dict, *, tokens: int = 2048, repeats: int = 5, threads: int | None = None) -> dict:
    """Return the measured float32 matmul rate (GFLOP/s) on this model's layer and LM-head shapes.

    One timed round runs the matmuls of one layer's forward for `tokens` tokens (q, k, v, o, gate,
    up, down) and the LM head for tokens/8 rows (it dominates only for large vocabularies); the rate is
    the best of `repeats` rounds, so the floor is as low (strict) as the machine allows.
    """
    if threads:
        torch.set_num_threads(threads)
    h, inter, V = meta["hidden_size"], meta["intermediate_size"], meta["vocab_size"]
    kv = meta.get("kv_size", h)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, h, generator=g)
    xi = torch.randn(tokens, inter, generator=g)
    w = {
        "qo": torch.randn(h, h, generator=g),
        "kv": torch.randn(h, kv, generator=g),
        "up": torch.randn(h, inter, generator=g),
        "down": torch.randn(inter, h, generator=g),
        "head": torch.randn(h, V, generator=g),
    }
    head_rows = max(tokens // 8, 1)
    xh = x[:head_rows]
    layer_flops = 2 * tokens * (2 * h * h + 2 * h * kv + 3 * h * inter)
    head_flops = 2 * head_rows * h * V

    def layer(xr: torch.Tensor, xir: torch.Tensor) -> None:
        xr @ w["qo"]
        xr @ w["qo"]
        xr @ w["kv"]
        xr @ w["kv"]
        xr @ w["up"]
        xr @ w["up"]
        xir @ w["down"]

    def one_round() -> tuple[float, float]:
        t0 = time.perf_counter()
        for _ in range(2):
            layer(x, xi)
        t1 = time.perf_counter()
        xh @ w["head"]
        t2 = time.perf_counter()
        return (t1 - t0) / 2, t2 - t1

    def decode_round(rows: int, inner: int, step=layer) -> float:
        xr, xir = x[:rows], xi[:rows]
        t0 = time.perf_counter()
        for _ in range(inner):
            step(xr, xir)
        return (time.perf_counter() - t0) / inner

    # The same weights as nn.Linear layers, for cohort's packed decoding (cohort.fastpath.packed_linear).
    linears = torch.nn.ModuleDict()
    for name in ("qo", "kv", "up", "down"):
        linears[name] = torch.nn.Linear(w[name].shape[0], w[name].shape[1], bias=False)
        with torch.no_grad():
            linears[name].weight.copy_(w[name].t())  # [out, in]: linear(x) == x @ w[name]

    def packed_step(xr: torch.Tensor, xir: torch.Tensor) -> None:
        # forward() directly: the packed matmul as the sampler's layers run it, without module-call overhead.
        for name in ("qo", "qo", "kv", "kv", "up", "up"):
            linears[name].forward(xr)
        linears["down"].forward(xir)

    one_round()  # warm-up
    layer_times, head_times = zip(*(one_round() for _ in range(repeats)))
    layer_rate = layer_flops / min(layer_times) / 1e9
    head_rate = head_flops / min(head_times) / 1e9
    total_rate = (layer_flops + head_flops) / (min(layer_times) + min(head_times)) / 1e9
    decode = {}
    for rows in DECODE_ROWS:
        inner = max(1, tokens // rows)  # the same FLOPs per round as one large-M round
        decode_round(rows, inner)
        best = min(decode_round(rows, inner) for _ in range(repeats))
        # The faster of MKL and oneDNN-packed weights (where this torch build packs): the strictest floor.
        with torch.no_grad(), packed_linears(linears, batch_hint=rows, min_elements=0) as packed:
            if packed:
                decode_round(rows, inner, packed_step)
                best = min(best, *(decode_round(rows, inner, packed_step) for _ in range(repeats)))
        decode[str(rows)] = 2 * rows * (2 * h * h + 2 * h * kv + 3 * h * inter) / best / 1e9
    return {
        "gflops_layer": layer_rate,
        "gflops_lm_head": head_rate,
        "gflops": total_rate,
        "gflops_layer_decode": decode,
        "tokens": tokens,
        "threads": torch.get_num_threads(),
    }


def decode_rate(rate: dict, rows: int) -> float | None:
    """Return the layer matmul rate measured at the largest DECODE_ROWS not above `rows` (None if unmeasured)."""
    got = {int(k): v for k, v in rate.get("gflops_layer_decode", {}).items()}
    fits = [r for r in got if r <= rows]
    return got[max(fits)] if fits else (got[min(got)] if got else None)


def floor_seconds(
    meta: dict, rate: dict, prompt_lengths, completion_lengths, group_size: int, beta: float
) -> float:
    """Return the step's FLOP floor in seconds: the layer FLOPs at the layer rate plus the LM head at its rate."""
    f = forward_flops(meta, prompt_lengths, completion_lengths, group_size)
    passes = 4 + (1 if beta > 0 else 0)
    body = (f["linear"] + f["attention"]) / (rate["gflops_layer"] * 1e9)
    head = f["lm_head"] / (rate["gflops_lm_head"] * 1e9)
    return passes * (body + head)


def decode_floor_seconds(
    meta: dict, rate: dict, prompt_lengths, completion_lengths, group_size: int, beta: float
) -> float | None:
    """Return floor_seconds with generation's completion-token matmuls at the decode-shaped rate.

    Generation feeds completion tokens one step at a time, `len(completion_lengths)` rows per step at
    most, so its layer matmuls cannot run at the large-M rate; the prompts (one prefill) and the
    training passes keep it. This is the floor a step-by-step sampler can approach on this machine.
    """
    rows_rate = decode_rate(rate, len(completion_lengths))
    if rows_rate is None:
        return None
    full = floor_seconds(meta, rate, prompt_lengths, completion_lengths, group_size, beta)
    decoded = 2 * meta["parameters_nonembedding"] * sum(max(c - 1, 0) for c in completion_lengths)
    return full + decoded / (rows_rate * 1e9) - decoded / (rate["gflops_layer"] * 1e9)
