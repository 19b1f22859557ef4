"""Benchmark prompts and rewards, shared by both frameworks.

Prompts: the demo's addition task (cohort's built-in, short prompts) and a GSM8K-shaped synthetic word
problem of 100-150 characters (= tokens: the tiny tokenizer is one token per character).

Reward for the throughput workloads: `token_parity`, the fraction of even token ids in a completion. An
untrained model never answers correctly, so the accuracy reward would be 0 everywhere, every group
would have zero variance, and at beta = 0 cohort would (rightly) skip the whole update: the benchmark
would measure generation only. `token_parity` varies inside every group, so every row carries a
non-zero advantage and both trainers do the full update (the worst case for cohort's skipping lever).
The time-to-accuracy benchmark uses the real accuracy reward.
"""

from __future__ import annotations

import random

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jon", "Kira", "Liam"]
ITEMS = ["apple", "marble", "ticket", "stamp", "cookie", "pencil", "sticker", "shell", "coin", "book"]
PLACES = ["market", "school fair", "library", "park", "bakery", "museum shop"]


def token_parity(completions, completion_ids, **kwargs) -> list[float]:
    """Return, per completion, the fraction of its token ids that are even (a dense, varied reward)."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def gsm8k_like_rows(n: int, *, seed: int, min_chars: int = 100, max_chars: int = 150) -> list[dict]:
    """Return n rows {"prompt", "answer"}: word problems whose prompt is min_chars..max_chars characters."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        name, friend = rng.sample(NAMES, 2)
        item, place = rng.choice(ITEMS), rng.choice(PLACES)
        a, b, c, d = rng.randint(5, 60), rng.randint(2, 30), rng.randint(1, 5), rng.randint(2, 9)
        prompt = f"Q: {name} has {a} {item}s, buys {b} more and gives {c} to {friend}. How many are left?"
        filler = [
            f" At the {place} each {item} sells for {d} dollars.",
            f" {friend} watches.",
            " It is sunny.",
            " Think step by step.",
            " Show the work.",
        ]
        rng.shuffle(filler)
        target = rng.randint(min_chars, max_chars)
        for extra in filler:
            if len(prompt) + 3 >= target:
                break
            if len(prompt) + len(extra) + 3 <= max_chars:
                prompt += extra
        prompt += "\nA:"
        if not min_chars <= len(prompt) <= max_chars:
            continue
        rows.append({"prompt": prompt, "answer": str(a + b - c)})
    return rows


def addition_rows(n: int, *, seed: int) -> list[dict]:
    """Return n rows of cohort's built-in addition task (the demo's prompts)."""
    from cohort.data import make_task

    train, _ = make_task("addition", n_train=n, n_eval=1, seed=seed)
    return [{"prompt": r["prompt"], "answer": r["answer"]} for r in train]
