"""fast.cast_once (cohort.rollout.casts): under autocast, the eager decodes (the builtin engine's eager steps,
multi-turn episodes) read each Linear's weights cast once per rollout, where autocast, which keeps no cast under
the engines' inference mode, cast every weight at every step. CPU bf16 autocast stands in for CUDA's: every
token and log-prob must be bitwise what autocast's own casts give."""

from __future__ import annotations

import pytest
import torch
from _tiny import EOS, PAD, make_test_engine, random_prompts, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from cohort.config import load_config
from cohort.episodes.decoding import decode_episodes
from cohort.fastpath import FastConfig, FastPathError
from cohort.fastpath.switches import FastPathConfigError
from cohort.rollout import SamplingParams
from cohort.rollout.casts import CastForward, cast_once

CPU = torch.device("cpu")


class WeightCasts(TorchDispatchMode):
    """Counts the casts of the given Linear weights dispatched inside the block."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.weights = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Linear)}
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # under inference mode the mode sees `to` itself, under no_grad its `_to_copy`
        if func.overloadpacket.__name__ in ("to", "_to_copy") and isinstance(args[0], torch.Tensor):
            if args[0].data_ptr() in self.weights and out.dtype != args[0].dtype:
                self.n += 1
        return out


def _linears(model: torch.nn.Module) -> int:
    return sum(isinstance(m, torch.nn.Linear) for m in model.modules())


def _eager_rollout(model, setting: str, *, shared: bool, topk: int, autocast: bool = True):
    """Returns (tokens, lengths, ended, log-probs, top-K ids, top-K log-probs), the paths taken and the weight casts
    of one sampled eager rollout of the builtin engine (CPU bf16 autocast, inference mode, as a CUDA run samples)."""
    engine = make_test_engine(
        "builtin",
        eos=(EOS,),
        fast=FastConfig(packed_weights="off", shared_prefix="on" if shared else "off", cast_once=setting),
    )
    prompts = random_prompts(3, seed=4, min_len=2, max_len=7)  # left padding
    params = SamplingParams(max_completion_length=12, temperature=1.0, top_p=0.9, logprobs_topk=topk)
    paths: dict = {}
    top: dict = {}
    counter = WeightCasts(model)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), counter:
        out = engine._decode(
            model, prompts, 3, params, torch.Generator().manual_seed(7), CPU, paths=paths, top=top
        )
    extra = (top["ids"], top["logprobs"]) if topk else ()
    return (*out, *extra), paths, counter.n


@pytest.mark.parametrize("shared", [True, False], ids=["shared-prefix", "repeated"])
@pytest.mark.parametrize("topk", [0, 3], ids=["plain", "top3"])
def test_the_builtin_eager_decode_casts_each_weight_once_and_samples_the_same(shared, topk):
    model = tiny_model(seed=3, logit_scale=4.0)  # float32
    once, paths, casts = _eager_rollout(model, "auto", shared=shared, topk=topk)
    every, plain_paths, plain_casts = _eager_rollout(model, "off", shared=shared, topk=topk)
    for a, b in zip(once, every):
        assert torch.equal(a, b)
    assert paths["cast_once"] is True and plain_paths["cast_once"] is False
    n = _linears(model)
    assert casts == n  # once for the prefill and every step
    assert plain_casts >= 10 * n  # the prefill and each of the 11 steps (rows may end and leave early)


def test_without_autocast_nothing_changes_and_on_is_refused():
    model = tiny_model(seed=3, logit_scale=4.0)
    once, paths, casts = _eager_rollout(model, "auto", shared=True, topk=0, autocast=False)
    every, _, _ = _eager_rollout(model, "off", shared=True, topk=0, autocast=False)
    for a, b in zip(once, every):
        assert torch.equal(a, b)
    assert paths["cast_once"] is False and casts == 0
    with pytest.raises(FastPathError, match="fast.cast_once=on.*autocast is off on cpu"):
        _eager_rollout(model, "on", shared=True, topk=0, autocast=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_weights_autocast_would_not_cast_are_left_alone(dtype):
    """Weights already in autocast's dtype, and float64 ones, which autocast leaves alone (a double model computes
    in double under autocast): nothing is cast, and the rollout is the same."""
    model = tiny_model(seed=3, logit_scale=4.0).to(dtype)
    once, paths, casts = _eager_rollout(model, "on", shared=False, topk=0)
    every, _, _ = _eager_rollout(model, "off", shared=False, topk=0)
    for a, b in zip(once, every):
        assert torch.equal(a, b)
    assert paths["cast_once"] is False and casts == 0


def test_a_lora_model_decodes_the_same_with_its_weights_cast_once():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_model(seed=3, logit_scale=4.0),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False),
    ).eval()
    once, paths, casts = _eager_rollout(model, "on", shared=True, topk=0)
    every, _, plain_casts = _eager_rollout(model, "off", shared=True, topk=0)
    for a, b in zip(once, every):
        assert torch.equal(a, b)
    assert paths["cast_once"] is True and casts < plain_casts


class Agent:
    """Inserts a two-token block after each ended turn, for at most 3 turns."""

    def __init__(self):
        self.seen: dict[int, int] = {}

    def turn_ended(self, row, turn, *, truncated):
        self.seen[row] = self.seen.get(row, 0) + 1
        return self.seen[row] < 3

    def continuation(self, row, room):
        block = [20 + row, 21]
        return block if len(block) < room else None


@pytest.mark.parametrize("extend", [True, False], ids=["extended-cache", "re-encoded"])
def test_multi_turn_episodes_cast_each_weight_once_and_decode_the_same(extend):
    model = tiny_model(seed=2, eos_bias=2.5, logit_scale=4.0)
    prompts = [[5, 6, 7], [5, 6, 7], [9, 3], [4, 8, 2, 11, 12]]
    params = SamplingParams(max_completion_length=24, temperature=0.9)

    def run(setting):
        counter = WeightCasts(model)
        taken: dict = {}
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), counter:
            with cast_once(model, CPU, FastConfig(cast_once=setting), taken) as forward:
                out = decode_episodes(
                    model,
                    prompts,
                    params,
                    torch.Generator().manual_seed(3),
                    Agent(),
                    end_of_turn_ids=[EOS],
                    pad_token_id=PAD,
                    device=CPU,
                    extend_cache=extend,
                    forward=forward,
                )
        return out, taken, counter.n

    once, taken, casts = run("auto")
    every, plain_taken, plain_casts = run("off")
    assert once.tokens == every.tokens and once.masks == every.masks and once.turns == every.turns
    assert once.logprobs == every.logprobs  # Python floats: bit for bit
    assert max(once.turns) > 1  # the agent's blocks were fed (extension or re-encoding)
    assert taken == {"cast_once": True} and plain_taken == {"cast_once": False}
    assert casts == _linears(model) and plain_casts > 10 * _linears(model)


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"model": {"device": "cpu"}}, "model.device='cpu' runs without autocast"),
        ({"model": {"device": "cuda", "bf16_autocast": False}}, "model.bf16_autocast is off"),
        (
            {"model": {"device": "cuda"}, "distributed": {"strategy": "fsdp"}},
            "distributed.strategy='fsdp' shards the weights",
        ),
    ],
)
def test_cast_once_on_where_it_cannot_run_is_refused_before_the_model_loads(monkeypatch, tmp_path, over, why):
    if "distributed" in over:
        monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: fsdp needs several processes
    cfg: dict = {
        "model": {"name_or_path": str(tmp_path / "not-there")},
        "data": {"task": "addition"},
        "fast": {"cast_once": "on"},
    }
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    with pytest.raises(FastPathConfigError, match="fast.cast_once=on cannot run") as e:
        load_config(None, cfg).validate()
    assert why in str(e.value) and "fast.cast_once=auto or off" in str(e.value)


def test_a_bad_cast_once_value_is_refused():
    with pytest.raises(
        ValueError, match="fast.cast_once='sometimes' is not valid; choose one of: auto, on, off"
    ):
        FastConfig(cast_once="sometimes").validate()


def test_the_cast_forward_puts_the_weights_back_even_when_the_forward_fails():
    model = tiny_model(seed=3)
    before = dict(model.named_parameters())
    ids = torch.tensor([[3, 4, 5]])
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        with cast_once(model, CPU, FastConfig()) as forward:
            assert isinstance(forward, CastForward) and forward.slots
            plain = model(input_ids=ids).logits
            assert torch.equal(forward(input_ids=ids).logits, plain)
            with pytest.raises(IndexError):
                forward(input_ids=torch.tensor([[10_000]]))  # outside the vocabulary
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] and isinstance(after[k], torch.nn.Parameter) for k in before)


def test_a_parametrized_weight_is_left_to_autocast_and_the_values_are_the_same():
    """A parametrization computes its weight at each access (weight norm, for one): no copy can stand for it."""
    from torch.nn.utils import parametrize

    class Doubled(torch.nn.Module):
        def forward(self, w):
            return w * 2

    model = tiny_model(seed=3)
    parametrize.register_parametrization(model.model.layers[0].mlp.up_proj, "weight", Doubled())
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        with cast_once(model, CPU, FastConfig()) as forward:
            assert isinstance(forward, CastForward) and forward.slots
            assert "model.layers.0.mlp.up_proj.weight" not in forward.weights
            assert "model.layers.0.mlp.gate_proj.weight" in forward.weights
            assert torch.equal(forward(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_weight_outside_the_parameters_goes_through_functional_call():
    model = tiny_model(seed=3)
    proj = model.model.layers[1].self_attn.o_proj
    weight = proj.weight.detach().clone()
    del proj.weight
    proj.weight = weight  # a plain attribute, as some conversions leave it
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        with cast_once(model, CPU, FastConfig()) as forward:
            assert isinstance(forward, CastForward) and forward.slots is None
            assert torch.equal(forward(input_ids=ids).logits, model(input_ids=ids).logits)
    assert proj.weight is weight


def test_a_model_fsdp_manages_is_left_to_autocast_even_while_gathered():
    """Inside `gathered` FSDP's parameters are plain tensors it set in place, so their type does not tell; the
    FSDP-managed modules do. Both the eager casts and the captured step refuse such a model."""
    from torch.distributed.fsdp import FSDPModule

    from cohort.rollout.builtin import graph_decode_unavailable
    from cohort.rollout.casts import cast_once_unavailable

    model = tiny_model(seed=3)
    layer = model.model.layers[0]
    layer.__class__ = type(
        "FSDPQwen2DecoderLayer", (FSDPModule, type(layer)), {}
    )  # as fully_shard marks a unit
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "sharded" in cast_once_unavailable(model, CPU)
        with pytest.raises(FastPathError, match="fast.cast_once=on.*sharded"):
            with cast_once(model, CPU, FastConfig(cast_once="on")):
                pass
        with pytest.warns(UserWarning, match="fast path 'cast_once' off"):
            with cast_once(model, CPU, FastConfig()) as forward:
                assert forward is model
    assert "sharded" in graph_decode_unavailable(model, torch.device("cuda"))
