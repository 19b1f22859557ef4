"""fast.compile_decode: the static decode step through torch.compile decodes what the eager step decodes, in one
graph without breaks, with one trace for rollouts of every size; a step that cannot compile runs eagerly.

A CPU's inductor spends tens of seconds compiling C++ even for a tiny model, so these tests compile with backends
that trace the same graph (Dynamo's capture, AOTAutograd's functional graph) and run it eagerly: what they check
is the trace. Inductor's kernels inside a captured graph only run in the GPU-only tests at the end (benchmarks/gpu
runs them)."""

from __future__ import annotations

import pytest
import torch
from _captured import refused_configs
from _compile import Recorder
from _tiny import EOS, PAD, make_test_engine, random_prompts, tiny_model

from cohort.config import load_config
from cohort.fastpath import FastConfig, FastPathError, compiled, probes
from cohort.fastpath.switches import FastPathConfigError
from cohort.rollout import SamplingParams
from cohort.rollout.graph import DECODE_STEP, _advance, open_decoder, static_decode

CPU = torch.device("cpu")
T = 8


@pytest.fixture(autouse=True)
def _fresh_traces():
    """Every test starts without traces of the step (Dynamo keeps them per code object, across backends)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _decode(model, prompts, G, params, *, compiled_step, shared=True, seed=5, eos=EOS):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        out = static_decode(
            model, prompts, G, params, g, CPU, eos_token_ids=[eos], pad_token_id=PAD, shared=shared,
            capture=False, check_every=3, compiled=compiled_step,
        )  # fmt: skip
    return tuple(t.clone() for t in out), g


def _assert_same(a, b, atol=0.0):
    tok_a, len_a, end_a, lp_a = a
    tok_b, len_b, end_b, lp_b = b
    assert torch.equal(tok_a, tok_b) and torch.equal(len_a, len_b) and torch.equal(end_a, end_b)
    assert float((lp_a - lp_b).abs().max()) <= atol


@pytest.mark.parametrize(
    "params, shared, backend",
    [
        # aot_eager: the functional graph inductor lowers (the buffers the step writes become its outputs)
        (SamplingParams(max_completion_length=T, greedy=True), False, "aot_eager"),
        (SamplingParams(max_completion_length=T, temperature=0.8, top_k=9, top_p=0.9), True, "recorder"),
    ],
    ids=["greedy-own-prompts", "top_k_top_p-shared-prefix"],
)
def test_the_compiled_step_decodes_what_the_eager_step_decodes(monkeypatch, params, shared, backend):
    monkeypatch.setattr(compiled, "BACKEND", Recorder() if backend == "recorder" else backend)
    model = tiny_model(seed=3, logit_scale=4.0).double()
    prompts = random_prompts(3, seed=1, min_len=2, max_len=7)  # left padding
    eager, g_eager = _decode(model, prompts, 3, params, compiled_step=False, shared=shared, eos=7)
    got, g_got = _decode(model, prompts, 3, params, compiled_step=True, shared=shared, eos=7)
    assert DECODE_STEP.failed(model) is None
    _assert_same(got, eager, atol=1e-12)
    assert bool(got[2].any())  # EOS mid-rollout: rows that ended write pad after it
    assert torch.equal(g_got.get_state(), g_eager.get_state())  # the same noise, drawn outside the step


def test_the_compiled_step_under_autocast_decodes_what_the_eager_step_decodes(monkeypatch):
    # Under autocast the step runs the Linear weights' bf16 copies through functional_call.
    monkeypatch.setattr(compiled, "BACKEND", Recorder())
    model = tiny_model(seed=4, logit_scale=4.0)
    prompts = random_prompts(2, seed=2, min_len=3, max_len=6)
    params = SamplingParams(max_completion_length=T, greedy=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager, _ = _decode(model, prompts, 2, params, compiled_step=False)
        got, _ = _decode(model, prompts, 2, params, compiled_step=True)
    assert DECODE_STEP.failed(model) is None
    _assert_same(got, eager, atol=1e-6)


@pytest.mark.slow
def test_inductor_s_own_kernels_decode_what_the_eager_step_decodes(monkeypatch):
    """The real compiler, once: inductor's lowering, fusion and generated kernels (C++ here, Triton's on a GPU, from
    the same scheduler) run the step, buffers written in place included. About 20 s of compiling on a CPU."""
    monkeypatch.setattr(compiled, "BACKEND", "inductor")
    model = tiny_model(seed=3, logit_scale=4.0).double()
    prompts = random_prompts(3, seed=1, min_len=2, max_len=7)
    params = SamplingParams(max_completion_length=T, temperature=0.8, top_k=9, top_p=0.9)
    eager, g_eager = _decode(model, prompts, 3, params, compiled_step=False, eos=7)
    got, g_got = _decode(model, prompts, 3, params, compiled_step=True, eos=7)
    assert DECODE_STEP.failed(model) is None  # inductor ran it: no fallback to the eager step
    # the same tokens; the log-probs are float32 (the sampler's), and fused kernels round them (and Qwen2's norm,
    # float32 whatever the weights) differently: a float32 ulp or two apart
    _assert_same(got, eager, atol=1e-6)
    assert bool(got[2].any())  # EOS mid-rollout
    assert torch.equal(g_got.get_state(), g_eager.get_state())
    again, _ = _decode(model, random_prompts(2, seed=9, min_len=3, max_len=8), 3, params, compiled_step=True)
    assert DECODE_STEP.failed(model) is None and again[0].shape[0] == 6  # another batch, the same kernels


@pytest.mark.parametrize("autocast", [False, True])
def test_the_step_traces_as_one_graph(autocast):
    """No graph break: a break would cut the step into pieces that fuse apart (the plan's look-up by its carrier
    mask, a weak-key dictionary, was one a layer)."""
    model = tiny_model(seed=5)
    params = SamplingParams(max_completion_length=T, temperature=1.0, top_k=9)
    g = torch.Generator().manual_seed(0)
    kw = {"eos_token_ids": [EOS], "pad_token_id": PAD, "shared": True}
    with (
        torch.no_grad(),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
        open_decoder(model, random_prompts(2, seed=3), 2, params, g, CPU, compiled=True, **kw) as decoder,
    ):
        decoder.draw_noise(g)
        explained = torch._dynamo.explain(_advance)(decoder)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_one_trace_serves_rollouts_of_every_prompt_length_batch_and_length(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(compiled, "BACKEND", recorder)
    model = tiny_model(seed=6)
    G = 3  # a run's samples per prompt: a number the trace keeps (rows = prompts x G, with no division to reason)
    # 2 prompts as the model's 2 KV heads: still no size fixed to another that equals it on the first call
    for batch, longest, new in ((2, 5, 6), (3, 9, 9), (4, 3, 5)):
        params = SamplingParams(max_completion_length=new, temperature=1.0)
        prompts = random_prompts(batch, seed=batch, min_len=2, max_len=longest)
        _decode(model, prompts, G, params, compiled_step=True)
        assert recorder.graphs == 1
    _decode(model, random_prompts(1, seed=1), G, params, compiled_step=True)
    assert recorder.graphs == 2  # a batch of one prompt (a size of 1) is its own trace
    _decode(model, random_prompts(2, seed=1), G + 1, params, compiled_step=True)
    assert recorder.graphs == 3  # and so is another G
    assert DECODE_STEP.failed(model) is None


def test_a_step_that_cannot_compile_runs_eagerly_and_says_why_once(monkeypatch):
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiled, "BACKEND", broken)
    model = tiny_model(seed=7)
    prompts = random_prompts(2, seed=4)
    params = SamplingParams(max_completion_length=T, temperature=1.0)
    eager, _ = _decode(model, prompts, 2, params, compiled_step=False)
    with pytest.warns(
        UserWarning, match="compiling the decode step of Qwen2ForCausalLM failed .*no compiler here"
    ):
        got, _ = _decode(model, prompts, 2, params, compiled_step=True)
    _assert_same(got, eager)
    assert "no compiler here" in DECODE_STEP.failed(model)
    engine = make_test_engine("builtin", fast=FastConfig(packed_weights="off"))
    assert "compiling the decode step failed" in engine._compile_unavailable(model, CPU)


def test_a_step_that_would_trace_anew_inside_a_capture_runs_eagerly(monkeypatch):
    # A CUDA graph capture cannot compile: step(recompile=False) runs the eager step instead of tracing.
    recorder = Recorder()
    monkeypatch.setattr(compiled, "BACKEND", recorder)
    model = tiny_model(seed=8)
    prompts = random_prompts(2, seed=6)
    params = SamplingParams(max_completion_length=T, greedy=True)
    kw = {"eos_token_ids": [EOS], "pad_token_id": PAD, "shared": True}
    with torch.no_grad(), open_decoder(model, prompts, 2, params, None, CPU, compiled=True, **kw) as decoder:
        decoder.step()  # traced greedy, without autocast (a warm-up step)
    # another rollout's sizes: the trace serves them, recompiling forbidden or not
    other = random_prompts(3, seed=7)
    with torch.no_grad(), open_decoder(model, other, 2, params, None, CPU, compiled=True, **kw) as decoder:
        decoder.step(recompile=False)
        assert decoder.compiled_ran() and recorder.graphs == 1
    with (
        torch.no_grad(),
        torch.autocast("cpu", dtype=torch.bfloat16),  # a setting the trace does not cover
        open_decoder(model, prompts, 2, params, None, CPU, compiled=True, **kw) as decoder,
        pytest.warns(UserWarning, match="compiling the decode step"),
    ):
        decoder.step(recompile=False)
        assert not decoder.compiled_ran()
        assert int(decoder.plan.step) == 1  # the step ran, eagerly
    assert "Recompil" in DECODE_STEP.failed(model)


def test_the_probe_passes_a_model_the_compiled_step_decodes(monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", Recorder())
    model = tiny_model(seed=9)
    engine = make_test_engine("builtin", fast=FastConfig(packed_weights="off"))
    assert engine._compile_unavailable(model, CPU) is None
    assert probes.results(model)["compile_decode"] is True


def test_compile_decode_is_off_by_default_and_reported(monkeypatch):
    assert FastConfig().compile_decode == "off" and FastConfig.all("on").compile_decode == "on"
    model = tiny_model(seed=10)
    params = SamplingParams(max_completion_length=T, temperature=1.0)
    engine = make_test_engine("builtin", fast=FastConfig(packed_weights="off", compile_decode="auto"))
    with torch.no_grad():
        out = engine.generate(model, random_prompts(2, seed=1), 2, params)
    # a CPU: today's engine
    assert out.paths["compile_decode"] is False and out.paths["graph_decode"] is False
    monkeypatch.setattr(compiled, "BACKEND", lambda gm, example_inputs: 1 / 0)
    with pytest.warns(UserWarning, match="compiling the decode step"):
        # the probe's step fell back to eager, which is not what it checks
        why = engine._compile_unavailable(model, CPU)
    assert why.startswith("compiling the decode step failed (BackendCompilerFailed from ZeroDivisionError")
    # auto, weighed as on a GPU, falls back and says why once; on refuses
    cuda = torch.device("cuda", 0)
    with pytest.warns(
        UserWarning,
        match="fast path 'compile_decode' off for Qwen2ForCausalLM: compiling the decode step failed",
    ):
        assert not engine.compiles_captured_step(model, cuda)
    strict = make_test_engine("builtin", fast=FastConfig(packed_weights="off", compile_decode="on"))
    with pytest.raises(
        FastPathError, match="fast.compile_decode=on, but Qwen2ForCausalLM cannot take it: compiling"
    ):
        strict.compiles_captured_step(model, cuda)


def test_an_engine_asked_for_the_compiled_step_where_it_cannot_run_says_so():
    # shared_prefix=on: its probe builds a plain engine from these switches (compile on, the static step off)
    engine = make_test_engine(
        "builtin", fast=FastConfig(packed_weights="off", shared_prefix="on", compile_decode="on")
    )
    params = SamplingParams(max_completion_length=T, temperature=1.0)
    with (
        torch.no_grad(),
        pytest.raises(
            FastPathError,
            match=r"fast.compile_decode=on compiles the captured decode step, which this rollout cannot take "
            r"\(it decodes on cpu, and CUDA graphs need a CUDA GPU\)",
        ),
    ):
        engine.generate(tiny_model(seed=13), random_prompts(2, seed=1), 2, params)


def test_compile_decode_settings_it_cannot_honour_are_refused_before_the_model_loads(tiny_model_dir):
    with pytest.raises(ValueError, match="fast.compile_decode=on compiles the captured decode step, but "):
        FastConfig(compile_decode="on", graph_decode="off").validate()
    with pytest.raises(ValueError, match="fast.compile_decode='yes' is not valid"):
        FastConfig(compile_decode="yes").validate()
    for cfg, why in refused_configs(tiny_model_dir, {"compile_decode": "on"}):
        with pytest.raises(
            FastPathConfigError, match=rf"fast.compile_decode=on compiles the captured decode step, .*{why}"
        ):
            load_config(None, cfg).validate()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for a CUDA graph: needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("autocast", [False, True])
def test_on_a_gpu_the_compiled_captured_step_decodes_what_the_captured_step_decodes(autocast):
    device = torch.device("cuda")
    model = tiny_model(seed=3, logit_scale=4.0).to(device)
    prompts = random_prompts(3, seed=1)
    params = SamplingParams(max_completion_length=24, greedy=True)
    kw = {"eos_token_ids": [EOS], "pad_token_id": PAD, "shared": True, "check_every": 4, "capture": True}
    outs = []
    for compiled_step in (False, True):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = static_decode(model, prompts, 4, params, None, device, compiled=compiled_step, **kw)
            outs.append(tuple(t.clone() for t in out))
    assert DECODE_STEP.failed(model) is None
    _assert_same(outs[1], outs[0], atol=5e-2 if autocast else 1e-4)


@cuda
def test_on_a_gpu_the_engine_takes_the_compiled_step_and_says_so():
    device = torch.device("cuda")
    model = tiny_model(seed=11).to(device)
    engine = make_test_engine(
        "builtin", fast=FastConfig(graph_decode="on", compile_decode="on", graph_decode_min_tokens=0)
    )
    params = SamplingParams(max_completion_length=20, temperature=1.0)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out = engine.generate(model, random_prompts(2, seed=1), 2, params)
    assert out.paths["graph_decode"] is True and out.paths["compile_decode"] is True
    assert probes.results(model)["compile_decode"] is True
