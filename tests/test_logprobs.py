"""completion_logprobs: grouped layout == padded layout == a naive full-logits loop (values and gradients)."""

from __future__ import annotations

import pytest
import torch
from _tiny import VOCAB, random_prompts, tiny_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from cohort import logprobs as lp_module
from cohort.fastpath import FastConfig, FastPathError, layouts, probes
from cohort.fastpath.attention import SegmentPlan, plan_of
from cohort.logprobs import LogProbs

G = 3

PATHS = {
    "segments": FastConfig(segments="on", grouped="on"),
    "dense_mask": FastConfig(segments="off", grouped="on"),
    "padded": FastConfig(segments="off", grouped="off"),
}
"""Switch settings that force each log-prob path."""

SMALL_SEGMENTS = FastConfig(segments_min_tokens=0)
"""These tests' groups are far below the size from which auto uses segment attention: lower it to 0, so
the default here is segments, and force the other paths explicitly where they are tested."""


def completion_logprobs(*args, fast=None, **kwargs):
    """Returns cohort's completion_logprobs, with SMALL_SEGMENTS unless `fast` is given."""
    return lp_module.completion_logprobs(*args, fast=SMALL_SEGMENTS if fast is None else fast, **kwargs)


def ragged_completions(n_rows: int, *, seed: int, max_len: int = 9, empties: bool = True) -> list[list[int]]:
    """Returns n_rows completions with lengths in [0 or 1, max_len], including lengths 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0 if empties else 1, max_len + 1, (n_rows,), generator=g).tolist()
    lengths[0], lengths[1] = max_len, 1
    if empties:
        lengths[-1] = 0
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def naive(model, prompts, completions, group_size, rows=None, temperature=1.0):
    """Loop reference: one full forward per row on prompt + completion, full [L, V] log_softmax."""
    rows = list(range(len(completions))) if rows is None else rows
    T = max(len(completions[r]) for r in rows)
    logp = torch.zeros(len(rows), T)
    entropy = torch.zeros(len(rows), T)
    for i, r in enumerate(rows):
        comp = completions[r]
        if not comp:
            continue
        prompt = prompts[r // group_size]
        logits = model(torch.tensor([prompt + comp])).logits[0].float() / temperature  # [L, V]
        all_logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]  # [len(comp), V]
        logp = logp.index_put(
            (torch.tensor([i]), torch.arange(len(comp))),
            all_logp.gather(-1, torch.tensor(comp)[:, None]).squeeze(-1),
        )
        ent = -(all_logp.exp() * all_logp).sum(-1)
        entropy = entropy.index_put((torch.tensor([i]), torch.arange(len(comp))), ent)
    return logp, entropy


def assert_grads_close(got: dict, ref: dict, what: str = "") -> None:
    """Float32 sums in a different order differ by ~1e-7 relative to the tensor's scale, not per element."""
    assert got.keys() == ref.keys()
    for name in ref:
        scale = ref[name].abs().max().item()
        err = (got[name] - ref[name]).abs().max().item()
        assert err <= 1e-5 * scale + 1e-8, f"{what} {name}: max error {err:.3g} vs scale {scale:.3g}"


def grads_of(model, fn) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    fn().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, logit_scale=3.0)


@pytest.fixture(scope="module")
def data():
    prompts = random_prompts(4, seed=11, min_len=1, max_len=12)
    completions = ragged_completions(4 * G, seed=12)
    return prompts, completions


# Attention implementation, and whether the grouped layout may use segment attention (sdpa only).
GROUPED_MODES = [("sdpa", True), ("sdpa", False), ("eager", False)]


def grouped_path(segments: bool) -> str:
    """Returns the grouped path under test: segment attention, or one dense block mask."""
    return "segments" if segments else "dense_mask"


@pytest.mark.parametrize(("attn", "segments"), GROUPED_MODES)
def test_grouped_equals_padded_equals_naive(attn, segments, data):
    model = tiny_model(seed=3, logit_scale=3.0, attn_implementation=attn)
    prompts, comps = data
    ref, _ = naive(model, prompts, comps, G)
    lengths = torch.tensor([len(c) for c in comps])
    for path in (grouped_path(segments), "padded"):
        out = completion_logprobs(model, prompts, comps, G, fast=PATHS[path])
        assert isinstance(out, LogProbs) and out.entropy is None and out.path == path and out.chunked_head
        assert out.logp.dtype == torch.float32 and out.logp.shape == (len(comps), lengths.max())
        assert torch.equal(out.mask, torch.arange(lengths.max())[None] < lengths[:, None])
        torch.testing.assert_close(out.logp, ref, rtol=0, atol=1e-5)
        assert (out.logp[~out.mask] == 0).all()
    assert probes.results(model).get("segments", False) is segments
    assert model.config._attn_implementation == attn  # switched back after the call


@pytest.mark.parametrize(("attn", "segments"), GROUPED_MODES)
def test_parameter_gradients_match(attn, segments, data):
    model = tiny_model(seed=3, logit_scale=3.0, attn_implementation=attn)
    prompts, comps = data
    w = torch.randn(len(comps), max(len(c) for c in comps), generator=torch.Generator().manual_seed(0))
    ref = grads_of(model, lambda: (naive(model, prompts, comps, G)[0] * w).sum())
    for path in (grouped_path(segments), "padded"):
        loss = lambda path=path: (  # noqa: E731
            completion_logprobs(model, prompts, comps, G, fast=PATHS[path], chunk_size=7).logp * w
        ).sum()
        got = grads_of(model, loss)
        assert_grads_close(got, ref, path)


def test_row_subsets_from_different_groups(model, data):
    prompts, comps = data
    full = completion_logprobs(model, prompts, comps, G)
    # Groups 0, 1 and 3; group 1 and group 3 with a single selected row; out of order; row 11 is empty.
    rows = [7, 0, 4, 2, 11, 9]
    sub = completion_logprobs(model, prompts, comps, G, rows=rows)
    T = max(len(comps[r]) for r in rows)
    torch.testing.assert_close(sub.logp, full.logp[rows, :T], rtol=0, atol=1e-5)
    assert torch.equal(sub.mask, full.mask[rows, :T])
    ref, _ = naive(model, prompts, comps, G, rows=rows)
    torch.testing.assert_close(sub.logp, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("path", ["segments", "dense_mask", "padded"])
def test_temperature_and_entropy(model, data, path):
    prompts, comps = data
    ref_logp, ref_ent = naive(model, prompts, comps, G, temperature=0.7)
    out = completion_logprobs(model, prompts, comps, G, temperature=0.7, with_entropy=True, fast=PATHS[path])
    torch.testing.assert_close(out.logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy, ref_ent, rtol=0, atol=1e-5)
    assert (out.entropy[out.mask] > 0).all() and (out.entropy[~out.mask] == 0).all()
    plain = completion_logprobs(model, prompts, comps, G, fast=PATHS[path])
    assert (plain.logp - out.logp)[out.mask].abs().min() > 1e-4  # the temperature is actually applied


def test_chunk_size_does_not_change_the_result(model, data):
    prompts, comps = data
    big = completion_logprobs(model, prompts, comps, G, with_entropy=True)
    for chunk in (1, 3, 16):
        small = completion_logprobs(model, prompts, comps, G, with_entropy=True, chunk_size=chunk)
        torch.testing.assert_close(small.logp, big.logp, rtol=0, atol=1e-6)
        torch.testing.assert_close(small.entropy, big.entropy, rtol=0, atol=1e-6)


def test_entropy_carries_no_gradient_and_leaves_logp_gradients_unchanged(model, data):
    prompts, comps = data
    ref = grads_of(model, lambda: naive(model, prompts, comps, G)[0].sum())
    out = {}

    def run():
        out["lp"] = completion_logprobs(model, prompts, comps, G, with_entropy=True, chunk_size=5)
        return out["lp"].logp.sum()

    assert_grads_close(grads_of(model, run), ref)
    assert not out["lp"].entropy.requires_grad


def test_backward_holds_vocab_sized_tensors_of_one_chunk_at_a_time():
    """With entropy on, the backward pass must not accumulate [m, V] tensors across chunks.

    Counts live vocabulary-sized tensors created by any operator (forward, recompute, backward): a
    differentiable entropy under checkpointing kept two per chunk alive until the backward ended.
    """
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    vocab, chunk = 2048, 4
    model = tiny_model(seed=0, hidden_size=32, vocab_size=vocab)
    prompts = random_prompts(2, seed=1)
    comps = ragged_completions(2 * G, seed=2, empties=False)
    live, peak = [0], [0]

    def dec():
        live[0] -= 1

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in result if isinstance(result, (tuple, list)) else [result]:
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == vocab and t.shape[0] > 1:
                    if t._base is None:  # views share their base's storage
                        live[0] += 1
                        peak[0] = max(peak[0], live[0])
                        weakref.finalize(t, dec)
            return result

    with Count():
        out = completion_logprobs(model, prompts, comps, G, chunk_size=chunk, with_entropy=True)
        out.logp.sum().backward()
    n_chunks = -(-int(out.mask.sum()) // chunk)
    assert n_chunks >= 8
    assert peak[0] <= 6, f"{peak[0]} vocabulary-sized tensors alive at once over {n_chunks} chunks"


@pytest.mark.parametrize("checkpointed", [True, False])
def test_backward_keeps_no_vocab_sized_tensor(checkpointed):
    """Autograd must not save [M, V] logits: each chunk's head + log-softmax is recomputed in backward."""
    vocab = 2048
    model = tiny_model(seed=0, hidden_size=32, vocab_size=vocab)
    prompts = random_prompts(2, seed=1)
    comps = ragged_completions(2 * G, seed=2, empties=False)
    # Positive control: a batch that fits in one chunk is not checkpointed, and its logits are saved.
    chunk = 8 if checkpointed else 10_000
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = completion_logprobs(model, prompts, comps, G, chunk_size=chunk, with_entropy=True)
    out.logp.sum().backward()
    vocab_sized = [shape for shape in saved if shape[-1] == vocab and len(shape) >= 2 and shape[0] > 1]
    assert (not vocab_sized) == checkpointed, vocab_sized


def test_one_chunk_is_not_recomputed_and_gives_the_chunked_gradients(model, data):
    """A batch whose logits fit in one chunk skips the recompute; gradients equal the checkpointed ones."""
    prompts, comps = data
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    def run(chunk):
        def loss():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                lp = completion_logprobs(model, prompts, comps, G, with_entropy=True, chunk_size=chunk)
            return (lp.logp * torch.linspace(-1, 1, lp.logp.shape[1])).sum()

        saved.clear()
        grads = grads_of(model, loss)
        return grads, any(s[-1] == VOCAB and len(s) >= 2 and s[0] > 1 for s in saved)

    one, one_saves_logits = run(10_000)
    many, many_saves_logits = run(3)
    assert one_saves_logits and not many_saves_logits
    assert_grads_close(one, many)


def test_empty_completions(model):
    prompts = [[4, 5], [6]]
    empty = completion_logprobs(model, prompts, [[], [], [], []], 2, with_entropy=True)
    assert empty.logp.shape == (4, 0) and empty.mask.shape == (4, 0) and empty.entropy.shape == (4, 0)
    some = completion_logprobs(model, prompts, [[], [3], [], []], 2)
    assert some.mask.tolist() == [[False], [True], [False], [False]]
    assert some.logp[1, 0] < 0 and (some.logp[[0, 2, 3]] == 0).all()


def test_grad_only_when_enabled(model, data):
    prompts, comps = data
    assert completion_logprobs(model, prompts, comps, G).logp.requires_grad
    with torch.no_grad():
        assert not completion_logprobs(model, prompts, comps, G).logp.requires_grad


@pytest.mark.parametrize("segments", [True, False])
def test_grouped_layout_computes_each_prompt_once(segments, data):
    """Tokens fed to the model: one copy of each prompt plus the completions (minus their last token)."""
    model = tiny_model(seed=3, logit_scale=3.0)
    prompts, comps = data
    seen = []
    hook = model.model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    try:
        completion_logprobs(model, prompts, comps, G, fast=PATHS[grouped_path(segments)])
    finally:
        hook.remove()
    n_groups_used = len({r // G for r, c in enumerate(comps) if c})
    real = sum(len(prompts[j]) for j in range(len(prompts)) if any(comps[j * G : (j + 1) * G]))
    real += sum(max(len(c) - 1, 0) for c in comps)
    rows, width = seen[-1]
    assert rows <= n_groups_used and rows * width >= real
    if segments:  # one packed row of exactly the real tokens: no padding, no repeated prompt
        assert (rows, width) == (1, real)
    assert rows * width < sum(len(prompts[r // G]) + len(c) for r, c in enumerate(comps) if c)


def test_split_groups_give_the_same_values_and_gradients(model):
    dense = PATHS["dense_mask"]
    group = 6  # many completions per short prompt: one long row per group is the costly layout
    prompts = random_prompts(2, seed=5, min_len=2, max_len=3)
    comps = ragged_completions(2 * group, seed=6, max_len=8, empties=False)
    ref_value = completion_logprobs(model, prompts, comps, group, fast=dense).logp
    w = torch.randn(ref_value.shape, generator=torch.Generator().manual_seed(2))
    ref = grads_of(
        model, lambda: (completion_logprobs(model, prompts, comps, group, fast=dense).logp * w).sum()
    )
    split = dense.replace(attention_slowdown=1e4)  # attention dominates: split the groups
    lay = layouts.grouped_layout(prompts, comps, group, range(len(comps)), 8, layouts.pair_cost(model, 1e4))
    pieces = {(r, g) for r, row in enumerate(lay.group) for g in row if g >= 0}
    assert len(pieces) > len(prompts)
    got_value = completion_logprobs(model, prompts, comps, group, fast=split).logp
    got = grads_of(
        model, lambda: (completion_logprobs(model, prompts, comps, group, fast=split).logp * w).sum()
    )
    torch.testing.assert_close(got_value, ref_value, rtol=0, atol=1e-5)
    assert_grads_close(got, ref)


def test_errors(model, data):
    prompts, comps = data
    with pytest.raises(TypeError, match="fast must be a cohort.fastpath.FastConfig"):
        completion_logprobs(model, prompts, comps, G, fast="padded")
    with pytest.raises(ValueError, match="fast.segments='sometimes' is not valid"):
        FastConfig(segments="sometimes").validate()
    with pytest.raises(ValueError, match="len\\(completion_ids\\) = 12"):
        completion_logprobs(model, prompts, comps, 2)
    with pytest.raises(ValueError, match="rows \\[12\\] out of range"):
        completion_logprobs(model, prompts, comps, G, rows=[0, 12])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        completion_logprobs(model, prompts, comps, G, temperature=0.0)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        completion_logprobs(model, [[]], [[3]], 1)


class _SoftcappedQwen2(Qwen2ForCausalLM):
    """A model that transforms logits after its head: the decoder + head split must not be used."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 5.0 * torch.tanh(out.logits / 5.0)
        return out


def test_falls_back_to_full_logits_when_the_head_split_is_wrong(data):
    base = tiny_model(seed=3, logit_scale=3.0)
    model = _SoftcappedQwen2(base.config)
    model.load_state_dict(base.state_dict())
    model.eval()
    prompts, comps = data
    with pytest.warns(UserWarning, match="full logits"):
        out = completion_logprobs(model, prompts, comps, G)
    assert not out.chunked_head and probes.results(model)["head_split"] is False
    with pytest.raises(FastPathError, match="chunked_head=on, but _SoftcappedQwen2 cannot take it"):
        completion_logprobs(model, prompts, comps, G, fast=FastConfig(chunked_head="on"))
    torch.testing.assert_close(out.logp, naive(model, prompts, comps, G)[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sliding_window_models_stay_exact_past_the_window(attn):
    """A dense 4D mask would bypass the window of sliding layers: segment attention applies it (sdpa);
    eager attention, which has no segments, falls back to the padded layout."""
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,  # layer 0 full, layer 1 sliding
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    prompts = random_prompts(2, seed=1, min_len=5, max_len=8)
    comps = ragged_completions(2 * G, seed=2, empties=False)
    if attn == "eager":
        with pytest.warns(UserWarning, match=r"exceed the model's sliding attention window \(4 tokens\)"):
            out = completion_logprobs(model, prompts, comps, G)
    else:
        out = completion_logprobs(model, prompts, comps, G)
        assert out.path == "segments" and probes.results(model)["segments_window"] is True
        w = torch.linspace(-1, 1, out.logp.shape[1])
        ours = grads_of(model, lambda: (completion_logprobs(model, prompts, comps, G).logp * w).sum())
        ref = grads_of(model, lambda: (naive(model, prompts, comps, G)[0] * w).sum())
        assert_grads_close(ours, ref, "windowed segments")
    torch.testing.assert_close(out.logp, naive(model, prompts, comps, G)[0], rtol=0, atol=1e-5)


def test_peft_lora_model(data):
    peft = pytest.importorskip("peft")
    model = tiny_model(seed=3, logit_scale=3.0)
    lora = peft.get_peft_model(
        model,
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    prompts, comps = data
    w = torch.randn(len(comps), max(len(c) for c in comps), generator=torch.Generator().manual_seed(1))
    ref_grads = grads_of(lora, lambda: (naive(lora, prompts, comps, G)[0] * w).sum())
    got_grads = grads_of(lora, lambda: (completion_logprobs(lora, prompts, comps, G).logp * w).sum())
    assert all("lora" in n for n in got_grads)
    assert_grads_close(got_grads, ref_grads)
    assert completion_logprobs(lora, prompts, comps, G).chunked_head  # the decoder + head split was used


def test_segments_only_for_groups_long_enough_to_gain(data):
    prompts, comps = data
    auto = FastConfig()
    assert layouts.widest_group(prompts, comps, G, range(len(comps))) < auto.segments_min_tokens
    model = tiny_model(seed=8)
    seen = []
    # Only 4-D masks: the once-per-model checks also run the decoder, with plain 2-D padding masks.
    hook = model.model.register_forward_pre_hook(
        lambda mod, args, kwargs: (
            seen.append(m) if (m := kwargs.get("attention_mask")) is not None and m.dim() == 4 else None
        ),
        with_kwargs=True,
    )
    try:
        short = completion_logprobs(model, prompts, comps, G, fast=auto)
        long_comps = [c * 30 for c in comps]  # groups of several hundred tokens
        long = completion_logprobs(model, prompts, long_comps, G, fast=auto)
    finally:
        hook.remove()
    assert seen[0].dim() == 4 and plan_of(seen[0]) is None  # the dense block mask
    assert isinstance(plan_of(seen[-1]), SegmentPlan)  # a segment plan on its carrier
    assert (short.path, long.path) == ("dense_mask", "segments")


@pytest.mark.parametrize(
    ("fast", "want"),
    [
        (FastConfig(segments_min_tokens=0), "padded"),  # auto: one padded row per completion on CUDA
        (
            FastConfig(segments_min_tokens=0, grouped_min_saving_cuda=0.2),
            "segments",
        ),  # these rows save enough
        (FastConfig(segments_min_tokens=0, grouped="on"), "segments"),  # asked for: still taken
        (FastConfig(grouped="on", segments="off"), "dense_mask"),
        (FastConfig(segments="on"), "segments"),
    ],
)
def test_on_cuda_auto_keeps_padded_rows_unless_grouping_saves_enough(monkeypatch, data, fast, want):
    # The layout is chosen from the model's device: seen as CUDA here, while the forwards run on this CPU.
    prompts, comps = data
    rows = list(range(len(comps)))
    model = tiny_model(seed=8)
    assert lp_module.grouping_pays(model, prompts, comps, G, rows, fast)  # always on a CPU
    padded = sum(len(prompts[r // G]) + len(comps[r]) for r in rows)
    grouped = sum(len(p) for p in prompts) + sum(len(c) for c in comps)
    assert 0.2 < 1 - grouped / padded < 0.5  # the saving these rows offer, between the two thresholds
    monkeypatch.setattr(lp_module, "input_device", lambda m: torch.device("cuda", 0))
    pays = lp_module.grouping_pays(model, prompts, comps, G, rows, fast)
    monkeypatch.undo()
    monkeypatch.setattr(lp_module, "grouping_pays", lambda *a: pays)
    assert lp_module.choose_path(model, prompts, comps, G, rows, fast) == want
    monkeypatch.undo()
    on_cpu = lp_module.choose_path(model, prompts, comps, G, rows, fast)
    assert on_cpu == ("segments" if fast.segments != "off" else "dense_mask")  # the CPU keeps grouping


def test_the_grouping_threshold_is_checked():
    for bad in (-0.1, 1.5, True, "half"):
        with pytest.raises(ValueError, match="fast.grouped_min_saving_cuda=.* must be a share in"):
            FastConfig(grouped_min_saving_cuda=bad).validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_default_update_takes_padded_rows_without_a_mask(data):
    prompts, comps = data
    model = tiny_model(seed=8).cuda()
    got = lp_module.completion_logprobs(model, prompts, comps, G, fast=FastConfig(segments_min_tokens=0))
    ref = lp_module.completion_logprobs(model.cpu(), prompts, comps, G, fast=PATHS["padded"])
    assert got.path == "padded" and got.unmasked and not ref.unmasked
    torch.testing.assert_close(got.logp.cpu(), ref.logp, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------- unmasked padding


def _mask_seen(model) -> tuple[list, object]:
    """Returns (the attention_mask of every decoder call from now on, the hook to remove)."""
    seen: list = []
    hook = model.model.register_forward_pre_hook(
        lambda m, a, k: seen.append(k.get("attention_mask")), with_kwargs=True
    )
    return seen, hook


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_unmasked_padded_rows_give_the_masked_log_probs_and_gradients(data, impl):
    # Rows are right-padded: under the causal mask no real token reads a pad, so dropping the mask changes nothing.
    prompts, comps = data
    model = tiny_model(seed=3, attn_implementation=impl).double()
    assert len({len(prompts[r // G]) + len(c) for r, c in enumerate(comps)}) > 1  # rows of unequal length
    out = {}
    for unmasked in ("off", "on"):
        model.zero_grad()
        seen, hook = _mask_seen(model)
        try:
            fast = FastConfig(grouped="off", unmasked_padding=unmasked)
            lp = completion_logprobs(model, prompts, comps, G, fast=fast, with_entropy=True)
        finally:
            hook.remove()
        assert lp.path == "padded" and lp.unmasked == (unmasked == "on")
        # the log-prob pass itself (after any probe): no mask tensor; sdpa's causal kernel asked for by the mapping
        # (cohort.fastpath.no_mask), eager attention handed None (None in the mapping would drop its causal mask)
        assert isinstance(seen[-1], torch.Tensor) == (unmasked == "off")
        if unmasked == "on":
            assert seen[-1] == ({"full_attention": None} if impl == "sdpa" else None)
        (lp.logp * lp.mask).sum().backward()
        out[unmasked] = lp, {n: p.grad.clone() for n, p in model.named_parameters()}
    (masked, masked_grad), (bare, bare_grad) = out["off"], out["on"]
    torch.testing.assert_close(bare.logp, masked.logp, rtol=0, atol=1e-10)
    torch.testing.assert_close(bare.entropy, masked.entropy, rtol=0, atol=1e-10)
    for name, g in masked_grad.items():
        torch.testing.assert_close(bare_grad[name], g, rtol=0, atol=1e-10)


def test_unmasked_padding_auto_is_taken_on_cuda_only(monkeypatch, data):
    prompts, comps = data
    model = tiny_model(seed=4)
    auto = FastConfig(grouped="off")
    assert not lp_module.choose_unmasked(model, auto)  # a CPU keeps its masked rows, bitwise as before
    assert lp_module.completion_logprobs(model, prompts, comps, G, fast=auto).unmasked is False
    assert lp_module._unmasked_unavailable(model) is None  # the probe, run here (on this CPU) and kept
    assert probes.results(model)["unmasked_padding"] is True
    monkeypatch.setattr(lp_module, "input_device", lambda m: torch.device("cuda", 0))
    assert lp_module.choose_unmasked(model, auto)
    assert not lp_module.choose_unmasked(model, auto.replace(unmasked_padding="off"))


def test_a_model_that_needs_its_attention_mask_keeps_it(monkeypatch, data):
    prompts, comps = data
    model = tiny_model(seed=5)

    def needs_a_mask(module, args, kwargs):
        if kwargs.get("attention_mask") is None:
            raise ValueError("this decoder needs its attention mask")

    hook = model.model.register_forward_pre_hook(needs_a_mask, with_kwargs=True)
    try:
        with pytest.raises(FastPathError) as e:
            completion_logprobs(
                model, prompts, comps, G, fast=FastConfig(grouped="off", unmasked_padding="on")
            )
        assert "fast.unmasked_padding=on" in str(e.value)
        assert "other log-probs without an attention mask" in str(e.value)
        assert "ValueError: this decoder needs its attention mask" in str(e.value)
        monkeypatch.setattr(lp_module, "input_device", lambda m: torch.device("cuda", 0))
        with pytest.warns(UserWarning, match="fast path 'unmasked_padding' off"):
            assert not lp_module.choose_unmasked(model, FastConfig())
        monkeypatch.undo()
        lp = completion_logprobs(model, prompts, comps, G, fast=FastConfig(grouped="off"))
        assert lp.path == "padded" and not lp.unmasked
    finally:
        hook.remove()


def test_on_cuda_a_pass_keeps_the_layout_it_was_planned_for(monkeypatch, data):
    # Micro-batches are planned against a token budget for one layout; on CUDA, auto weighs grouping per set of
    # rows, so the pass's choice is pinned for every micro-batch of it.
    prompts, comps = data
    model = tiny_model(seed=8)
    rows = list(range(len(comps)))
    fast = FastConfig(grouped_min_saving_cuda=0.2, segments="off")
    on_cpu = lp_module.pass_layout(model, prompts, comps, G, rows, fast)
    assert not on_cpu.padded and on_cpu.fast is fast  # a CPU's switches are left as given
    monkeypatch.setattr(lp_module, "input_device", lambda m: torch.device("cuda", 0))
    grouped = lp_module.pass_layout(model, prompts, comps, G, rows, fast)
    assert not grouped.padded and grouped.fast.grouped_min_saving_cuda == 0
    one_per_group = rows[::G]  # saves nothing on its own: auto alone would lay these out padded
    assert lp_module.choose_path(model, prompts, comps, G, one_per_group, fast) == "padded"
    assert lp_module.choose_path(model, prompts, comps, G, one_per_group, grouped.fast) == "dense_mask"
    padded = lp_module.pass_layout(model, prompts, comps, G, rows, fast.replace(grouped_min_saving_cuda=0.9))
    assert padded.padded and padded.fast.grouped == "off"
    assert lp_module.pass_layout(model, prompts, comps, G, [], fast).fast is fast
