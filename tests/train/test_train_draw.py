"""Draw and refill driven by a scripted generation source: no model, the prompts decide the rewards."""

from __future__ import annotations

import warnings

import pytest
import torch

from cohort.errors import NonFiniteError
from cohort.rollout import RolloutBatch, SamplingParams
from cohort.train.curriculum import Curriculum
from cohort.train.draw import Drawer
from cohort.train.prompt_order import PromptSampler
from cohort.train.scorer import Scorer

G = 2


class ScriptedSource:
    """A GenerationSource whose completions are fixed by the prompt: prompt [k] gives completions that score
    k's pattern (`mixed` prompts give one right and one wrong completion, the others two equal ones)."""

    def __init__(self, mixed: set[int]):
        self.mixed, self.calls = mixed, []

    def generate(self, prompt_ids, group_size, params, generator, rows=None):
        self.calls.append([p[0] for p in prompt_ids])
        completions = []
        for p in prompt_ids:
            k = p[0]
            completions += [[1], [2]] if k in self.mixed else [[1], [1]]
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids],
            completion_ids=completions,
            truncated=torch.zeros(len(completions), dtype=torch.bool),
            group_size=group_size,
        )


class CharTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join("ab"[t - 1] for t in row) for row in ids]

    def decode(self, ids):
        return self.batch_decode([ids])[0]


def is_a(completions, **kw):
    return [float(c == "a") for c in completions]


def _drawer(
    n: int, mixed: set[int], *, max_rounds: int = 3, curriculum=None, warn=None
) -> tuple[Drawer, ScriptedSource]:
    rows = [{"prompt": f"p{k}"} for k in range(n)]
    source = ScriptedSource(mixed)
    scorer = Scorer(
        [is_a], ["is_a"], torch.ones(1), CharTokenizer(), prompt_column="prompt", step_separator="\n",
        loss_type="grpo", sequence_advantages=False,
    )  # fmt: skip
    drawer = Drawer(
        source, scorer, PromptSampler(n, seed=0), rows=rows, prompt_ids=[[k] for k in range(n)], group_size=G,
        params=SamplingParams(max_completion_length=4), generator=torch.Generator(), curriculum=curriculum,
        max_rounds=max_rounds, warn_once=warn or (lambda key, message: None),
    )  # fmt: skip
    return drawer, source


def test_draw_scores_the_source_rollout_and_combines_the_rewards():
    drawer, source = _drawer(8, mixed={0, 1, 2, 3})
    drawn = drawer.draw(4, step=1)
    assert len(source.calls) == 1 and len(drawn.idx) == 4
    expected = [[1.0, 0.0] if k in {0, 1, 2, 3} else [1.0, 1.0] for k in drawn.idx]
    assert drawn.per_func[:, 0].view(-1, G).tolist() == expected
    assert torch.equal(drawn.reward, drawn.per_func[:, 0])
    assert drawn.metrics() == {}  # a plain draw has no dynamic-sampling metrics


def test_refill_replaces_all_equal_groups_with_informative_ones_from_new_rounds():
    drawer, source = _drawer(16, mixed=set(range(0, 16, 2)))  # half the prompts teach something
    first = drawer.draw(4, step=1)
    informative_first = sum(1 for k in first.idx if k % 2 == 0)
    assert informative_first < 4, "the seed must leave some all-equal groups in the first round"
    drawn = drawer.refill(first, 4, step=1)
    assert len(drawn.idx) == 4 and all(k % 2 == 0 for k in drawn.idx)
    assert drawn.rounds == len(source.calls) > 1
    assert drawn.groups_kept == 4 and drawn.groups_generated == sum(len(c) for c in source.calls)
    # a round asks for the missing groups over the share of informative ones seen, a full batch at most
    assert all(len(c) <= 4 for c in source.calls[1:])
    assert drawn.completion_tokens == sum(len(c) for c in source.calls) * G
    rows = drawn.per_func[:, 0].view(-1, G)
    assert all(r.tolist() == [1.0, 0.0] for r in rows)


def test_refill_without_any_informative_group_trains_on_the_first_round_and_says_so():
    said = []
    drawer, source = _drawer(8, mixed=set(), max_rounds=3, warn=lambda key, message: said.append(key))
    first = drawer.draw(4, step=1)
    drawn = drawer.refill(first, 4, step=1)
    assert drawn.idx == first.idx and drawn.rounds == 3 and len(source.calls) == 3
    assert said == ["refill-empty"] and drawn.groups_kept == 0


def test_draw_passes_over_prompts_the_curriculum_set_aside():
    # 6 prompts, two draws of 4: the second crosses into a new epoch, which repeats some of the first draw's
    # prompts unless the curriculum set them aside (solved: every completion scores 1).
    seen = []
    for curriculum in (None, Curriculum(6, pass_threshold=0.5, min_samplings=1, retry_after=100)):
        drawer, _ = _drawer(6, mixed=set(), curriculum=curriculum)
        first = drawer.draw(4, step=1)
        later = drawer.draw(4, step=2)
        seen.append(set(first.idx) & set(later.idx))
    assert seen[0], "without a curriculum the new epoch repeats prompts"
    assert not seen[1]


def test_a_non_finite_sampling_error_names_the_step():
    drawer, _ = _drawer(4, mixed=set())

    def broken(*a, **k):
        raise NonFiniteError("the policy produced non-finite logits while sampling")

    drawer.source.generate = broken  # type: ignore[method-assign]
    with warnings.catch_warnings(), pytest.raises(NonFiniteError, match="^step 7: the policy produced"):
        drawer.draw(2, step=7)
