"""Multi-turn decoding through rollout workers: the agent loop stays in the trainer and each policy turn is
sampled by the workers, one request per round, as TRL's and verl's agent loops do against a generation server.

A round sends every live episode's token history (its prompt, then everything sampled and inserted so far) as
one prompt of group size 1; the first round of a batch whose groups share their prompt sends each group's
prompt once with the group size instead (the workers prefill it once). The workers stop each completion at
their EOS ids, which are the episodes' end-of-turn ids (the trainer checked the workers stop where it does).

Budgets: a request has one max_completion_length, so a round asks for the largest budget left among its
episodes and cuts each episode's turn at its own; a turn cut there without an end-of-turn id is truncated, as
in the in-process decoder. One request per round rather than one per budget: the episodes of a round are
sampled together, so the round lasts as long as its longest turn either way, and a short budget only runs past
itself in the episode's last turn.

Seeds: each round's request draws its seeds from the trainer's generator, so a run reproduces, but its draws
are not those of the in-process decoder (which samples every episode from one stream, token by token). The
workers do not stream: the agent hears every turn of a round when the round's reply arrives, and the tools of
the whole round then run together on the trainer's threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import torch

from cohort.episodes.decoding import DecodedEpisodes, TurnAgent, insert_continuations, new_episodes
from cohort.rollout import RolloutBatch, SamplingParams


class TurnSampler(Protocol):
    """What samples one round of turns: RemoteGeneration's submit + collect, or a stand-in in tests."""

    def __call__(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> RolloutBatch:
        """Returns group_size completions of each prompt (group-contiguous) with their sampling log-probs, each
        ending at an EOS id or at params.max_completion_length tokens."""
        ...


def decode_episodes_remote(
    sample: TurnSampler,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    generator: torch.Generator | None,
    agent: TurnAgent,
    *,
    end_of_turn_ids: Sequence[int],
    budgets: Sequence[int] | None = None,
    group_size: int = 1,
) -> DecodedEpisodes:
    """Returns the decoded episodes of `prompts` as `decode_episodes` does (one per episode, each at most its
    budget of tokens after its prompt, sampled tokens masked True with their log-probs, inserted ones False and
    0.0), every turn sampled by `sample`; `group_size`: how many consecutive prompts form a group (the first
    round sends a group's prompt once when its episodes share it)."""
    n_rows = len(prompts)
    budget = [params.max_completion_length] * n_rows if budgets is None else list(budgets)
    if len(budget) != n_rows or min(budget, default=1) < 1:
        raise ValueError(f"decode_episodes_remote needs one budget >= 1 per prompt, got {budgets!r}")
    out = new_episodes(n_rows)
    ends = set(end_of_turn_ids)
    rows = list(range(n_rows))
    shared = (
        group_size > 1
        and n_rows % group_size == 0
        and all(list(prompts[row]) == list(prompts[row - row % group_size]) for row in rows)
    )
    while rows:
        room = [budget[row] - len(out.tokens[row]) for row in rows]
        turn_params = replace(params, max_completion_length=max(room))
        if shared:  # first round: each group's prompt once, its episodes sampled as the group
            batch = sample(
                [list(prompts[g]) for g in range(0, n_rows, group_size)], group_size, turn_params, generator
            )
            shared = False
        else:
            batch = sample([list(prompts[row]) + out.tokens[row] for row in rows], 1, turn_params, generator)
        if len(batch.completion_ids) != len(rows) or batch.sampling_logprobs is None:
            raise RuntimeError(
                f"the turn sampler answered {len(batch.completion_ids)} completions for {len(rows)} episodes "
                "(or no sampling log-probs): a worker of another protocol?"
            )
        live = []
        for i, row in enumerate(rows):
            turn = list(batch.completion_ids[i][: room[i]])
            out.tokens[row] += turn
            out.masks[row] += [True] * len(turn)
            out.logprobs[row] += batch.sampling_logprobs[i][: len(turn)].tolist()
            out.turns[row] += 1
            # Cut at its own budget, or stopped by the workers short of one (which they never do): over.
            truncated = not turn or turn[-1] not in ends
            out.truncated[row] = truncated
            if agent.turn_ended(row, turn, truncated=truncated) and not truncated:
                live.append(row)
        blocks = insert_continuations(agent, live, out, budget)
        rows = [row for row in live if row in blocks]
    return out
