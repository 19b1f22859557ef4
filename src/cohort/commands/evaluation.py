"""Held-out evaluation: greedy accuracy, and pass@k / maj@k with sampling, scored by a reward function.

A completion counts as correct when the reward function gives it a reward >= `threshold` (1.0 for the
built-in accuracy reward). maj@k takes, per prompt, the most common final answer among k samples
(answers extracted as the accuracy reward does) and scores that one.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from cohort.data import as_completions
from cohort.models import input_device, text_config
from cohort.rewards import extract_answer, score
from cohort.rollout import RolloutEngine, SamplingParams


def fit_completion_length(
    model: torch.nn.Module,
    prompt_ids: list[list[int]],
    max_new: int,
    *,
    flag: str = "--max-completion-length",
) -> int:
    """Returns `max_new`, lowered (with a note) so that every prompt plus its completion fits the model's
    context; raises ValueError naming the first prompt that leaves no room at all."""
    context = getattr(text_config(model), "max_position_embeddings", None)
    longest = max((len(ids) for ids in prompt_ids), default=0)
    if not isinstance(context, int) or context <= 0 or longest + max_new <= context:
        return max_new
    full = [i for i, ids in enumerate(prompt_ids) if len(ids) >= context]
    if full:
        first = full[0]
        # the rows before the first long one fit: --n keeps just those, when there are any
        keep = f", or pass --n {first} to keep the rows before it" if first > 0 else ""
        raise ValueError(
            f"row {first} of the data is a prompt of {len(prompt_ids[first])} tokens, which fills the model's "
            f"context of {context} tokens (max_position_embeddings) and leaves no room for a completion "
            f"({len(full)} of {len(prompt_ids)} prompts do, the longest {longest} tokens): shorten those prompts "
            f"or leave them out of the data{keep}"
        )
    # Positions past the context were never trained: completions there would be scored as if they meant something.
    print(
        f"note: {flag} lowered from {max_new} to {context - longest}: the longest prompt "
        f"({longest} tokens) leaves no more room in the model's context of {context} tokens",
        file=sys.stderr,
    )
    return context - longest


def evaluate(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: list[dict],
    reward_func: Callable,
    *,
    prompt_ids: list[list[int]],
    engine: RolloutEngine,
    max_completion_length: int,
    prompt_column: str = "prompt",
    k: int = 1,
    temperature: float = 1.0,
    batch_prompts: int = 64,
    threshold: float = 1.0,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """Return {"accuracy": greedy accuracy, "pass@k", "maj@k" (k > 1), "mean_length", "n"} on `rows`."""
    if not rows:
        raise ValueError("evaluation needs at least one held-out row; the held-out set is empty")
    was_training = model.training
    model.eval()
    out: dict[str, float] = {"n": float(len(rows))}
    greedy = _generate_and_score(
        model,
        tokenizer,
        rows,
        reward_func,
        prompt_ids,
        engine,
        prompt_column,
        batch_prompts,
        1,
        SamplingParams(max_completion_length=max_completion_length, greedy=True),
        generator,
    )
    out["accuracy"] = sum(r[0] >= threshold for r, _, _ in greedy) / len(rows)
    out["mean_length"] = sum(lengths[0] for _, _, lengths in greedy) / len(rows)
    if k > 1:
        sampled = _generate_and_score(
            model,
            tokenizer,
            rows,
            reward_func,
            prompt_ids,
            engine,
            prompt_column,
            batch_prompts,
            k,
            SamplingParams(max_completion_length=max_completion_length, temperature=temperature),
            generator,
        )
        out[f"pass@{k}"] = sum(any(x >= threshold for x in r) for r, _, _ in sampled) / len(rows)
        maj = 0
        for rewards, texts, _ in sampled:
            answers = [extract_answer(t) for t in texts]
            counts = Counter(a for a in answers if a is not None)
            if counts:
                top = counts.most_common(1)[0][0]
                maj += rewards[answers.index(top)] >= threshold
        out[f"maj@{k}"] = maj / len(rows)
    model.train(was_training)
    return out


@torch.inference_mode()
def _generate_and_score(
    model,
    tokenizer,
    rows,
    reward_func,
    prompt_ids,
    engine,
    prompt_column,
    batch_prompts,
    k,
    params,
    generator,
):
    """Return per prompt (rewards of its k completions, their texts, their lengths)."""
    results = []
    for start in range(0, len(rows), batch_prompts):
        chunk = rows[start : start + batch_prompts]
        rollout = engine.generate(model, prompt_ids[start : start + batch_prompts], k, params, generator)
        texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        completions = as_completions(texts, chunk[0][prompt_column])
        columns = {c: [r[c] for r in chunk for _ in range(k)] for c in chunk[0] if c != prompt_column}
        # Scored outside the caller's autocast (held-out evaluation samples under the trainer's): a learned reward
        # model computes in its own dtype, as when it scores training rollouts.
        with torch.autocast(input_device(model).type, enabled=False):
            scores = score(
                [reward_func],
                prompts=[r[prompt_column] for r in chunk for _ in range(k)],
                completions=completions,
                completion_ids=rollout.completion_ids,
                columns=columns,
            )[:, 0]  # [n·k]
        rewards = torch.nan_to_num(scores, nan=0.0).tolist()
        lengths = rollout.loss_lengths.tolist()
        for i in range(len(chunk)):
            sl = slice(i * k, (i + 1) * k)
            results.append((rewards[sl], texts[sl], lengths[sl]))
    return results
