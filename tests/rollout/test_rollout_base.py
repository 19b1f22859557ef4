"""The engine interface: generate() shared by every engine around its `sample`, and completion_ends."""

from __future__ import annotations

import pytest
import torch
from _tiny import EOS, PAD, make_test_engine, random_prompts, tiny_model

from cohort.rollout.base import RolloutEngine, Sampled, SamplingParams, completion_ends


@pytest.mark.parametrize(
    ("rows", "max_len", "lengths", "truncated"),
    [
        ([[5, 6, EOS, 7], [5, 6, 7, 8]], 4, [3, 4], [False, True]),  # cut after EOS; no EOS at max_len
        ([[EOS, EOS, 3]], 3, [1], [False]),  # the first EOS ends it
        ([[5, 6]], 4, [2], [False]),  # stopped short of max_len without EOS: not truncated
        ([[5, 6, 7, EOS]], 3, [3], [True]),  # an EOS past max_len does not count
    ],
)
def test_completion_ends_cuts_after_the_first_eos_within_max_len(rows, max_len, lengths, truncated):
    got_lengths, got_truncated = completion_ends(torch.tensor(rows), [EOS, 99], max_len)
    assert got_lengths.tolist() == lengths and got_truncated.tolist() == truncated


def test_completion_ends_of_rows_without_tokens():
    lengths, truncated = completion_ends(torch.zeros(2, 0, dtype=torch.long), [EOS], 3)
    assert lengths.tolist() == [0, 0] and truncated.tolist() == [False, False]


class _Scripted(RolloutEngine):
    """Samples fixed rows and records the state generate() calls it in."""

    name = "scripted"

    def sample(self, model, prompt_ids, group_size, params, generator, device) -> Sampled:
        self.seen = {"inference": torch.is_inference_mode_enabled(), "training": model.training}
        n = len(prompt_ids) * group_size
        tokens = torch.tensor([[4, EOS, 4], [4, 4, 4]] * (n // 2), device=device)  # [N, 3]
        lengths, truncated = completion_ends(tokens, self.eos_token_ids, params.max_completion_length)
        logprobs = -torch.arange(1.0, 1.0 + tokens.numel(), device=device).view(tokens.shape)
        return Sampled(tokens, lengths, truncated, logprobs, paths={"scripted": True})


def test_an_engine_that_implements_sample_gets_generate():
    model = tiny_model(seed=1).train()
    engine = _Scripted(eos_token_ids=[EOS], pad_token_id=PAD)
    batch = engine.generate(model, [[2, 3], [5]], 2, SamplingParams(max_completion_length=3))
    assert engine.seen == {"inference": True, "training": False}  # no autograd, eval mode
    assert model.training  # restored after
    assert batch.prompt_ids == [[2, 3], [5]] and batch.group_size == 2
    assert batch.completion_ids == [[4, EOS], [4, 4, 4]] * 2
    assert batch.truncated.tolist() == [False, True] * 2
    assert [lp.tolist() for lp in batch.sampling_logprobs[:2]] == [[-1.0, -2.0], [-4.0, -5.0, -6.0]]
    assert batch.paths == {"scripted": True}
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        engine.generate(model, [[2]], 0, SamplingParams(max_completion_length=3))


@pytest.mark.parametrize("name", ["builtin", "hf", "scripted"])
def test_generated_tensors_are_ordinary_tensors(name):
    model = tiny_model(seed=2, eos_bias=0.5)
    engine = (
        _Scripted(eos_token_ids=[EOS], pad_token_id=PAD) if name == "scripted" else make_test_engine(name)
    )
    batch = engine.generate(model, random_prompts(2, seed=3), 2, SamplingParams(max_completion_length=3))
    tensors = [batch.truncated, *batch.sampling_logprobs]
    assert not any(t.is_inference() for t in tensors)
    batch.truncated[0] = True  # callers may change them in place
    assert all(t.device.type == "cpu" for t in tensors)
