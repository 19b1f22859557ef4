"""fast.compile_update: padded rows' decoder forward through torch.compile gives the eager log-probs and gradients,
one trace serves micro-batches of every size, and a forward that cannot compile leaves the eager one.

A CPU's inductor spends tens of seconds compiling C++ for even a tiny model, so these tests compile with backends
that trace the same graph (Dynamo's capture, AOTAutograd's joint forward and backward) and run it eagerly: what
they check is the trace, not the GPU's generated kernels, which only a GPU run shows (benchmarks/gpu)."""

from __future__ import annotations

import pytest
import torch
from _compile import Recorder
from _tiny import random_prompts, tiny_model

from cohort import logprobs as lp_module
from cohort.config import load_config
from cohort.fastpath import FastConfig, FastPathError, compiled, probes
from cohort.fastpath.switches import FastPathConfigError
from cohort.models import checkpoint_activations

G = 2
COMPILED = FastConfig(grouped="off", unmasked_padding="on", compile_update="on")


def rows(batch: int, longest: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Returns (prompts, completions) of `batch` groups of G with completions of 1..longest tokens."""
    prompts = random_prompts(batch, seed=seed, min_len=2, max_len=9)
    comps = [[(seed + 7 * i + j) % 40 for j in range(1 + (3 * i) % longest)] for i in range(batch * G)]
    return prompts, comps


def _run(model, prompts, comps, fast):
    model.zero_grad()
    lp = lp_module.completion_logprobs(model, prompts, comps, G, fast=fast, with_entropy=True)
    (lp.logp * lp.mask).sum().backward()
    return lp, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "backend",
    # inductor: the real compiler's kernels for the forward and, through AOTAutograd, the backward (tens of seconds
    # of C++ compiling on a CPU, once)
    ["aot_eager", "recorder", pytest.param("inductor", marks=pytest.mark.slow)],
)
def test_compiled_padded_rows_give_the_eager_log_probs_and_gradients(monkeypatch, backend):
    monkeypatch.setattr(compiled, "BACKEND", Recorder() if backend == "recorder" else backend)
    model = tiny_model(seed=21).double()
    prompts, comps = rows(3, 9, seed=1)
    got, got_grad = _run(model, prompts, comps, COMPILED)
    ref, ref_grad = _run(model, prompts, comps, COMPILED.replace(compile_update="off"))
    assert got.compiled and not ref.compiled and got.unmasked and got.path == "padded"
    assert compiled.failed(model.model) is None  # compiled, not fallen back to the eager forward
    assert probes.results(model)["compile_update"] is True
    # The backends that run the traced graph as it is: float64's rounding. Inductor's fused kernels round
    # differently where the model computes in float32 whatever its weights' dtype (Qwen2's RMSNorm): ~1e-8 apart.
    atol = 1e-6 if backend == "inductor" else 1e-10
    torch.testing.assert_close(got.logp, ref.logp, rtol=0, atol=atol)
    torch.testing.assert_close(got.entropy, ref.entropy, rtol=0, atol=atol)
    for name, g in ref_grad.items():
        torch.testing.assert_close(got_grad[name], g, rtol=0, atol=atol)


def test_one_trace_serves_micro_batches_of_every_size(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(compiled, "BACKEND", recorder)
    model = tiny_model(seed=22)
    for batch, longest in ((2, 5), (3, 9), (4, 3), (2, 12)):
        prompts, comps = rows(batch, longest, seed=batch + longest)
        lp, _ = _run(model, prompts, comps, COMPILED)
        assert lp.compiled
    # The probe's trace (eval mode, no gradients) and the one with gradients: no size asks for another.
    assert recorder.graphs == 2


def test_a_forward_that_cannot_compile_leaves_the_eager_one(monkeypatch):
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiled, "BACKEND", broken)
    model = tiny_model(seed=23)
    prompts, comps = rows(2, 6, seed=3)
    with pytest.raises(FastPathError) as e, pytest.warns(UserWarning, match="using the eager one"):
        lp_module.completion_logprobs(model, prompts, comps, G, fast=COMPILED)
    assert "fast.compile_update=on" in str(e.value) and "no compiler here" in str(e.value)
    # auto (taken on CUDA only: the choice is made as on a GPU, the forwards run here) falls back and says why once.
    monkeypatch.setattr(lp_module, "input_device", lambda m: torch.device("cuda", 0))
    with pytest.warns(UserWarning, match="fast path 'compile_update' off"):
        assert not lp_module.choose_compiled(
            model, FastConfig(compile_update="auto"), unmasked=True, chunked=True
        )
    monkeypatch.undo()
    lp = lp_module.completion_logprobs(model, prompts, comps, G, fast=COMPILED.replace(compile_update="auto"))
    assert not lp.compiled


def test_compile_update_is_off_by_default_and_auto_takes_it_on_cuda_only(monkeypatch):
    assert FastConfig().compile_update == "off"
    model = tiny_model(seed=24)
    auto = FastConfig(compile_update="auto")
    assert not lp_module.choose_compiled(model, auto, unmasked=True, chunked=True)  # a CPU
    why = lp_module._compile_unavailable(model, unmasked=False, chunked=True)
    assert why is not None and "fast.unmasked_padding" in why
    why = lp_module._compile_unavailable(model, unmasked=True, chunked=False)
    assert why is not None and "fast.chunked_head" in why
    assert checkpoint_activations(model)
    why = lp_module._compile_unavailable(model, unmasked=True, chunked=True)
    assert why is not None and "gradient checkpointing" in why


def test_compile_update_settings_it_cannot_honour_are_refused_before_the_model_loads():
    for over, fragment in [
        ({"chunked_head": "off"}, "fast.compile_update=on cannot run with fast.chunked_head=off"),
        ({"unmasked_padding": "off"}, "fast.compile_update=on cannot run with fast.unmasked_padding=off"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            FastConfig(compile_update="on", **over).validate()
    FastConfig.all("on").validate()  # every switch on: grouped rows simply leave nothing to compile
    with pytest.raises(ValueError, match="fast.compile_update='yes please' is not valid"):
        FastConfig(compile_update="yes please").validate()
    base = {"model": {"name_or_path": "not-loaded", "device": "cpu"}, "data": {"task": "addition"}}
    for over, fragment in [
        ({"fast": {"compile_update": "on"}}, "fast.unmasked_padding=auto keeps the mask off CUDA"),
        (
            {
                "fast": {"compile_update": "on", "unmasked_padding": "on"},
                "model": {"gradient_checkpointing": True},
            },
            "model.gradient_checkpointing is on",
        ),
    ]:
        cfg = {**base, **over, "model": {**base["model"], **over.get("model", {})}}
        with pytest.raises(FastPathConfigError, match=f"fast.compile_update=on cannot run: .*{fragment}"):
            load_config(None, cfg).validate()
    load_config(None, {**base, "fast": {"compile_update": "on", "unmasked_padding": "on"}}).validate()


def test_running_out_of_memory_in_the_compiled_forward_is_not_taken_for_a_compile_failure(monkeypatch):
    def out_of_memory(gm, example_inputs):
        def run(*args):
            raise torch.OutOfMemoryError("out of memory (made up)")

        return run

    monkeypatch.setattr(compiled, "BACKEND", out_of_memory)
    model = tiny_model(seed=25)
    decoder = model.model
    with pytest.raises(torch.OutOfMemoryError, match="made up"):
        compiled.hidden_states(decoder, torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]]), model=model)
    assert compiled.failed(decoder) is None  # a later, smaller micro-batch still tries the compiled forward


def test_a_backward_that_cannot_compile_is_caught_by_the_check_not_in_the_update(monkeypatch):
    """AOTAutograd may compile the backward only at the first backward, where a failure would raise from the
    update with no fallback: the once-per-model check runs a backward too, with gradients on."""
    from torch._dynamo.backends.common import aot_autograd

    def broken_backward(gm, example_inputs):
        raise RuntimeError("no backward compiler here")

    monkeypatch.setattr(
        compiled, "BACKEND", aot_autograd(fw_compiler=lambda gm, _: gm.forward, bw_compiler=broken_backward)
    )
    torch._dynamo.reset()
    model = tiny_model(seed=26)
    prompts, comps = rows(2, 6, seed=4)
    with pytest.raises(FastPathError, match=r"compiled backward .*no backward compiler here"):
        lp_module.completion_logprobs(model, prompts, comps, G, fast=COMPILED)
    assert probes.results(model)["compile_update"] is True  # the forward compiled and agreed
    assert probes.results(model)["compile_update_backward"] is False
    for p in model.parameters():
        assert p.grad is None  # the check's gradients are its own, not accumulated into the model
    # auto falls back to the eager forward, and the update's own backward runs
    model.zero_grad()
    lp = lp_module.completion_logprobs(model, prompts, comps, G, fast=COMPILED.replace(compile_update="auto"))
    assert not lp.compiled
    (lp.logp * lp.mask).sum().backward()
    torch._dynamo.reset()
