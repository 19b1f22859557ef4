"""cohort.runtime.seeds: the named random streams keep their formulas (a resumed run draws what the older cohort would)."""

from __future__ import annotations

import torch

from cohort.runtime import seeds


def test_the_formulas_are_pinned():
    assert seeds.process(3, 1) == 4
    assert seeds.sampling(3, 1) == 3 * 7919 + 1
    assert seeds.sampling_after_resume(3, 5, 1) == 3 * 7919 + 5 * 1_000_003 + 1
    assert seeds.prompt_order(3, 2) == 2003
    assert seeds.epoch_shuffle(2003, 4) == 2003 * 100003 + 4
    assert seeds.minibatch_shuffle(3) == 3 * 104729
    assert seeds.clip_cov_draws(10, 1) == 11
    assert seeds.held_out_sampling(3, 2) == 3 * 7907 + 2
    assert seeds.logged_samples(3, 2) == 5
    assert seeds.iterative_prompts(3, 2) == 3 * 7919 + 2
    assert seeds.iterative_samples(3, 2) == 3 * 1_000_033 + 2
    assert seeds.iterative_retrain(3, 2) == 95
    assert seeds.pairs_epoch(3, 2) == 3 * 1_000_003 + 2


def test_streams_of_one_run_stay_apart():
    """Within one run (seed fixed), the per-rank and per-step streams that feed the same kind of draw differ."""
    for seed in range(4):
        ranks = [seeds.sampling(seed, r) for r in range(8)]
        after = [seeds.sampling_after_resume(seed, s, r) for s in range(1, 6) for r in range(8)]
        assert len(set(ranks + after)) == len(ranks) + len(after)
        orders = [seeds.epoch_shuffle(seeds.prompt_order(seed, r), e) for r in range(8) for e in range(20)]
        assert len(set(orders)) == len(orders)


def test_generator_and_globals_are_seeded():
    a = seeds.generator(7)
    assert a.initial_seed() == 7
    seeds.seed_globals(5)
    x = torch.rand(3)
    seeds.seed_globals(5)
    assert torch.equal(x, torch.rand(3))
