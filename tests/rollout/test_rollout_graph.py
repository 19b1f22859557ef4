"""The static decode step of fast.graph_decode (cohort.rollout.graph), run uncaptured on the CPU: it must decode
what today's engine decodes (greedy: `_decode` itself; sampled: today's accelerator sampler, multinomial over
`drawable` probabilities), with no host sync inside the step, and draw exactly what torch.multinomial draws.
The GPU-only tests at the end capture the step and compare it with itself uncaptured."""

from __future__ import annotations

import pytest
import torch
from _captured import refused_configs
from _tiny import EOS, PAD, make_test_engine, random_prompts, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from cohort.config import load_config
from cohort.fastpath import FastConfig, FastPathError
from cohort.fastpath.switches import FastPathConfigError
from cohort.models import cache_kwargs
from cohort.rollout import SamplingParams, graph
from cohort.rollout.graph import (
    HostSyncCheck,
    HostSyncError,
    cast_linears,
    open_decoder,
    race_sample,
    shared_input_casts,
    static_decode,
)
from cohort.rollout.sampling import drawable, filter_logits

CPU = torch.device("cpu")
T = 10


@pytest.fixture(scope="module")
def model64():
    """A float64 tiny model whose greedy continuations differ by prompt (peaked logits)."""
    return tiny_model(seed=3, logit_scale=4.0).double()


def _eos_mid_rollout(model, prompts, G):
    """Returns an EOS id that greedy decoding emits mid-rollout in some rows and never in others."""
    engine = make_test_engine("builtin", eos=(10_000,), fast=FastConfig(packed_weights="off"))
    params = SamplingParams(max_completion_length=T, greedy=True)
    with torch.no_grad():
        tokens = engine._decode(model, prompts, G, params, None, CPU)[0]
    for t in range(2, T - 2):
        for tok in tokens[:, t].tolist():
            hit = (tokens == tok).any(1)
            first = (tokens == tok).long().argmax(1)
            if hit.any() and not hit.all() and bool((first[hit] >= 2).all()):
                return tok
    raise AssertionError("no token ends some rows mid-rollout")


def _equal_rollouts(a, b, atol=1e-10):
    tok_a, len_a, end_a, lp_a = a
    tok_b, len_b, end_b, lp_b = b
    assert torch.equal(len_a, len_b) and torch.equal(end_a, end_b)
    live = (
        torch.arange(tok_a.shape[1], device=len_a.device)[None] < len_a[:, None]
    )  # [N, T] tokens each row holds
    assert torch.equal(tok_a[live], tok_b[live])
    assert float((lp_a - lp_b).abs()[live].max()) <= atol


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("head", [12, 16], ids=["head12", "head16-scale-in-the-bias-add"])
def test_greedy_static_steps_reproduce_todays_engine(model64, shared, G, head):
    if head != 12:  # model64's heads are 12 wide; 16 scales by a power of two, which the step applies later
        model64 = tiny_model(seed=3, hidden_size=4 * head, logit_scale=4.0).double()
    prompts = random_prompts(3, seed=1, min_len=2, max_len=7)  # left padding
    eos = _eos_mid_rollout(model64, prompts, G)
    engine = make_test_engine(
        "builtin", eos=(eos,), fast=FastConfig(shared_prefix="on" if shared else "off", packed_weights="off")
    )
    params = SamplingParams(max_completion_length=T, greedy=True)
    with torch.no_grad():
        today = engine._decode(model64, prompts, G, params, None, CPU, shared=shared and G > 1)
        static = static_decode(
            model64, prompts, G, params, None, CPU, eos_token_ids=[eos], pad_token_id=PAD, shared=shared,
            capture=False, check_every=3,
        )  # fmt: skip
    lengths = today[1]
    assert 1 < int(lengths.min()) < T and bool(today[2].any()) and not bool(today[2].all())  # EOS mid-way
    _equal_rollouts(today, static)


@pytest.mark.parametrize("shared", [True, False])
def test_under_autocast_a_float64_model_steps_in_float64_as_autocast_leaves_it(model64, shared):
    """Autocast casts no float64 tensor: the static step under it narrows nothing and casts no weight or input, and
    decodes what the eager engine decodes under the same autocast (before, it failed on bf16 weights)."""
    prompts = random_prompts(3, seed=1, min_len=2, max_len=7)
    eos = _eos_mid_rollout(model64, prompts, 2)
    engine = make_test_engine(
        "builtin", eos=(eos,), fast=FastConfig(shared_prefix="on" if shared else "off", packed_weights="off")
    )
    params = SamplingParams(max_completion_length=T, greedy=True)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        today = engine._decode(model64, prompts, 2, params, None, CPU, shared=shared)
        static = static_decode(
            model64, prompts, 2, params, None, CPU, eos_token_ids=[eos], pad_token_id=PAD, shared=shared,
            capture=False, check_every=3,
        )  # fmt: skip
    _equal_rollouts(today, static)


def _reference_sampling(model, prompts, G, params, generator, eos):
    """Today's engine on an accelerator, written out: a growing cache repeated per sample, sample_next's
    log-probs, and torch.multinomial over drawable probabilities; no row dropped."""
    from transformers import DynamicCache

    from cohort.rollout.base import left_pad

    ids, attn = left_pad(prompts, PAD, CPU)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                **cache_kwargs(model, cache))  # fmt: skip
    logits = out.logits[:, -1].repeat_interleave(G, 0)
    cache.batch_repeat_interleave(G)
    N = logits.shape[0]
    mask = torch.cat([attn.repeat_interleave(G, 0), torch.ones(N, T, dtype=attn.dtype)], 1)
    pos = attn.sum(-1).repeat_interleave(G)
    tokens = torch.full((N, T), PAD)
    logps = torch.zeros(N, T)
    lengths = torch.full((N,), T)
    ended = torch.zeros(N, dtype=torch.bool)
    for t in range(T):
        scaled = logits.float() / params.temperature
        logp_all = scaled.log_softmax(-1)
        probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
        tok = torch.multinomial(drawable(probs), 1, generator=generator).squeeze(-1)
        tokens[:, t] = torch.where(ended, PAD, tok)
        logps[:, t] = torch.where(ended, 0.0, logp_all.gather(-1, tok[:, None]).squeeze(-1))
        hit = (tok == eos) & ~ended
        lengths = torch.where(hit, t + 1, lengths)
        ended |= hit
        if t < T - 1:
            out = model(input_ids=tok[:, None], attention_mask=mask[:, : ids.shape[1] + t + 1],
                        position_ids=pos[:, None], **cache_kwargs(model, cache))  # fmt: skip
            logits, pos = out.logits[:, -1], pos + 1
    return tokens, lengths, ended, logps


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_completion_length=T, temperature=1.0),
        SamplingParams(max_completion_length=T, temperature=0.7, top_k=5),
        SamplingParams(max_completion_length=T, temperature=1.3, top_p=0.8),
    ],
    ids=["plain", "top_k", "top_p"],
)
@pytest.mark.parametrize("shared", [True, False])
def test_sampled_static_steps_draw_what_the_accelerator_engine_draws(model64, params, shared):
    prompts = random_prompts(2, seed=4, min_len=3, max_len=8)
    eos = 7
    g_ref, g_static = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    with torch.no_grad():
        ref = _reference_sampling(model64, prompts, 4, params, g_ref, eos)
        static = static_decode(
            model64, prompts, 4, params, g_static, CPU, eos_token_ids=[eos], pad_token_id=PAD, shared=shared,
            capture=False, check_every=4,
        )  # fmt: skip
    _equal_rollouts(ref, static)
    assert torch.equal(g_ref.get_state(), g_static.get_state())  # the same draws, consumed alike


def test_the_step_called_again_and_again_is_the_rollout(model64):
    """No Python value is baked into a step: calling the same step T-1 times gives the whole rollout."""
    prompts = random_prompts(3, seed=2)
    params = SamplingParams(max_completion_length=T, temperature=1.0)
    kw = {"eos_token_ids": [5], "pad_token_id": PAD, "shared": True}
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        whole = static_decode(model64, prompts, 2, params, g, CPU, capture=False, check_every=1000, **kw)
        g = torch.Generator().manual_seed(3)
        with open_decoder(model64, prompts, 2, params, g, CPU, **kw) as decoder:
            for _ in range(T - 1):
                decoder.draw_noise(g)
                decoder.step()
            stepped = (decoder.tokens, decoder.lengths, decoder.ended, decoder.logps)
    _equal_rollouts(whole, stepped, atol=0.0)


class _NoHostSync(HostSyncCheck):
    """The engine's own host-sync check (what a captured graph cannot hold), stricter here: the step makes no
    device-side assert either."""

    SYNCS = HostSyncCheck.SYNCS | {"_assert_async"}


@pytest.mark.parametrize("greedy", [True, False])
def test_the_step_never_syncs_with_the_host(model64, greedy):
    params = SamplingParams(max_completion_length=T, greedy=greedy, top_p=0.9)
    g = torch.Generator().manual_seed(0)
    with (
        torch.no_grad(),
        open_decoder(
            model64,
            random_prompts(2, seed=5),
            3,
            params,
            g,
            CPU,
            eos_token_ids=[EOS],
            pad_token_id=PAD,
            shared=True,
        ) as decoder,
    ):
        decoder.draw_noise(g)
        with _NoHostSync():
            decoder.step()
            decoder.step()
        with pytest.raises(HostSyncError, match="syncs with the host"), _NoHostSync():
            decoder.ended.any().item()  # the mode does catch a sync


@pytest.mark.parametrize("top_k, top_p, temperature", [(0, 1.0, 1.0), (7, 1.0, 0.5), (0, 0.85, 1.4)])
def test_the_exponential_race_is_multinomials_own_draw(top_k, top_p, temperature):
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 3
    params = SamplingParams(max_completion_length=1, temperature=temperature, top_k=top_k, top_p=top_p)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    for _ in range(5):
        probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
        expected = torch.multinomial(drawable(probs), 1, generator=g1).squeeze(-1)
        noise = torch.empty(6, 300).exponential_(1, generator=g2)
        got, _ = race_sample(logits, params, noise)
        assert torch.equal(got, expected)
    assert torch.equal(g1.get_state(), g2.get_state())


def test_cast_linears_is_bitwise_what_autocast_computes():
    model = tiny_model(seed=1)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(input_ids=ids).logits
        with cast_linears(model, "cpu") as weights:
            assert weights and all(w.dtype == torch.bfloat16 for w in weights.values())
            cast = torch.func.functional_call(model, weights, (), {"input_ids": ids}, tie_weights=False)
    assert torch.equal(plain, cast.logits)
    with cast_linears(model, "cpu") as weights:
        assert weights == {}  # no autocast: nothing to cast


def _casts_in_a_step(model, prompts, params, shared, grad_mode=torch.inference_mode):
    """Returns (the rollout, the casts one mid-rollout step dispatched) under CPU bf16 autocast and
    `grad_mode` (the engines sample under inference mode)."""

    class Casts(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # under inference mode the mode sees `to` itself (no-ops included), under no_grad its `_to_copy`
            if func.overloadpacket.__name__ in ("to", "_to_copy") and out.dtype != args[0].dtype:
                Casts.n += 1
            return out

    kw = {"eos_token_ids": [EOS], "pad_token_id": PAD, "shared": shared}
    g = torch.Generator().manual_seed(5)
    with grad_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        with open_decoder(model, prompts, 3, params, g, CPU, **kw) as decoder:
            decoder.draw_noise(g)
            decoder.step()
            with Casts():
                decoder.draw_noise(g)
                decoder.step()
        g = torch.Generator().manual_seed(5)
        out = static_decode(model, prompts, 3, params, g, CPU, capture=False, check_every=3, **kw)
    return out, Casts.n


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("head", [12, 16], ids=["head12", "head16-scale-in-the-bias-add"])
@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize(
    "grad_mode", [torch.inference_mode, torch.no_grad], ids=["inference_mode", "no_grad"]
)
def test_under_autocast_the_step_casts_each_tensor_once_and_computes_the_same_values(
    monkeypatch, shared, head, greedy, grad_mode
):
    """float32 weights under bf16 autocast (CUDA's default): the prompt's keys, the own keys' buffers, the query and
    the probabilities are cast once to bf16, and the Linears that read one tensor share its cast, where autocast
    would cast inside every product; the same rounding, so the same tokens and log-probs bit for bit."""
    model = tiny_model(seed=3, hidden_size=4 * head, logit_scale=4.0)  # float32, 4 heads
    prompts = random_prompts(3, seed=1, min_len=2, max_len=7)
    params = SamplingParams(max_completion_length=T, greedy=greedy, temperature=1.0, top_p=0.9)
    narrowed, casts = _casts_in_a_step(model, prompts, params, shared, grad_mode)
    monkeypatch.setattr(graph, "autocast_dtype", lambda device: None)  # autocast casting inside each product
    plain, plain_casts = _casts_in_a_step(model, prompts, params, shared, grad_mode)
    for a, b in zip(narrowed, plain):
        assert torch.equal(a, b)
    layers = model.config.num_hidden_layers
    # a layer: q, k, v and gate, up inputs 5 -> 2; the query 2 -> 1; the prompt's keys 1 -> 0; probabilities 2 -> 1;
    # the own keys' cast moves from each read of the whole buffer to the write of the new column
    assert plain_casts - casts == 6 * layers


def test_under_autocast_a_lora_model_computes_the_same_values(monkeypatch):
    """peft's LoRA layers wrap a Linear and call two more: the shared casts leave every value as autocast's."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_model(seed=3, logit_scale=4.0),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False),
    ).eval()
    prompts = random_prompts(3, seed=1, min_len=2, max_len=7)
    params = SamplingParams(max_completion_length=T, temperature=1.0, top_p=0.9)
    narrowed, casts = _casts_in_a_step(model, prompts, params, True)
    monkeypatch.setattr(graph, "autocast_dtype", lambda device: None)
    plain, plain_casts = _casts_in_a_step(model, prompts, params, True)
    for a, b in zip(narrowed, plain):
        assert torch.equal(a, b)
    assert casts < plain_casts


def test_shared_input_casts_cast_each_tensor_once_and_anew_after_an_in_place_change():
    lin = [torch.nn.Linear(8, 8) for _ in range(4)]
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    casts = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "_to_copy" and args[0].shape == x.shape:
                casts.append(args[0])
            return func(*args, **(kwargs or {}))

    model = torch.nn.ModuleList(lin)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = x.clone()
        expected = [lin[0](y), lin[1](y)]
        y.add_(1)
        expected += [lin[2](y), lin[3](y)]
        y = x.clone()
        with shared_input_casts(model, torch.bfloat16) as forget, Count():
            got = [lin[0](y), lin[1](y)]
            y.add_(1)  # changed in place: its earlier cast is stale
            got += [lin[2](y), lin[3](y)]
            forget()
        with torch.autocast("cpu", enabled=False), shared_input_casts(model, torch.bfloat16):
            outside = lin[0](x)  # no autocast: the Linear computes in float32 as it would
    assert len(casts) == 2
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert outside.dtype == torch.float32 and torch.equal(outside, lin[0](x).detach())
    assert all(not m._forward_pre_hooks for m in lin)  # the hooks go with the block


def test_steps_after_every_row_ended_change_nothing_and_each_eos_is_heard(model64):
    prompts = random_prompts(3, seed=1, min_len=2, max_len=7)
    eos = _eos_mid_rollout(model64, prompts, 2)
    params = SamplingParams(max_completion_length=T, greedy=True)
    heard: dict[int, list[int]] = {}
    with torch.no_grad():
        tokens, lengths, ended, logps = static_decode(
            model64, prompts, 2, params, None, CPU, eos_token_ids=[eos], pad_token_id=PAD, shared=True,
            capture=False, check_every=2, on_finished=lambda row, ids: heard.setdefault(row, ids),
        )  # fmt: skip
    assert sorted(heard) == ended.nonzero().flatten().tolist()
    for row, ids in heard.items():
        assert ids == tokens[row, : int(lengths[row])].tolist() and ids[-1] == eos
    after = torch.arange(T)[None] >= lengths[:, None]
    assert bool((tokens[after] == PAD).all()) and bool((logps[after] == 0).all())


class _BufferReads(TorchDispatchMode):
    """Counts the ops that read `buffer` (or a view of it)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        super().__init__()
        self.storage, self.count = buffer.untyped_storage().data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.count += any(t.untyped_storage().data_ptr() == self.storage for t in tensors)
        return func(*args, **(kwargs or {}))


def test_a_check_reads_the_tokens_of_every_row_it_hears_end_at_once(model64):
    """On a GPU each read of the device's tokens makes the host wait: a check reads the rows that ended since the
    last one in one copy, as many ops on the buffer for one row as for all of them."""
    params = SamplingParams(max_completion_length=T, greedy=True)
    kw = {"eos_token_ids": [EOS], "pad_token_id": PAD, "shared": True}
    with torch.no_grad(), open_decoder(model64, random_prompts(2, seed=1), 3, params, None, CPU, **kw) as d:
        d.run(None, capture=False)
        N = d.tokens.shape[0]
        lengths = torch.arange(N) % (T - 2) + 2  # [N] every row ends, at its own length
        reads = []
        for rows in ([4], list(range(N))):
            heard: dict[int, list[int]] = {}
            ended = torch.zeros(N, dtype=torch.bool)
            ended[rows] = True
            with _BufferReads(d.tokens) as watch:
                d._tell((ended, lengths), torch.zeros(N, dtype=torch.bool), heard.__setitem__)
            reads.append(watch.count)
            assert heard == {r: d.tokens[r, : int(lengths[r])].tolist() for r in rows}
    assert reads[0] == reads[1]


def test_graph_decode_is_off_on_a_cpu_and_refused_when_on(model64, tiny_model_dir, tmp_path):
    assert FastConfig.all("off").graph_decode == "off" and FastConfig().graph_decode == "auto"
    prompts = random_prompts(2, seed=1)
    params = SamplingParams(max_completion_length=T, temperature=1.0)
    auto = make_test_engine("builtin", fast=FastConfig(packed_weights="off"))
    with torch.no_grad():
        out = auto.generate(model64, prompts, 2, params, generator=torch.Generator().manual_seed(0))
    assert out.paths["graph_decode"] is False  # auto on a CPU: today's engine, bit for bit
    on = make_test_engine("builtin", fast=FastConfig(graph_decode="on", packed_weights="off"))
    with pytest.raises(FastPathError, match=r"fast.graph_decode=on.*CUDA graphs need a CUDA GPU"):
        with torch.no_grad():
            on.generate(model64, prompts, 2, params)
    for cfg, why in refused_configs(tiny_model_dir, {"graph_decode": "on"}):
        with pytest.raises(FastPathConfigError, match=rf"fast.graph_decode=on cannot run: .*{why}"):
            load_config(None, cfg).validate()
    with pytest.raises(
        ValueError, match=r"fast.graph_decode_check_every=0 must be an integer >= 1 \(steps\)"
    ):
        FastConfig(graph_decode_check_every=0).validate()
    with pytest.raises(ValueError, match=r"fast.graph_decode='yes' is not valid"):
        FastConfig(graph_decode="yes").validate()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="captures a CUDA graph: needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("autocast", [False, True])
def test_on_a_gpu_the_captured_step_is_the_uncaptured_step(autocast):
    device = torch.device("cuda")
    model = tiny_model(seed=3, logit_scale=4.0).to(device)
    prompts = random_prompts(3, seed=1)
    params = SamplingParams(max_completion_length=24, temperature=1.0, top_p=0.95)
    kw = {"eos_token_ids": [EOS], "pad_token_id": PAD, "shared": True, "check_every": 4}
    outs = []
    for capture in (False, True):
        g = torch.Generator(device=device).manual_seed(5)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            outs.append(static_decode(model, prompts, 4, params, g, device, capture=capture, **kw))
    _equal_rollouts(outs[0], outs[1], atol=0.0)


@cuda
def test_on_a_gpu_the_engine_takes_the_captured_step_with_lora():
    peft = pytest.importorskip("peft")
    device = torch.device("cuda")
    model = peft.get_peft_model(
        tiny_model(seed=3).to(device), peft.LoraConfig(r=4, target_modules=["q_proj"])
    )
    engine = make_test_engine("builtin", fast=FastConfig(graph_decode="on", graph_decode_min_tokens=0))
    params = SamplingParams(max_completion_length=20, greedy=True)
    with torch.no_grad():
        out = engine.generate(model, random_prompts(2, seed=1), 2, params)
    assert out.paths["graph_decode"] is True


@cuda
def test_on_a_gpu_a_forward_that_syncs_with_the_host_is_refused_by_the_probe():
    device = torch.device("cuda")
    model = tiny_model(seed=4).to(device)

    def reads_a_value(module, inputs, output):
        float(output[0].sum())  # a host sync inside the forward: no CUDA graph can capture it

    model.model.layers[0].register_forward_hook(reads_a_value)
    engine = make_test_engine("builtin", fast=FastConfig(graph_decode="auto", graph_decode_min_tokens=0))
    params = SamplingParams(max_completion_length=12, greedy=True)
    with pytest.warns(UserWarning, match="fast path 'graph_decode' off"), torch.no_grad():
        out = engine.generate(model, random_prompts(2, seed=1), 2, params)
    assert (
        out.paths["graph_decode"] is False
    )  # the eager engine decoded it: never a token from a broken graph
    strict = make_test_engine("builtin", fast=FastConfig(graph_decode="on", graph_decode_min_tokens=0))
    with pytest.raises(FastPathError, match="fast.graph_decode=on"), torch.no_grad():
        strict.generate(model, random_prompts(2, seed=1), 2, params)


def _probe_decodings(model, shift: int = 0):
    """Returns (the static step's greedy decoding, the eager engine's) of the graph_decode probe's prompts, the
    static step's positions moved by `shift` (a structural error) when non-zero."""
    from cohort.rollout import builtin

    vocab, prompts = builtin._probe_prompts(model)
    params = SamplingParams(max_completion_length=6, greedy=True)
    kw = {"eos_token_ids": [vocab], "pad_token_id": PAD, "shared": True}
    with torch.no_grad(), open_decoder(model, prompts, 2, params, None, CPU, **kw) as decoder:
        decoder.pos.add_(shift)
        fast = decoder.run(None, capture=False, check_every=2)
        fast = tuple(t.clone() for t in fast)
    eager = make_test_engine(
        "builtin", eos=(vocab,), fast=FastConfig(packed_weights="off", shared_prefix="off")
    )
    with torch.no_grad():
        plain = eager._decode(model, prompts, 2, params, None, CPU, shared=False)
    return prompts, fast, plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probe_judges_each_decoding_against_a_forward_over_its_own_tokens(dtype):
    # Two greedy decodings of a bf16 model part at near-ties (an H200 refused the captured step of a random 0.5B
    # model so): the probe compares each one's log-probs with a plain forward over its own tokens instead.
    from cohort.fastpath.probes import tolerance
    from cohort.rollout import builtin

    model = tiny_model(seed=3, logit_scale=4.0).to(dtype)
    prompts, fast, plain = _probe_decodings(model)
    agree = builtin._decodes_like_forward(model, prompts, 2)
    assert agree(fast, plain, tolerance(model))
    gap, pick, rounding = builtin._forward_gaps(model, prompts, 2, fast)
    assert gap <= tolerance(model) + rounding and pick <= 2 * (tolerance(model) + rounding)
    # whatever tokens it picked: a decoding that swaps in other tokens keeps its log-probs and is refused
    swapped = (fast[0].roll(1, dims=1), *fast[1:])
    assert not agree(swapped, plain, tolerance(model))
    # a step at the wrong positions (RoPE off by three) is refused too. In float32 only: on a random tiny model
    # that error moves log-probs by about 0.004, inside bf16's rounding allowance (5e-2, as for every probe).
    if dtype == torch.float32:
        _, wrong, _ = _probe_decodings(model, shift=3)
        assert not agree(wrong, plain, tolerance(model))
    # and a decoding whose rows ended or hold a token outside the vocabulary cannot agree
    ended = (fast[0], fast[1] - 1, torch.ones_like(fast[2]), fast[3])
    assert not agree(ended, plain, tolerance(model))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 3])
def test_a_power_of_two_scale_applied_to_the_scores_changes_no_bit(monkeypatch, dtype, width):
    """Head sizes 16, 64 and 256 scale the attention scores by a power of two, which the static step applies in its
    bias add instead of to the query (a kernel less a layer): the scores, and so the output, bit for bit."""
    from types import SimpleNamespace

    from cohort.fastpath import attention

    g = torch.Generator().manual_seed(0)
    B, Hkv, rep, D, P, Tc = 2, 2, 3, 16, 5, 7
    n = B * width

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    prompt_kv = [(rand(B, Hkv, P, D), rand(B, Hkv, P, D))]
    mask = torch.ones(B, P, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    plan = attention.StepPlan(prompt_kv, mask, Tc, width)
    plan.step.fill_(4)
    plan.refresh()
    query, key, value = rand(n, Hkv * rep, 1, D), rand(n, Hkv, Tc, D), rand(n, Hkv, Tc, D)
    module = SimpleNamespace(layer_idx=0)
    assert attention.scales_exactly(D**-0.5) and not attention.scales_exactly(12**-0.5)
    folded = attention._step_decode(module, query, key, value, plan, None)
    monkeypatch.setattr(attention, "scales_exactly", lambda scaling: False)
    plain = attention._step_decode(module, query, key, value, plan, None)
    assert torch.equal(folded, plain)
