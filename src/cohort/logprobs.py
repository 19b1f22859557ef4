"""Per-token log-probs of completion tokens: which path computes them, and the computation itself.

Three paths give the same numbers (checked per model, and by the tests to float64 precision):
- "segments": all groups in one packed row of exactly the real tokens, each prompt once, attention
  regrouped per prompt and per completion (`cohort.fastpath.attention`);
- "dense_mask": each group's prompt once followed by its completions, in packed rows with a dense
  block mask (`cohort.fastpath.layouts`);
- "padded": one right-padded prompt + completion row per completion, the reference.
`choose_path` picks one from the `fast` switches (`cohort.fastpath.FastConfig`): segments when some group is
long enough to repay them, else the dense mask; the padded layout when the model's attention
implementation takes no custom mask (flash-attention, flex-attention) or its sliding window would be
dropped. Either way the LM head runs only on the hidden states that predict completion tokens
(`cohort.fastpath.lm_head`), unless the model does not split into decoder and head.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from cohort.fastpath import FastConfig, probes
from cohort.fastpath import compiled as compiled_forward
from cohort.fastpath.attention import NAME as ATTENTION_NAME
from cohort.fastpath.attention import attention_held, build_plan, plan_attention, plan_carrier
from cohort.fastpath.layouts import block_mask, grouped_layout, padded_layout, pair_cost, widest_group
from cohort.fastpath.lm_head import chunk_rows, chunked_logprobs, head_unavailable, split_model, unwrap
from cohort.fastpath.no_mask import no_mask
from cohort.fastpath.switches import choose
from cohort.models import float_dtype, full_attention_span, input_device, text_config
from cohort.runtime.sharding import is_sharded
from cohort.runtime.transfer import long_tensors, to_device

PATHS = ("segments", "dense_mask", "padded")
"""The layouts a LogProbs can come from (LogProbs.path)."""


@dataclass
class LogProbs:
    """Per-token log-probs of the selected completions, padded to the longest one."""

    logp: torch.Tensor
    """[n, T] float32 (float64 for a float64 model): log_softmax(logits / temperature) at each completion
    token; 0 where masked."""
    mask: torch.Tensor
    """[n, T] bool: True at real completion tokens."""
    entropy: torch.Tensor | None = None
    """[n, T] entropy of the predictive distribution (logits / temperature), logp's dtype; 0 where masked.
    Carries no gradient."""
    sum_pi_squared: torch.Tensor | None = None
    """[n, T] sum_v pi(v)^2 of the predictive distribution (logits / temperature) when asked for (the Optimal
    Token Baseline's variance proxy), logp's dtype; 0 where masked. Carries no gradient."""
    topk_logp: torch.Tensor | None = None
    """[n, T, K] the log-probs log_softmax(logits / temperature) at the K token ids asked for per completion
    token (`topk_ids`; DPPO's top-K divergence), logp's dtype; 0 where masked. Carries no gradient."""
    path: str = "padded"
    """The layout that computed them: segments, dense_mask or padded (see PATHS)."""
    chunked_head: bool = False
    """Whether the LM head ran in chunks on the predicting hidden states only (False: full logits)."""
    unmasked: bool = False
    """Whether padded rows ran without an attention mask (fast.unmasked_padding; False on the grouped paths)."""
    compiled: bool = False
    """Whether the decoder's forward ran through torch.compile (fast.compile_update)."""
    layout_tokens: int = 0
    """Tokens the forward ran on: rows x length of the layout, padding included (what micro_batch_tokens bounds)."""


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    group_size: int,
    *,
    rows: Sequence[int] | None = None,
    temperature: float = 1.0,
    with_entropy: bool | str = False,
    chunk_size: int = 1024,
    fast: FastConfig | None = None,
    with_sum_pi_squared: bool = False,
    topk_ids: Sequence[torch.Tensor] | None = None,
) -> LogProbs:
    """Returns LogProbs ([n, T]) of the completion tokens of `rows` (all rows if None), in that order.

    Row r belongs to prompt r // group_size. Differentiable when grad is enabled. `fast` switches the
    paths (default: all auto); `FastConfig.all("off")` gives the plain reference computation.
    `with_entropy="grad"` makes the entropy differentiable too (entropy regularisation).
    `with_sum_pi_squared` adds sum_v pi(v)^2 per token, computed inside the (chunked) LM head.
    `topk_ids`, one LongTensor [T_r, K] per completion (aligned with completion_ids, read for `rows` only), adds
    LogProbs.topk_logp: the log-probs at those ids, gathered inside the (chunked) LM head, so no [n, T, V]
    logits are kept.
    """
    fast = FastConfig() if fast is None else fast
    sel = _validate(prompt_ids, completion_ids, group_size, rows, temperature, chunk_size, fast)
    path = choose_path(model, prompt_ids, completion_ids, group_size, sel, fast)
    chunked = choose(fast.chunked_head, "chunked_head", model, unavailable=lambda: head_unavailable(model))
    unmasked = path == "padded" and choose_unmasked(model, fast)
    compiled = path == "padded" and choose_compiled(model, fast, unmasked=unmasked, chunked=chunked)
    return compute_logprobs(
        model,
        prompt_ids,
        completion_ids,
        group_size,
        sel,
        temperature,
        with_entropy,
        chunk_size,
        path,
        chunked=chunked,
        fast=fast,
        with_sum_pi_squared=with_sum_pi_squared,
        topk_ids=topk_ids,
        unmasked=unmasked,
        compiled=compiled,
    )


@dataclass(frozen=True)
class PassLayout:
    """The layout family one pass over a set of rows takes, decided once for all its micro-batches."""

    padded: bool
    """Whether its micro-batches are one right-padded row per completion (else the grouped layouts): how their
    token budget is counted."""
    fast: FastConfig
    """The switches each micro-batch runs with, so that none leaves the family planned for it."""


def pass_layout(
    model, prompt_ids, completion_ids, group_size, rows: Sequence[int], fast: FastConfig
) -> PassLayout:
    """Returns the PassLayout of a pass over `rows`: the layout `choose_path` takes for them all, and the switches
    that hold every micro-batch of the pass to it.

    Micro-batches are planned against a token budget before each computes its log-probs; a micro-batch that
    took padded rows where grouped ones were planned would overrun the budget by the prompts' repeats. On CUDA,
    `auto` weighs grouping per set of rows (grouping_pays), so the pass's answer is pinned: padded rows for all
    (grouped=off) or grouping for all (grouped_min_saving_cuda=0). Elsewhere a micro-batch's choice can only
    move towards fewer tokens (a shorter longest row keeps a sliding window), and the switches stay as given."""
    sel = list(rows)
    if not sel:
        return PassLayout(False, fast)
    path = choose_path(model, prompt_ids, completion_ids, group_size, sel, fast)
    if fast.grouped == "auto" and input_device(model).type == "cuda":
        if path == "padded" and fast.segments != "on":
            fast = fast.replace(grouped="off", segments="off")
        elif path != "padded" and fast.grouped_min_saving_cuda > 0:
            fast = fast.replace(grouped_min_saving_cuda=0.0)
    return PassLayout(path == "padded", fast)


def choose_unmasked(model, fast: FastConfig) -> bool:
    """Returns whether padded rows run without an attention mask on `model` (fast.unmasked_padding): under auto on
    CUDA only, once a probe on the model has shown the same log-probs with and without the mask."""
    return choose(
        fast.unmasked_padding,
        "unmasked_padding",
        model,
        worth=input_device(model).type == "cuda",
        unavailable=lambda: _unmasked_unavailable(model),
    )


def choose_compiled(model, fast: FastConfig, *, unmasked: bool, chunked: bool) -> bool:
    """Returns whether padded rows' decoder forward runs through torch.compile on `model` (fast.compile_update):
    under auto on CUDA only, with the chunked head's split and unmasked rows, once a probe has shown the eager
    forward's log-probs."""
    return choose(
        fast.compile_update,
        "compile_update",
        model,
        worth=input_device(model).type == "cuda",
        unavailable=lambda: _compile_unavailable(model, unmasked=unmasked, chunked=chunked),
    )


def grouping_pays(model, prompt_ids, completion_ids, group_size, sel, fast: FastConfig) -> bool:
    """Returns whether `auto` lays each group's prompt out once for these rows (the grouped layouts): always off
    CUDA; on CUDA when that saves at least `fast.grouped_min_saving_cuda` of the tokens.

    They save FLOPs at the cost of more, smaller kernels of changing shapes: a CPU's trade. On a GPU at the
    sizes measured the update waits on the host instead (an H200, Qwen2.5-0.5B's shape in bf16, grouping saving
    a third of the tokens: a GRPO step of 2.34 s with padded rows against 5.15 s grouped; docs/performance.md)."""
    if input_device(model).type != "cuda":
        return True
    padded = sum(len(prompt_ids[r // group_size]) + len(completion_ids[r]) for r in sel)
    grouped = sum(len(prompt_ids[g]) for g in {r // group_size for r in sel}) + sum(
        len(completion_ids[r]) for r in sel
    )
    return padded > 0 and 1 - grouped / padded >= fast.grouped_min_saving_cuda


def choose_path(model, prompt_ids, completion_ids, group_size, sel, fast: FastConfig) -> str:
    """Returns the path ("segments", "dense_mask" or "padded") that computes these rows' log-probs."""
    impl = _impl(model)
    # A dense 4-D mask reaches sliding-window layers unchanged (their window dropped): exact only while no
    # sequence is longer than the window. Segment attention applies the window itself.
    span = full_attention_span(model)
    window = None
    if span is not None:
        longest = max((len(prompt_ids[r // group_size]) + len(completion_ids[r]) for r in sel), default=0)
        window = span if longest > span else None
    grouped_pays = fast.grouped != "off" and grouping_pays(
        model, prompt_ids, completion_ids, group_size, sel, fast
    )
    if fast.grouped != "off":
        wide = (
            window is not None
            or widest_group(prompt_ids, completion_ids, group_size, sel) >= fast.segments_min_tokens
        )
        if choose(
            fast.segments,
            "segments",
            model,
            worth=wide and (grouped_pays or fast.grouped == "on"),
            unavailable=lambda: _segments_unavailable(model, impl, window),
        ):
            return "segments"

    def dense_unavailable() -> str | None:
        if impl not in ("sdpa", "eager"):
            return f"attention implementation {impl!r} takes no custom 4-D mask (use 'sdpa' or 'eager')"
        if window is not None:
            return (
                f"sequences exceed the model's sliding attention window ({span} tokens), which a dense mask "
                "would drop, and segment attention is not in use"
            )
        return None

    dense = choose(fast.grouped, "grouped", model, worth=grouped_pays, unavailable=dense_unavailable)
    return "dense_mask" if dense else "padded"


def compute_logprobs(
    model,
    prompt_ids,
    completion_ids,
    group_size,
    sel,
    temperature,
    with_entropy,
    chunk_size,
    path,
    *,
    chunked: bool = True,
    fast: FastConfig | None = None,
    with_sum_pi_squared: bool = False,
    topk_ids: Sequence[torch.Tensor] | None = None,
    unmasked: bool = False,
    compiled: bool = False,
) -> LogProbs:
    """Returns LogProbs of rows `sel` computed along `path`, with the chunked LM head when `chunked` (`topk_ids`:
    as in completion_logprobs); `unmasked` runs padded rows without an attention mask, `compiled` (with both)
    their decoder forward through torch.compile."""
    fast = FastConfig() if fast is None else fast
    device = input_device(model)
    lengths = torch.tensor([len(completion_ids[r]) for r in sel], dtype=torch.long)  # [n]
    n, T = len(sel), int(lengths.max()) if sel else 0
    mask = to_device(torch.arange(T)[None, :] < lengths[:, None], device)  # [n, T]
    K = _topk_width(topk_ids, completion_ids, sel)
    if T == 0:
        empty = torch.zeros(n, 0, dtype=torch.promote_types(float_dtype(model), torch.float32), device=device)
        return LogProbs(
            empty,
            mask,
            empty.clone() if with_entropy else None,
            empty.clone() if with_sum_pi_squared else None,
            empty.new_zeros(n, 0, K) if topk_ids is not None else None,
            path,
            chunked,
            unmasked and path == "padded",
        )
    compiled = compiled and unmasked and chunked and path == "padded"

    parts = split_model(model) if chunked else None
    if path == "segments":
        lay = grouped_layout(prompt_ids, completion_ids, group_size, sel, T, one_row=True)
    elif path == "padded":
        lay = padded_layout(prompt_ids, completion_ids, group_size, sel, T)
    else:
        cost = pair_cost(model, fast.attention_slowdown)
        lay = grouped_layout(prompt_ids, completion_ids, group_size, sel, T, cost)
    # Right padding: under the causal mask no real token attends to a pad after it, so the mask changes nothing
    # the loss reads; without it attention runs its causal kernel and no mask is built.
    masked = path == "padded" and not unmasked
    # input_ids, position_ids [R, L]; source [M] index into R*L; target [M]; dest [M] index into n*T; the mask
    moved = long_tensors(
        [lay.input_ids, lay.position_ids, lay.source, lay.target, lay.dest]
        + ([lay.attention_mask] if masked else []),
        device,
    )
    input_ids, position_ids, source, target, dest = moved[:5]
    attn: torch.Tensor | dict[str, None] | None
    if path == "segments":
        assert lay.prompt_pos is not None and lay.body_pos is not None  # set by grouped_layout
        attn = plan_carrier(device, build_plan(lay.prompt_pos, lay.body_pos, device, lay.position_ids[0]))
    elif path == "padded":
        # [R, L]; unmasked: what skips transformers' own mask-making, which waited for the device every forward
        # (a sharded model's processes make no extra forward calls: they must pair up)
        decoder = parts[0] if parts is not None else model
        attn = moved[5] if masked else (None if is_sharded(model) else no_mask(decoder))
    else:
        eager = getattr(text_config(model), "_attn_implementation", None) == "eager"
        attn = block_mask(lay, device, eager, float_dtype(model))  # [R, 1, L, L]: bool, or additive for eager

    if compiled and parts is not None:
        hidden_or_logits = compiled_forward.hidden_states(
            parts[0], input_ids, position_ids, attn, model=model
        )
    else:
        with plan_attention(model) if path == "segments" else contextlib.nullcontext():
            hidden_or_logits = _forward(model, parts, input_ids, attn, position_ids)
    picked = hidden_or_logits.reshape(-1, hidden_or_logits.shape[-1]).index_select(0, source)  # [M, H or V]
    head = parts[1] if parts is not None else None
    vocab = (
        cast(torch.Tensor, head.weight).shape[0]
        if head is not None and hasattr(head, "weight")
        else picked.shape[-1]
    )
    chunk_mib = fast.head_chunk_mib if picked.device.type == "cpu" else fast.head_chunk_mib_accelerator
    rows_per_chunk = chunk_rows(vocab, picked.device, chunk_size, chunk_mib)
    if is_sharded(model):
        # One call of the head's FSDP unit per pass: its all-gather (and reduce-scatter) is a collective every
        # process must join, and processes hold different numbers of tokens. Logits of the completion tokens only.
        rows_per_chunk = max(picked.shape[0], 1)
    top_ids = None
    if topk_ids is not None:
        padded = torch.zeros(n, T, K, dtype=torch.long, device=device)  # [n, T, K]
        for i, r in enumerate(sel):
            padded[i, : len(completion_ids[r])] = topk_ids[r].to(device=device, dtype=torch.long)
        top_ids = padded.view(n * T, K).index_select(0, dest)  # [M, K], in the order of `target`
    logp, entropy, square, top = chunked_logprobs(
        head, picked, target, temperature, with_entropy, rows_per_chunk, with_sum_pi_squared, top_ids
    )  # [M] each; top [M, K]
    flat = torch.zeros(n * T, dtype=logp.dtype, device=device)  # [n*T]
    logp_out = flat.index_copy(0, dest, logp).view(n, T)  # [n, T]
    ent_out = flat.index_copy(0, dest, entropy).view(n, T) if entropy is not None else None  # [n, T]
    sq_out = (
        flat.index_copy(0, dest, square.to(logp.dtype)).view(n, T) if square is not None else None
    )  # [n, T]
    top_out = None
    if top is not None:
        top_flat = torch.zeros(n * T, K, dtype=logp.dtype, device=device)  # [n*T, K]
        top_out = top_flat.index_copy(0, dest, top.to(logp.dtype)).view(n, T, K)  # [n, T, K]
    return LogProbs(
        logp_out,
        mask,
        ent_out,
        sq_out,
        top_out,
        path,
        parts is not None,
        unmasked and path == "padded",
        compiled and parts is not None and compiled_forward.failed(parts[0]) is None,
        int(input_ids.numel()),
    )


def _topk_width(topk_ids, completion_ids, sel) -> int:
    """Returns K of `topk_ids` (0 without them); raises ValueError when a selected row's ids are not [T_r, K]."""
    if topk_ids is None:
        return 0
    if len(topk_ids) != len(completion_ids):
        raise ValueError(
            f"topk_ids has {len(topk_ids)} rows for {len(completion_ids)} completions; pass one [T_r, K] tensor per "
            "completion"
        )
    K = int(topk_ids[sel[0]].shape[-1]) if sel and topk_ids[sel[0]].dim() > 0 else 0
    for r in sel:
        t = topk_ids[r]
        if t.dim() != 2 or t.shape != (len(completion_ids[r]), K) or t.is_floating_point():
            raise ValueError(
                f"topk_ids[{r}] must be an integer tensor of shape [{len(completion_ids[r])}, {K}] (K ids per "
                f"completion token, the same K for every row), got {t.dtype} of shape {tuple(t.shape)}"
            )
    return K


def _impl(model: torch.nn.Module) -> str | None:
    """Returns the model's attention implementation; cohort's own counts as sdpa (it is sdpa for plain masks)."""
    impl = getattr(text_config(model), "_attn_implementation", None)
    return "sdpa" if impl == ATTENTION_NAME else impl


def warm_probes(model: torch.nn.Module, fast: FastConfig) -> None:
    """Runs now the once-per-model checks the log-prob paths may need (the head split, segment attention).

    A sharded model's processes must run them together: left to the first update, they would run on one process
    and not on another that has no rows. Each makes the same forward calls, so every FSDP unit's all-gather
    pairs up across processes, and no process gathers the whole model for them."""
    if fast.chunked_head != "off":
        head_unavailable(model)
    impl = _impl(model)
    # Wherever a batch may take the grouped layout (on CUDA under auto, one that saves enough tokens).
    may_group = input_device(model).type != "cuda" or fast.grouped_min_saving_cuda < 1
    grouped = fast.grouped == "on" or (fast.grouped == "auto" and may_group)
    if fast.unmasked_padding == "on" or (
        fast.unmasked_padding == "auto" and input_device(model).type == "cuda"
    ):
        _unmasked_unavailable(model)
    if grouped and fast.segments != "off" and impl == "sdpa":
        _segments_unavailable(model, impl, None)
        span = full_attention_span(model)
        if span is not None:
            _segments_unavailable(model, impl, span)


def _forward(model, parts, input_ids, attn, position_ids) -> torch.Tensor:
    """Returns the decoder's last hidden states [R, L, H] when the model splits, else its logits [R, L, V]."""
    if parts is None:
        return model(
            input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=False
        ).logits
    out = parts[0](input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


# --------------------------------------------------------------------------------------------- checks


def _segments_unavailable(model: torch.nn.Module, impl: str | None, window: int | None) -> str | None:
    """Returns why segment attention cannot compute this model's log-probs (None: it can).

    Checked once per model on two small groups, and once more, with sequences longer than the window,
    before it is trusted with a sliding window. Models whose forward does not hand a pre-built 4-D mask to
    its layers, that transform attention beyond sdpa's math, or keep their window to themselves fail the
    check. With gradient checkpointing on, the backward pass re-runs layers after the attention function
    has been switched back, so segments are not used then.
    """
    if impl != "sdpa":
        return f"attention implementation {impl!r} (segment attention replaces 'sdpa')"
    inner = unwrap(model)
    if _checkpointing(inner) and torch.is_grad_enabled() and not attention_held(model):
        # Outside cohort's update, the backward would recompute layers after the attention switch is undone
        # (without gradients nothing is recomputed: a reference copy or π_old pass may take segments).
        return "gradient checkpointing is on (its recomputation would run plain attention)"
    # A transformers model's method, which nn.Module's __getattr__ types as Tensor | Module:
    vocab = inner.get_input_embeddings().weight.shape[0]  # type: ignore[operator]
    prompts = [[t % vocab for t in (1, 2, 3)], [t % vocab for t in (4, 5)]]
    comps = [[t % vocab for t in c] for c in ([6, 7, 8], [9], [10, 11], [12] * 4)]
    if not _segments_match(model, "segments", prompts, comps):
        return probes.failure(
            model, "segments", "segment attention does not reproduce the padded layout's log-probs"
        )
    if window is None:
        return None
    if not window:
        return "its chunked or linear attention layers have no window segment attention can apply"
    # A prompt and a completion that each outrun the window, so both kinds of problem are windowed.
    prompts = [[2 + t % (vocab - 2) for t in range(window + 2)], [4 % vocab, 5 % vocab]]
    comps = [[6 % vocab] * 3, [9 % vocab], [10 % vocab] * 2, [12 % vocab] * (window + 3)]
    if not _segments_match(model, "segments_window", prompts, comps):
        return probes.failure(
            model,
            "segments_window",
            "segment attention does not reproduce its log-probs past its sliding window",
        )
    return None


def _unmasked_unavailable(model: torch.nn.Module) -> str | None:
    """Returns why padded rows cannot drop their attention mask on this model (None: they can).

    Checked once per model on rows of unequal length: a model whose attention is not causal over the whole
    sequence (a bidirectional prefix, a mask it needs to be handed) gives other log-probs, or fails, without it."""
    args = _uneven_padded_rows(model)

    def run(unmasked: bool):
        return lambda: compute_logprobs(*args, chunked=False, unmasked=unmasked).logp

    if probes.probe(model, "unmasked_padding", run(True), run(False)):
        return None
    return probes.failure(
        model, "unmasked_padding", "its padded rows give other log-probs without an attention mask"
    )


def _uneven_padded_rows(model: torch.nn.Module) -> tuple:
    """Returns compute_logprobs's positional arguments up to the path for the padded-row probes: two groups of two
    whose rows differ in length, so that some are padded."""
    vocab = unwrap(model).get_input_embeddings().weight.shape[0]  # type: ignore[operator]
    prompts = [[t % vocab for t in (1, 2, 3, 4, 5)], [t % vocab for t in (6, 7)]]
    comps = [[t % vocab for t in c] for c in ([8, 9, 10], [11], [12, 13, 14, 15, 16, 17], [18, 19])]
    return (model, prompts, comps, 2, [0, 1, 2, 3], 1.0, False, 1024, "padded")


def _checkpointing(inner: torch.nn.Module) -> bool:
    """Returns whether gradient checkpointing is on for a transformers model (by the name its version uses)."""
    flag = (
        "is_activation_checkpointing"
        if hasattr(type(inner), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    return bool(getattr(inner, flag, False))


def _compile_unavailable(model: torch.nn.Module, *, unmasked: bool, chunked: bool) -> str | None:
    """Returns why padded rows' decoder forward cannot run through torch.compile on this model (None: it can)."""
    if is_sharded(model):
        return "the model is sharded (each FSDP unit gathers its weights inside the forward)"
    inner = unwrap(model)
    if _checkpointing(inner):
        return "gradient checkpointing is on (model.gradient_checkpointing)"
    if not chunked:
        return (
            "it compiles the decoder of the chunked LM head's split, which is not in use (fast.chunked_head)"
        )
    if not unmasked:
        return (
            "it compiles padded rows without an attention mask, which are not in use here (fast.unmasked_padding: "
            "auto takes them on CUDA only; set it to on)"
        )
    parts = split_model(model)
    if parts is None:
        return "its decoder and LM head could not be told apart (the compiled forward is the decoder's)"
    args = _uneven_padded_rows(model)

    def run(compiled: bool):
        def go():
            lp = compute_logprobs(*args, chunked=True, unmasked=True, compiled=compiled)
            if compiled and not lp.compiled:
                raise RuntimeError("it did not compile")
            return lp.logp

        return go

    # The backward is checked with gradients on and under the caller's autocast (what the update's trace will be:
    # AOTAutograd may compile the backward only at the first backward, where a failure would have no fallback).
    device_type = input_device(model).type
    amp = torch.is_autocast_enabled(device_type)
    amp_dtype = torch.get_autocast_dtype(device_type) if amp else None
    trained = [p for p in parts[0].parameters() if p.requires_grad]
    watched = trained if len(trained) <= 8 else trained[:4] + trained[-4:]

    def gradients(compiled: bool):
        def go():
            with torch.enable_grad(), torch.autocast(device_type, dtype=amp_dtype, enabled=amp):
                lp = compute_logprobs(*args, chunked=True, unmasked=True, compiled=compiled)
                if compiled and not lp.compiled:
                    raise RuntimeError("it did not compile")
                if not watched:
                    return lp.logp.detach()
                grads = torch.autograd.grad((lp.logp * lp.mask).sum(), watched, allow_unused=True)
            return tuple(torch.zeros(()) if g is None else g.float() for g in grads)

        return go

    def probe() -> str | None:
        if not probes.probe(model, "compile_update", run(True), run(False)):
            return probes.failure(
                model, "compile_update", "its compiled forward gives other log-probs than the eager one"
            )
        # Under bf16 autocast inductor keeps fused pointwise chains in float32 where eager rounds after each op:
        # the two differ by bf16 rounding, at the gradients' own scale.
        backward = probes.probe(
            model,
            "compile_update_backward",
            gradients(True),
            gradients(False),
            agree=probes.scaled_close,
            compute=amp_dtype,
        )
        if not backward:
            return probes.failure(
                model,
                "compile_update_backward",
                "its compiled backward gives other gradients than the eager one",
            )
        return None

    return compiled_forward.UPDATE_FORWARD.unavailable(parts[0], probe)


def _segments_match(model, name: str, prompts, comps) -> bool:
    """Returns whether segments give the padded layout's log-probs on two groups of two (a probe)."""
    args = (model, prompts, comps, 2, [0, 1, 2, 3], 1.0, False, 1024)

    def run(path):
        return lambda: compute_logprobs(*args, path, chunked=False).logp

    return probes.probe(model, name, run("segments"), run("padded"))


def _validate(prompt_ids, completion_ids, group_size, rows, temperature, chunk_size, fast) -> list[int]:
    """Returns the selected row indices; raises a clear error for any malformed argument."""
    if not isinstance(fast, FastConfig):
        raise TypeError(f"fast must be a cohort.fastpath.FastConfig, got {type(fast).__name__}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if len(completion_ids) != len(prompt_ids) * group_size:
        raise ValueError(
            f"len(completion_ids) = {len(completion_ids)} but len(prompt_ids) * group_size = "
            f"{len(prompt_ids)} * {group_size}; pass the B unique prompts and their B*G completions "
            "(group-contiguous)"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; use 1.0 for the raw logits")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    n_rows = len(completion_ids)
    sel = list(range(n_rows)) if rows is None else [int(r) for r in rows]
    bad = [r for r in sel if not 0 <= r < n_rows]
    if bad:
        raise ValueError(f"rows {bad[:5]} out of range: there are {n_rows} completions (0..{n_rows - 1})")
    for r in sel:
        if len(completion_ids[r]) > 0 and len(prompt_ids[r // group_size]) == 0:
            raise ValueError(
                f"prompt {r // group_size} is empty; a completion needs at least one prompt token "
                "to be predicted from (prepend a BOS token)"
            )
    return sel
