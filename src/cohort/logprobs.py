"""Per-token log-probs of completion tokens, computed so that [B, T, V] never materialises.

Two layouts of the same computation:

- "grouped" (default): each prompt appears once, followed by its selected completions, and position
  ids restart at the prompt length for every completion, so each token sees exactly the context it
  has in a plain prompt+completion row. The prompt's activations are computed once and receive the
  gradients of all its completions. With sdpa attention and groups of SEGMENTS_MIN_TOKENS or more,
  all groups share one packed row of exactly the real tokens and attention is regrouped per prompt
  and per completion (`cohort.attention`: segment attention, checked once per model). Otherwise
  (small groups, eager attention, gradient checkpointing, a model that fails that check) a dense
  block mask over packed rows lets every completion see its prompt and itself only; since a dense
  mask pays for masked (query, key) pairs too, a group whose single row would make attention
  dominate is split into pieces that each repeat the prompt, the width chosen by a FLOP estimate
  from the config (see `_plan_rows`).
- "padded": one right-padded prompt+completion row per completion; the reference, and the fallback
  for attention implementations that cannot take a custom mask (flash-attention, flex-attention)
  or for models with sliding-window layers.

Either way the LM head runs only on the hidden states that predict completion tokens, in chunks of
`chunk_size` rows; under autograd each chunk is checkpointed, so the backward pass recomputes one
chunk's logits at a time instead of keeping all of them.
"""

from __future__ import annotations

import bisect
import contextlib
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from cohort.attention import build_plan, custom_attention, plan_masks
from cohort.models import (
    attention_shape,
    check_tolerance,
    eval_mode,
    float_dtype,
    full_attention_span,
    input_device,
    text_config,
)

LAYOUTS = ("grouped", "padded")
_CHUNK_BYTES = {"cpu": 32 << 20}
"""float32 logits held per LM-head chunk, by device type. Every chunk reads the whole head matrix, so
on a GPU (whose matmuls need ~300 FLOPs per byte read to be compute-bound) chunks are larger."""
_CHUNK_BYTES_ACCELERATOR = 256 << 20
SEGMENTS_MIN_TOKENS = 256
"""Segment attention is used when some group (its prompt + its completions) has at least this many tokens.
Shorter groups waste little under a dense block mask, and there the mask's single kernel call beats the
segments' gathers: measured on the demo (groups of ~60 tokens) 2-4 % faster per step with the mask;
on workload (b) (groups of ~600 tokens) segments are 20-25 % faster."""
ATTENTION_SLOWDOWN = 1.4
"""How much slower a masked attention FLOP is than a projection FLOP (row planning of the grouped layout).

Measured with sdpa forward + backward against a linear layer (2 CPU threads, torch 2.13): 1.3-1.5."""


@dataclass
class LogProbs:
    """Per-token log-probs of the selected completions, padded to the longest one."""

    logp: torch.Tensor
    """[n, T] float32: log_softmax(logits / temperature) at each completion token; 0 where masked."""
    mask: torch.Tensor
    """[n, T] bool: True at real completion tokens."""
    entropy: torch.Tensor | None = None
    """[n, T] float32 entropy of the predictive distribution (logits / temperature); 0 where masked.
    Carries no gradient."""


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    group_size: int,
    *,
    rows: Sequence[int] | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 1024,
    layout: str = "grouped",
) -> LogProbs:
    """Returns LogProbs ([n, T]) of the completion tokens of `rows` (all rows if None), in that order.

    Row r belongs to prompt r // group_size. Differentiable when grad is enabled.
    """
    sel = _validate(prompt_ids, completion_ids, group_size, rows, temperature, chunk_size, layout)
    mode = "padded"
    if layout == "grouped":
        kind = _custom_mask_kind(model)
        # A dense 4-D mask reaches sliding-window layers unchanged (their window dropped): exact only while
        # no sequence is longer than the window. Segment attention applies the window itself.
        span = full_attention_span(model)
        window = None
        if span is not None:
            longest = max((len(prompt_ids[r // group_size]) + len(completion_ids[r]) for r in sel), default=0)
            window = span if longest > span else None
        if (
            kind == "bool"
            and (window is not None or _widest_group(prompt_ids, completion_ids, group_size, sel) >= SEGMENTS_MIN_TOKENS)
            and _segments_ok(model, window)
        ):
            mode = "segments"
        elif kind is not None and window is None:
            mode = kind
        elif kind is not None:
            _warn_once(
                f"sequences exceed the model's sliding attention window ({span} tokens) and segment attention "
                "is unavailable for it"
            )
    return _logprobs(
        model, prompt_ids, completion_ids, group_size, sel, temperature, with_entropy, chunk_size, mode
    )


def _logprobs(
    model, prompt_ids, completion_ids, group_size, sel, temperature, with_entropy, chunk_size, mode
):
    """Returns LogProbs of rows `sel`; mode is "segments", "bool" / "float" (grouped, dense mask) or "padded"."""
    device = input_device(model)
    lengths = torch.tensor([len(completion_ids[r]) for r in sel], dtype=torch.long)  # [n]
    n, T = len(sel), int(lengths.max()) if sel else 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(device)  # [n, T]
    if T == 0:
        empty = torch.zeros(n, 0, dtype=torch.float32, device=device)
        return LogProbs(logp=empty, mask=mask, entropy=empty.clone() if with_entropy else None)

    parts = _model_parts(model)
    if mode == "segments":
        lay = _grouped_layout(prompt_ids, completion_ids, group_size, sel, T, one_row=True)
    elif mode == "padded":
        lay = _padded_layout(prompt_ids, completion_ids, group_size, sel, T)
    else:
        lay = _grouped_layout(prompt_ids, completion_ids, group_size, sel, T, _pair_cost(model))
    input_ids = torch.tensor(lay.input_ids, dtype=torch.long, device=device)  # [R, L]
    position_ids = torch.tensor(lay.position_ids, dtype=torch.long, device=device)  # [R, L]
    source = torch.tensor(lay.source, dtype=torch.long, device=device)  # [M] index into R*L
    target = torch.tensor(lay.target, dtype=torch.long, device=device)  # [M]
    dest = torch.tensor(lay.dest, dtype=torch.long, device=device)  # [M] index into n*T
    if mode == "segments":
        attn = plan_masks(device, build_plan(lay.prompt_pos, lay.body_pos, device, lay.position_ids[0]))
    elif mode == "padded":
        attn = torch.tensor(lay.attention_mask, dtype=torch.long, device=device)  # [R, L]
    else:
        attn = _block_mask(lay, device, mode, float_dtype(model))  # [R, 1, L, L]

    with custom_attention(model) if mode == "segments" else contextlib.nullcontext():
        hidden_or_logits = _forward(model, parts, input_ids, attn, position_ids)
    picked = hidden_or_logits.reshape(-1, hidden_or_logits.shape[-1]).index_select(0, source)  # [M, H or V]
    head = parts[1] if parts is not None else None
    vocab = head.weight.shape[0] if head is not None and hasattr(head, "weight") else picked.shape[-1]
    # Bound each chunk's float32 logits to a byte budget whatever the vocabulary (152k-token vocabularies
    # would otherwise allocate 0.6 GB per 1024-row chunk, several times over in softmax temporaries).
    budget = _CHUNK_BYTES.get(picked.device.type, _CHUNK_BYTES_ACCELERATOR)
    rows_per_chunk = max(1, min(chunk_size, budget // (4 * vocab)))
    logp, entropy = _chunked_logprobs(head, picked, target, temperature, with_entropy, rows_per_chunk)  # [M]
    flat = torch.zeros(n * T, dtype=torch.float32, device=device)  # [n*T]
    logp_out = flat.index_copy(0, dest, logp).view(n, T)  # [n, T]
    ent_out = flat.index_copy(0, dest, entropy).view(n, T) if entropy is not None else None  # [n, T]
    return LogProbs(logp=logp_out, mask=mask, entropy=ent_out)


def _widest_group(prompt_ids, completion_ids, group_size, sel) -> int:
    """Returns the most tokens any group lays out in the grouped layout: its prompt + its selected bodies."""
    sizes: dict[int, int] = {}
    for r in sel:
        g = r // group_size
        sizes[g] = sizes.get(g, len(prompt_ids[g])) + max(len(completion_ids[r]) - 1, 0)
    return max(sizes.values(), default=0)


def _forward(model, parts, input_ids, attn, position_ids) -> torch.Tensor:
    """Returns the decoder's last hidden states [R, L, H] when the model splits, else its logits [R, L, V]."""
    if parts is None:
        return model(
            input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=False
        ).logits
    out = parts[0](input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


# --------------------------------------------------------------------------------------------- layouts


@dataclass
class _Layout:
    input_ids: list[list[int]]  # [R, L]
    position_ids: list[list[int]]  # [R, L]
    source: list[int]  # [M] flat index (row * L + col) of the hidden state predicting each target
    target: list[int]  # [M] completion token ids
    dest: list[int]  # [M] flat index (i * T + t) into the [n, T] output
    attention_mask: list[list[int]] | None = None  # [R, L], padded layout only
    group: list[list[int]] | None = None  # [R, L] group instance per token (-1 = pad), grouped only
    segment: list[list[int]] | None = None  # [R, L] segment per token (-1 = pad), grouped only
    is_prompt: list[list[bool]] | None = None  # [R, L], grouped only
    prompt_pos: list[list[int]] | None = None  # flat positions of each laid-out prompt, grouped only
    # (prompt_pos index, flat positions) per non-empty body, grouped only
    body_pos: list[tuple[int, list[int]]] | None = None


def _padded_layout(prompt_ids, completion_ids, group_size, sel, T) -> _Layout:
    """Returns one right-padded row prompt + completion[:-1] per selected non-empty completion."""
    items = [(i, r) for i, r in enumerate(sel) if len(completion_ids[r]) > 0]
    width = max(len(prompt_ids[r // group_size]) + len(completion_ids[r]) - 1 for _, r in items)
    lay = _Layout([], [], [], [], [], attention_mask=[])
    for row, (i, r) in enumerate(items):
        prompt, comp = prompt_ids[r // group_size], completion_ids[r]
        seq = [*prompt, *comp[:-1]]
        pad = width - len(seq)
        lay.input_ids.append(seq + [seq[-1]] * pad)
        lay.position_ids.append(list(range(width)))
        lay.attention_mask.append([1] * len(seq) + [0] * pad)
        # Position p-1+t (the last prompt token, then each completion token) predicts token t.
        start = row * width + len(prompt) - 1
        lay.source.extend(range(start, start + len(comp)))
        lay.target.extend(comp)
        lay.dest.extend(range(i * T, i * T + len(comp)))
    return lay


def _grouped_layout(
    prompt_ids, completion_ids, group_size, sel, T, pair_cost: float = 0.0, one_row=False
) -> _Layout:
    """Returns packed rows of pieces [prompt, c1[:-1], c2[:-1], ...], one or more pieces per group.

    See _plan_rows for how groups are split into pieces and pieces placed into rows; with one_row,
    every group is one piece and all pieces share a single unpadded row.
    """
    groups: dict[int, list[tuple[int, int]]] = {}  # prompt index -> [(output index, row)]
    for i, r in enumerate(sel):
        if len(completion_ids[r]) > 0:
            groups.setdefault(r // group_size, []).append((i, r))
    if one_row:
        bins = [list(groups.items())]
        width = sum(len(prompt_ids[g]) + sum(len(completion_ids[r]) - 1 for _, r in m) for g, m in bins[0])
    else:
        width, bins = _plan_rows(
            {g: len(prompt_ids[g]) for g in groups},
            {g: [(m, len(completion_ids[m[1]]) - 1) for m in members] for g, members in groups.items()},
            pair_cost,
        )
    lay = _Layout([], [], [], [], [], group=[], segment=[], is_prompt=[], prompt_pos=[], body_pos=[])
    for row, pieces in enumerate(bins):
        ids, pos, grp, seg, isp = [], [], [], [], []
        for g, members in pieces:
            prompt = prompt_ids[g]
            p = len(prompt)
            last_prompt = row * width + len(ids) + p - 1
            piece_id = len(ids)  # unique within the row: a piece's tokens see only their own prompt copy
            lay.prompt_pos.append(list(range(row * width + len(ids), row * width + len(ids) + p)))
            ids.extend(prompt)
            pos.extend(range(p))
            grp.extend([piece_id] * p)
            seg.extend([piece_id] * p)
            isp.extend([True] * p)
            for i, r in members:
                comp = completion_ids[r]
                body = comp[:-1]
                start = row * width + len(ids)
                lay.source.append(last_prompt)
                lay.source.extend(range(start, start + len(body)))
                lay.target.extend(comp)
                lay.dest.extend(range(i * T, i * T + len(comp)))
                seg_id = len(ids)
                if body:
                    lay.body_pos.append((len(lay.prompt_pos) - 1, list(range(start, start + len(body)))))
                ids.extend(body)
                pos.extend(range(p, p + len(body)))
                grp.extend([piece_id] * len(body))
                seg.extend([seg_id] * len(body))
                isp.extend([False] * len(body))
        pad = width - len(ids)
        lay.input_ids.append(ids + [ids[-1]] * pad)
        lay.position_ids.append(pos + [0] * pad)
        lay.group.append(grp + [-1] * pad)
        lay.segment.append(seg + [-1] * pad)
        lay.is_prompt.append(isp + [False] * pad)
    return lay


def _plan_rows(prompt_len: dict, bodies: dict, pair_cost: float):
    """Returns (row width W, rows) where each row is a list of pieces (prompt index, [member]).

    `bodies[g]` lists (member, tokens after the prompt) for group g. Every token of a row costs 1 and
    every (query, key) pair pair_cost: a dense-mask attention kernel pays for masked pairs too, so one
    very long row per group can cost more than laying the prompt out more than once. For each
    candidate width W (from the longest single prompt + completion up to the longest whole group),
    groups longer than W are split into pieces of at most W tokens (each repeating its prompt), the
    pieces are packed best-fit decreasing into rows of width W, and the cheapest W wins.
    pair_cost = 0 never splits a group.
    """
    tokens = {g: prompt_len[g] + sum(n for _, n in bodies[g]) for g in bodies}
    total = sum(tokens.values())  # every prompt once
    widest = max(tokens.values())
    narrowest = max(prompt_len[g] + n for g in bodies for _, n in bodies[g])
    candidates = {widest}
    w = float(narrowest)
    while pair_cost > 0 and w < widest:
        candidates.add(int(w))
        w *= 1.25
    best = None
    for width in sorted(candidates, reverse=True):
        # A lower bound on this width's cost: every token, each split group's prompt repeated as often as
        # its body needs, perfectly packed. Skipping widths that cannot win keeps planning cheap.
        repeats = sum(
            (-(-(tokens[g] - prompt_len[g]) // (width - prompt_len[g])) - 1) * prompt_len[g]
            for g in bodies
            if tokens[g] > width
        )
        if best is not None and (total + repeats) * (1.0 + pair_cost * width) >= best[0]:
            continue
        pieces = []  # (size, prompt index, members)
        for g, members in bodies.items():
            if tokens[g] <= width:
                pieces.append((tokens[g], g, [m for m, _ in members]))
                continue
            room = width - prompt_len[g]
            for part in _pack([n for _, n in members], room):
                pieces.append(
                    (prompt_len[g] + sum(members[i][1] for i in part), g, [members[i][0] for i in part])
                )
        rows = [[(pieces[i][1], pieces[i][2]) for i in part] for part in _pack([p[0] for p in pieces], width)]
        cost = len(rows) * width * (1.0 + pair_cost * width)
        if best is None or cost < best[0]:
            best = (cost, width, rows)
    return best[1], best[2]


def _pack(sizes: list[int], capacity: int) -> list[list[int]]:
    """Returns bins (lists of indices into sizes) from best-fit decreasing: each item joins the fullest bin it fits."""
    free: list[tuple[int, int]] = []  # (free space, bin), sorted
    bins: list[list[int]] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        k = bisect.bisect_left(free, (sizes[i], -1))
        if k == len(free):
            bins.append([i])
            space, b = capacity - sizes[i], len(bins) - 1
        else:
            space, b = free.pop(k)
            bins[b].append(i)
            space -= sizes[i]
        bisect.insort(free, (space, b))
    return bins


def _block_mask(lay: _Layout, device, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Returns the [R, 1, L, L] mask of a grouped layout: bool (True = attend) or additive float.

    A query attends to an earlier-or-same key of its own group that is either in the prompt or in
    its own completion. Padding attends causally to padding, so no query row is fully masked (a
    fully masked row gives NaN in sdpa, and NaN poisons the backward pass even where unused).
    """
    group = torch.tensor(lay.group, device=device)  # [R, L]
    segment = torch.tensor(lay.segment, device=device)  # [R, L]
    is_prompt = torch.tensor(lay.is_prompt, device=device)  # [R, L]
    L = group.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()  # [L, L]
    same_group = group[:, :, None] == group[:, None, :]  # [R, L, L]
    visible = is_prompt[:, None, :] | (segment[:, :, None] == segment[:, None, :])  # [R, L, L]
    allowed = (same_group & visible & causal)[:, None]  # [R, 1, L, L]
    if kind == "bool":
        return allowed
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)  # [R, 1, L, L]


# --------------------------------------------------------------------------------------------- LM head


def _chunked_logprobs(head, picked, target, temperature, with_entropy, chunk_size):
    """Returns (log-probs [M], entropy [M] or None) from hidden states (or logits when head is None) [M, *]."""
    fn = _logp_entropy if with_entropy else _logp_only
    # Recomputing chunks in backward keeps one chunk's logits alive at a time. When everything fits in
    # one chunk that bound holds anyway, and skipping the recompute saves 7 % of the demo's update.
    use_ckpt = torch.is_grad_enabled() and picked.requires_grad and picked.shape[0] > chunk_size
    logps, ents = [], []
    for start in range(0, picked.shape[0], chunk_size):
        h = picked[start : start + chunk_size]  # [m, H]
        tgt = target[start : start + chunk_size]  # [m]
        if use_ckpt:
            lp, ent = checkpoint(fn, head, h, tgt, temperature, use_reentrant=False)
        else:
            lp, ent = fn(head, h, tgt, temperature)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def _scaled_logits(head, h, temperature):
    logits = (head(h) if head is not None else h).float()  # [m, V]
    return logits / temperature if temperature != 1.0 else logits


def _logp_only(head, h, target, temperature):
    logits = _scaled_logits(head, h, temperature)  # [m, V]
    logp = logits.gather(-1, target[:, None]).squeeze(-1) - logits.logsumexp(-1)  # [m]
    return logp, None


def _logp_entropy(head, h, target, temperature):
    logits = _scaled_logits(head, h, temperature)  # [m, V]
    logz = logits.logsumexp(-1)  # [m]
    logp = logits.gather(-1, target[:, None]).squeeze(-1) - logz  # [m]
    # Entropy is a statistic, not a loss term: outside autograd. Under checkpointing, tensors saved for a
    # backward that never runs stay alive until the whole backward ends, so a differentiable entropy
    # would keep two [m, V] tensors per chunk (2.7 GB at a 152k vocabulary).
    with torch.no_grad():
        z = logits.detach()
        entropy = logz.detach() - (z.softmax(-1) * z).sum(-1)  # [m]
    return logp, entropy


# --------------------------------------------------------------------------------------------- model


_PARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Returns the transformers model inside a peft PeftModel (LoRA layers stay injected), else model."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class _HeadThenTransform(torch.nn.Module):
    """The LM head followed by the logit transform the model's forward applies after it (in float32)."""

    def __init__(self, head: torch.nn.Module, transform) -> None:
        super().__init__()
        self.head, self.transform = head, transform

    @property
    def weight(self) -> torch.Tensor:
        """Returns the head's weight [V, H]."""
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Returns the transformed logits [..., V] float32."""
        return self.transform(self.head(hidden).float())


def _logit_transform(inner: torch.nn.Module):
    """Returns the function transformers' forward applies to this model's LM-head output, or None.

    The known ones: final soft-capping (Gemma 2), division by `logits_scaling` (Granite),
    multiplication by `logit_scale` (Cohere). Whether it is right is checked by `_head_matches`.
    """
    config = getattr(inner, "config", None)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        return lambda z: torch.tanh(z / cap) * cap
    divisor = getattr(config, "logits_scaling", None)
    if isinstance(divisor, (int, float)) and divisor not in (0, 1):
        return lambda z: z / divisor
    factor = getattr(inner, "logit_scale", None)
    if isinstance(factor, (int, float)) and factor != 1:
        return lambda z: z * factor
    return None


def _model_parts(model: torch.nn.Module):
    """Returns (decoder, lm_head) when head(decoder(x)) reproduces model(x).logits, else None (full logits).

    Checked once per model on a 4-token input. A known logit transform after the head (soft-capping,
    logit scaling) is folded into the returned head; models with other transforms, or peft prompt
    learning (virtual tokens), fail the check and use full logits.
    """
    if model in _PARTS:
        return _PARTS[model]
    parts = None
    peft_config = getattr(model, "active_peft_config", None)
    inner = _unwrap(model)
    get_dec = getattr(inner, "get_decoder", None)
    get_head = getattr(inner, "get_output_embeddings", None)
    if not getattr(peft_config, "is_prompt_learning", False) and callable(get_dec) and callable(get_head):
        decoder, head = get_dec(), get_head()
        if decoder is not None and head is not None and decoder is not inner:
            transform = _logit_transform(inner)
            head = _HeadThenTransform(head, transform) if transform is not None else head
            parts = (decoder, head) if _head_matches(model, decoder, head) else None
    if parts is None:
        warnings.warn(
            f"completion_logprobs: could not split {type(inner).__name__} into decoder + LM head; "
            "computing full logits (memory grows with batch x length x vocab)",
            stacklevel=3,
        )
    _PARTS[model] = parts
    return parts


def _head_matches(model, decoder, head) -> bool:
    vocab = head.weight.shape[0] if getattr(head, "weight", None) is not None else 2
    ids = (torch.arange(4, device=input_device(model)) % vocab)[None]  # [1, 4]
    try:
        with torch.no_grad(), eval_mode(model):
            out = decoder(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            ours = head(hidden).float()  # [1, 4, V]
            theirs = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.float()  # [1, 4, V]
    except Exception:  # noqa: BLE001 - any failure means the split is unusable
        return False
    if ours.shape != theirs.shape:
        return False
    scale = 1.0 + theirs.abs().max().item()
    return bool(torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3 * scale))


_WARNED: set[str] = set()


def _custom_mask_kind(model: torch.nn.Module) -> str | None:
    """Returns "bool" (sdpa) or "float" (eager) when the model takes our 4D mask as-is, else None."""
    config = getattr(_unwrap(model), "config", None)
    impl = getattr(config, "_attn_implementation", None)
    kind = {"sdpa": "bool", "eager": "float"}.get(impl)
    if kind is None:
        _warn_once(f"attention implementation {impl!r} takes no custom 4D mask (use 'sdpa' or 'eager')")
    return kind


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"completion_logprobs: layout='grouped' unavailable: {reason}; using 'padded'", stacklevel=4)


_SEGMENTS_OK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SEGMENTS_WINDOW_OK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _segments_ok(model: torch.nn.Module, window: int | None = None) -> bool:
    """Returns whether segment attention reproduces the padded layout's log-probs on this model.

    Checked once per model on a small batch of two groups, and once more (with sequences longer than
    `window`) before it is trusted with a sliding window. Models whose forward does not hand a pre-built
    4-D mask to its layers, transforms attention beyond sdpa's math, or keeps its window to itself fail
    and keep the dense-mask grouped layout (or, past a window, the padded one). With gradient
    checkpointing on, the backward pass re-runs layers after the attention function has been switched
    back, so segments are not used then.
    """
    inner = _unwrap(model)
    flag = (
        "is_activation_checkpointing"
        if hasattr(type(inner), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    if getattr(inner, flag, False):
        return False
    if window is not None:
        if not window or not _segments_ok(model):
            return False
        if model not in _SEGMENTS_WINDOW_OK:
            # A prompt and a completion that each outrun the window, so both kinds of problem are windowed.
            vocab = inner.get_input_embeddings().weight.shape[0]
            prompts = [[2 + t % (vocab - 2) for t in range(window + 2)], [4 % vocab, 5 % vocab]]
            comps = [[6 % vocab] * 3, [9 % vocab], [10 % vocab] * 2, [12 % vocab] * (window + 3)]
            _SEGMENTS_WINDOW_OK[model] = _segments_match(model, prompts, comps, "a sliding window")
        return _SEGMENTS_WINDOW_OK[model]
    if model in _SEGMENTS_OK:
        return _SEGMENTS_OK[model]
    vocab = inner.get_input_embeddings().weight.shape[0]
    prompts = [[t % vocab for t in (1, 2, 3)], [t % vocab for t in (4, 5)]]
    comps = [[t % vocab for t in c] for c in ([6, 7, 8], [9], [10, 11], [12] * 4)]
    _SEGMENTS_OK[model] = _segments_match(model, prompts, comps, "")
    return _SEGMENTS_OK[model]


def _segments_match(model, prompts, comps, what: str) -> bool:
    """Returns whether segments give the padded layout's log-probs on two groups of two (warns if not)."""
    try:
        # The check is about structure, not rounding: outside any autocast the caller runs under, with a
        # tolerance that fits the weights' precision.
        device_type = input_device(model).type
        with torch.no_grad(), torch.autocast(device_type, enabled=False), eval_mode(model):
            args = (model, prompts, comps, 2, [0, 1, 2, 3], 1.0, False, 1024)
            ours = _logprobs(*args, "segments").logp
            theirs = _logprobs(*args, "padded").logp
        ok = bool(torch.allclose(ours, theirs, rtol=0, atol=check_tolerance(model)))
    except Exception:  # noqa: BLE001 - any failure means segments are unusable on this model
        ok = False
    if not ok:
        name = type(_unwrap(model)).__name__
        warnings.warn(
            f"completion_logprobs: segment attention does not reproduce {name}'s log-probs"
            + (f" with {what}; using the padded layout past it" if what else "; using the dense-mask grouped layout"),
            stacklevel=4,
        )
    return ok


def _pair_cost(model: torch.nn.Module) -> float:
    """Returns attention FLOPs per (query, key) pair over dense FLOPs per token, from the config (0 if unknown).

    Layers cancel out; a dense-mask attention kernel pays for masked pairs too, and runs at a lower
    FLOP rate than the projections, hence ATTENTION_SLOWDOWN.
    """
    config, shape = text_config(model), attention_shape(model)
    if shape is None or not hasattr(config, "hidden_size"):
        return 0.0
    heads, kv_heads, head_dim = shape
    hidden = config.hidden_size
    inter = getattr(config, "intermediate_size", None) or 4 * hidden
    per_token = 2 * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter)
    per_pair = 4 * heads * head_dim
    return ATTENTION_SLOWDOWN * per_pair / per_token


def _validate(prompt_ids, completion_ids, group_size, rows, temperature, chunk_size, layout) -> list[int]:
    """Returns the selected row indices; raises a clear error for any malformed argument."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
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
