"""The advantage stage: the estimator over the rows the gather collects, the loss filters, process rewards."""

from __future__ import annotations

import torch

from cohort.algo import group_advantages
from cohort.config import AlgoConfig
from cohort.rollout import RolloutBatch
from cohort.train.advantage_step import advantage_batch, own_rows


def _rollout(lengths: list[int], truncated: list[bool], G: int = 2) -> RolloutBatch:
    return RolloutBatch(
        prompt_ids=[[1]] * (len(lengths) // G),
        completion_ids=[[3] * n for n in lengths],
        truncated=torch.tensor(truncated),
        group_size=G,
    )


def test_grpo_advantages_and_filters_match_the_formula():
    reward = torch.tensor([1.0, 0.0, 1.0, 1.0])
    rollout = _rollout([2, 3, 4, 5], [False, True, False, False])
    algo = AlgoConfig(filter_zero_std=True, mask_truncated=True)
    out = advantage_batch(reward[:, None], reward, reward, rollout, algo, torch.ones(1))
    torch.testing.assert_close(out.advantages, group_advantages(reward, 2, eps=algo.adv_eps))
    assert out.zero_std.tolist() == [False, False, True, True]
    assert out.in_loss.tolist() == [True, False, False, False]  # truncated row 1, all-equal group 2
    assert out.token_advantages is None


def test_the_gather_decides_which_rows_the_statistics_cover():
    # Two "processes": this one holds the first group; batch-scaled advantages use both groups' rewards.
    mine, theirs = torch.tensor([1.0, 0.0]), torch.tensor([5.0, -5.0])

    def gather(x):
        other = (
            theirs if x.dim() == 1 and x.dtype == torch.float32 else torch.tensor([2.0, 2.0], dtype=x.dtype)
        )
        return torch.cat([x, other]), 0

    algo = AlgoConfig(scale="batch")
    rollout = _rollout([2, 2], [False, False])
    alone = advantage_batch(mine[:, None], mine, mine, rollout, algo, torch.ones(1), gather=own_rows)
    together = advantage_batch(mine[:, None], mine, mine, rollout, algo, torch.ones(1), gather=gather)
    expected = group_advantages(torch.cat([mine, theirs]), 2, scale="batch", eps=algo.adv_eps)[:2]
    torch.testing.assert_close(together.advantages, expected)
    assert not torch.allclose(alone.advantages, together.advantages)


def test_a_process_reward_gives_per_token_advantages_whose_mean_is_the_row_advantage():
    per_func = torch.tensor([[0.5], [0.0]])
    rollout = _rollout([3, 2], [False, False])
    steps = [([1.0, 0.0], [0, 2]), ([0.0], [1])]  # step rewards and the token each step ends at
    out = advantage_batch(
        per_func,
        per_func[:, 0],
        per_func[:, 0],
        rollout,
        AlgoConfig(),
        torch.ones(1),
        steps=steps,
        process_column=0,
    )
    assert out.token_advantages is not None
    assert [len(t) for t in out.token_advantages] == [3, 2]
    means = torch.tensor([float(t.mean()) for t in out.token_advantages])
    torch.testing.assert_close(out.advantages, means)
    # return-to-go: a token before a later, better step carries that step's advantage too
    assert float(out.token_advantages[0][0]) > float(out.token_advantages[0][2])
