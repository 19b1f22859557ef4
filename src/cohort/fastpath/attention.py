"""Attention for a prompt shared by a group: segment attention (training) and shared-prefix decoding.

**Segment attention**: a group's prompt and its completions in one packed row, no mask over the whole row.

The grouped log-prob layout puts each prompt once, followed by its completions, in one sequence.
With a dense [L, L] mask every (query, key) pair of the row is paid for, masked or not, and row
padding and prompt repeats (to keep rows short) cost projections too. Here the row stays one packed
sequence of exactly the real tokens for every projection and MLP, and only attention is regrouped:

- each prompt attends causally to itself (prompts of similar length batched, causal kernel);
- each completion's queries attend to its prompt's keys and, causally, to its own keys: its keys
  are gathered into [prompt, own tokens] and completions of similar length share one call with a
  small mask. Short completions of one prompt are put into one attention problem together (keys
  [prompt, c1, c2, ...], each seeing its own part only): a problem has a fixed cost that dwarfs the
  work of a few tokens.

The gathers are differentiable (their backward sums into the packed row), so a prompt's keys and
values receive the gradients of all its completions. transformers hands a 4-D tensor given as
`attention_mask` unchanged to every layer (in every model family, unlike a dict of masks, which
only models with `layer_types` accept), and a gradient-checkpointed layer keeps it for its
recomputation: a 1-element mask stands for the plan (:func:`plan_carrier`), which this module's
attention function looks up by that mask (:func:`plan_of`). The function is selected by switching the
model's `_attn_implementation` for the duration of a call (:func:`plan_attention`), or of a whole
update whose backward recomputes layers (:func:`hold_attention`).

**Shared-prefix decoding**: the G samples of a prompt decode against one copy of its prompt's keys and
values instead of G copies. Each step's query of every live row scores its group's prompt keys (rows of
a group batched into one matmul, so the prompt's cache is read once per group, not once per sample) and
its own completion keys (a per-sample cache), with one softmax over both. In decoding, reading the
prompt's cache G times was most of attention's time and memory traffic.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

STEP_PLAN = "_cohort_step_plan"
"""The attribute under which each attention module of a model holds a static decode step's plan
(:func:`attach_step_plan`)."""
NAME = "cohort_segments"
"""The attention implementation name cohort registers with transformers (segment and shared-prefix plans)."""
BUCKET_RATIO = 0.75
"""A new length bucket starts when a segment is shorter than this fraction of its bucket's longest:
padding stays under a third while the number of kernel calls grows only logarithmically with length."""
PIECE_OVERHEAD = 1500
"""Fixed cost of one attention problem (a batch row of a kernel call), in (query, key) pairs: measured with
sdpa forward + backward on CPU (2 threads, head size 32-64), about 10 us per problem and head against
5-7 ns per pair and head."""


@dataclass
class _Bucket:
    q_idx: torch.Tensor  # [b, Tq] packed positions of the queries (padded with a valid position)
    k_idx: torch.Tensor  # [b, Tk] packed positions of the keys
    mask: torch.Tensor | None  # [b, 1, Tq, Tk] bool (True = attend), or None for plain causal


@dataclass
class SegmentPlan:
    """Which packed positions attend to which, as index tensors for one packed row of N tokens."""

    buckets: list[_Bucket]
    inverse: torch.Tensor
    """[N] row of each packed position in the concatenated (padded) bucket outputs."""
    position_ids: torch.Tensor | None = None
    """[N] position of each packed token in its own sequence (needed only for sliding windows)."""
    _windowed: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        pos = self.position_ids
        self._span = int(pos.max()) + 1 if pos is not None and pos.numel() else 0

    def masks(self, window: int | None) -> list[torch.Tensor | None]:
        """Returns each bucket's mask, restricted to keys fewer than `window` positions back when given.

        Causal order stays by index within a bucket (padding repeats a real position, so positions alone
        would let a query see copies of itself); a padding query left with no key keeps its unwindowed
        row, so no row is fully masked.
        """
        if window is None or self._span <= window:
            return [b.mask for b in self.buckets]
        if window not in self._windowed:
            pos = self.position_ids
            assert pos is not None  # a span above the window was measured on them
            out: list[torch.Tensor | None] = []
            for b in self.buckets:
                qp, kp = pos[b.q_idx], pos[b.k_idx]  # [b, Tq], [b, Tk]
                near = (qp[:, :, None] - kp[:, None, :] < window)[:, None]  # [b, 1, Tq, Tk]
                base = b.mask
                if base is None:
                    tq, tk = b.q_idx.shape[1], b.k_idx.shape[1]
                    base = torch.ones(tq, tk, dtype=torch.bool, device=near.device).tril()[None, None]
                m = base & near
                out.append(torch.where(m.any(-1, keepdim=True), m, base))
            self._windowed[window] = out
        return self._windowed[window]


def build_plan(
    prompts: Sequence[Sequence[int]],
    bodies: Sequence[tuple[int, Sequence[int]]],
    device,
    position_ids: Sequence[int] | None = None,
) -> SegmentPlan:
    """Returns the plan for a row whose prompts are `prompts` (packed positions of each prompt's tokens)
    and whose completions are `bodies`: (prompt index, packed positions of the completion's tokens).

    position_ids: each packed token's position in its own sequence, for sliding-window layers."""
    buckets: list[_Bucket] = []
    slot: dict[int, int] = {}  # packed position -> row in the concatenated outputs
    offset = 0

    def place(q_rows: Sequence[Sequence[int]], width: int) -> None:
        nonlocal offset
        for i, q in enumerate(q_rows):
            for t, pos in enumerate(q):
                slot[pos] = offset + i * width + t
        offset += len(q_rows) * width

    for part in _length_buckets([len(p) for p in prompts]):
        prompt_rows = [prompts[i] for i in part]
        width = len(prompt_rows[0])
        # Right padding repeats a real position: under the causal kernel no real query sees a padded key.
        idx = torch.tensor([_pad(r, width) for r in prompt_rows], dtype=torch.long)
        buckets.append(_Bucket(q_idx=idx.to(device), k_idx=idx.to(device), mask=None))
        place(prompt_rows, width)

    pieces = _pieces([len(p) for p in prompts], bodies)  # (prompt index, [body index])
    for part in _length_buckets([sum(len(bodies[i][1]) for i in members) for _, members in pieces]):
        rows = [pieces[i] for i in part]
        tq = sum(len(bodies[i][1]) for i in rows[0][1])
        tp = max(len(prompts[g]) for g, _ in rows)
        queries = [[pos for i in members for pos in bodies[i][1]] for _, members in rows]
        # Which completion of its piece each query slot belongs to (-1: padding).
        owners = [[i for i in members for _ in bodies[i][1]] for _, members in rows]
        owner = torch.tensor([o + [-1] * (tq - len(o)) for o in owners], dtype=torch.long)  # [b, Tq]
        q_idx = torch.tensor([_pad(q, tq) for q in queries], dtype=torch.long)  # [b, Tq]
        k_idx = torch.tensor([_pad(prompts[g], tp) + _pad(q, tq) for (g, _), q in zip(rows, queries)])
        p_len = torch.tensor([len(prompts[g]) for g, _ in rows])[:, None, None]  # [b, 1, 1]
        t = torch.arange(tq)
        in_prompt = torch.arange(tp)[None, None, :] < p_len  # [b, 1, Tp]
        own = (owner[:, :, None] == owner[:, None, :]) & (t[None, None, :] <= t[None, :, None])  # [b, Tq, Tq]
        own &= owner[:, :, None] >= 0
        # Padded queries still see their prompt, so no row is fully masked (which would give NaN).
        mask = torch.cat([in_prompt.expand(-1, tq, -1), own], dim=-1)[:, None]  # [b, 1, Tq, Tp + Tq]
        buckets.append(_Bucket(q_idx=q_idx.to(device), k_idx=k_idx.to(device), mask=mask.to(device)))
        place(queries, tq)

    inverse = torch.tensor([slot[p] for p in range(len(slot))], dtype=torch.long, device=device)
    positions = None if position_ids is None else torch.tensor(position_ids, dtype=torch.long, device=device)
    return SegmentPlan(buckets=buckets, inverse=inverse, position_ids=positions)


def _pieces(
    prompt_len: Sequence[int], bodies: Sequence[tuple[int, Sequence[int]]]
) -> list[tuple[int, list[int]]]:
    """Returns the attention problems: (prompt index, indices into bodies) of completions that share one.

    A problem's queries are its completions' tokens and its keys its prompt + those tokens, masked so each
    completion sees only the prompt and itself. Alone, a short completion is a tiny problem whose fixed
    cost (PIECE_OVERHEAD) dwarfs its work; shortest first, completions of a prompt join a problem while
    that costs less than keeping them apart.
    """

    def cost(p: int, q: int) -> int:
        return q * (p + q) + PIECE_OVERHEAD

    by_prompt: dict[int, list[int]] = {}
    for i, (g, _) in enumerate(bodies):
        by_prompt.setdefault(g, []).append(i)
    pieces = []
    for g, members in by_prompt.items():
        p = prompt_len[g]
        members.sort(key=lambda i: len(bodies[i][1]))
        current, q = [members[0]], len(bodies[members[0]][1])
        for i in members[1:]:
            n = len(bodies[i][1])
            if cost(p, q + n) <= cost(p, q) + cost(p, n):
                current.append(i)
                q += n
            else:
                pieces.append((g, current))
                current, q = [i], n
        pieces.append((g, current))
    return pieces


def _pad(positions: Sequence[int], width: int) -> list[int]:
    return [*positions, *[positions[-1]] * (width - len(positions))]


def _length_buckets(lengths: Sequence[int]) -> list[list[int]]:
    """Returns indices into `lengths` (all > 0) grouped by similar length, longest first in each bucket."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and lengths[i] >= BUCKET_RATIO * lengths[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


class PrefixPlan:
    """The prompts' cached keys/values [B, Hkv, P, D] per layer, and where each live decoding row's group is."""

    def __init__(
        self, prompt_kv: list[tuple[torch.Tensor, torch.Tensor]], prompt_mask: torch.Tensor, group_size: int
    ):
        self.prompt_kv = prompt_kv
        B = prompt_mask.shape[0]
        zero = torch.zeros((), dtype=prompt_kv[0][0].dtype, device=prompt_mask.device)
        self.bias = torch.where(prompt_mask.bool(), zero, float("-inf"))[:, None, None, :]  # [B, 1, 1, P]
        self.group_size = group_size
        self.select(torch.arange(B * group_size, device=prompt_mask.device))

    def select(self, rows: torch.Tensor) -> None:
        """Sets the live rows: rows[i] is the original sample id (group-contiguous, ascending) of batch row i."""
        group = rows // self.group_size  # [n]
        B = self.bias.shape[0]
        counts = torch.bincount(group, minlength=B)  # [B]
        first = counts.cumsum(0) - counts  # [B] batch row of each group's first live row
        self.width = int(counts.max())  # live rows of the fullest group
        self.slot = group * self.width + torch.arange(rows.numel(), device=rows.device) - first[group]  # [n]


def _prefix_decode(module, query, key, value, plan: PrefixPlan, scaling):
    """Returns the attention output [n, 1, H, D] of one decode step over prompt (shared) + own keys."""
    n, heads, _, dim = query.shape
    kp, vp = plan.prompt_kv[module.layer_idx]  # [B, Hkv, P, D]
    B, kv_heads = kp.shape[0], kp.shape[1]
    rep = heads // kv_heads
    scaling = dim**-0.5 if scaling is None else scaling
    q = query[:, :, 0, :].reshape(n, kv_heads, rep, dim) * scaling  # [n, Hkv, rep, D]
    # The rows of a group side by side: [B, Hkv, width*rep, D], so one matmul reads a prompt's keys once.
    grouped = q.new_zeros(B * plan.width, kv_heads, rep, dim).index_copy_(0, plan.slot, q)
    grouped = (
        grouped.view(B, plan.width, kv_heads, rep, dim).permute(0, 2, 1, 3, 4).reshape(B, kv_heads, -1, dim)
    )
    s_prompt = grouped @ kp.transpose(-1, -2) + plan.bias  # [B, Hkv, width*rep, P]
    s_prompt = (
        s_prompt.view(B, kv_heads, plan.width, rep, -1)
        .transpose(1, 2)
        .reshape(B * plan.width, kv_heads, rep, -1)
    )
    s_prompt = s_prompt.index_select(0, plan.slot)  # [n, Hkv, rep, P]
    s_own = q @ key.transpose(-1, -2)  # [n, Hkv, rep, t]
    P = s_prompt.shape[-1]
    scores = torch.cat([s_prompt, s_own], dim=-1)  # [n, Hkv, rep, P + t], softmax in float32 or wider
    probs = scores.to(torch.promote_types(scores.dtype, torch.float32)).softmax(dim=-1).to(q.dtype)
    own = probs[..., P:] @ value  # [n, Hkv, rep, D]
    p_prompt = q.new_zeros(B * plan.width, kv_heads, rep, P).index_copy_(0, plan.slot, probs[..., :P])
    p_prompt = (
        p_prompt.view(B, plan.width, kv_heads, rep, P).permute(0, 2, 1, 3, 4).reshape(B, kv_heads, -1, P)
    )
    shared = (
        (p_prompt @ vp).view(B, kv_heads, plan.width, rep, dim).transpose(1, 2)
    )  # [B, width, Hkv, rep, D]
    shared = shared.reshape(B * plan.width, kv_heads, rep, dim).index_select(0, plan.slot)  # [n, Hkv, rep, D]
    return (shared + own).reshape(n, 1, heads, dim)


class StepPlan:
    """The shapes-fixed attention of a static decode step (cohort.rollout.graph): every row of a group reads its
    prompt's keys [B, Hkv, P, D] (one copy per group, or one per row: groups of 1) and its own keys, held in a
    buffer of all T own positions that the cache writes at the device index `step`; `bias` [N, 1, 1, P + T] masks
    each row's padded prompt positions and its own columns after `step`. No shape, index or value of it is a
    Python number that changes between steps, so the step can be captured once and replayed."""

    def __init__(
        self,
        prompt_kv: list[tuple[torch.Tensor, torch.Tensor]],
        prompt_mask: torch.Tensor,
        capacity: int,
        width: int,
    ):
        self.prompt_kv = prompt_kv
        # rows a copy of the prompt's keys serves (G, or 1 without sharing): a number, not rows // prompts, so a
        # compiled step reasons about no floor division of two sizes (a fifth of its tracing time at 12 layers)
        self.width = width
        device = prompt_mask.device
        zero = torch.zeros((), dtype=prompt_kv[0][0].dtype, device=device)
        prompt_bias = torch.where(prompt_mask.bool(), zero, float("-inf"))  # [B, P]
        P = prompt_bias.shape[1]
        self.step = torch.zeros((), dtype=torch.long, device=device)  # own column of the token being fed
        self.columns = torch.arange(capacity, device=device)  # [T]
        # One mask for the scores of prompt and own keys side by side: one add a layer, not one for each part.
        self.bias = torch.zeros(
            prompt_bias.shape[0] * width, 1, 1, P + capacity, dtype=zero.dtype, device=device
        )  # [N, 1, 1, P + T]
        self.bias[:, 0, 0, :P] = prompt_bias.repeat_interleave(width, dim=0)
        self.low: torch.dtype | None = None  # the autocast dtype the products run in (see narrow)
        self.refresh()

    def narrow(self, dtype: torch.dtype) -> None:
        """Holds the prompt's keys and values in `dtype` (autocast's, where it is narrower) and casts each step's
        query and probabilities to it once: autocast would cast them to it inside every product that reads them
        (the prompt's keys at each step, the query twice), with the same rounding, so every value is unchanged.
        The mask keeps the scores' dtype."""
        self.low = dtype
        self.prompt_kv = [(_narrowed(k, dtype), _narrowed(v, dtype)) for k, v in self.prompt_kv]

    def refresh(self) -> None:
        """Rewrites the own columns of `bias` in place for the current `step` (0 up to it, -inf after), without a
        host sync."""
        P = self.bias.shape[-1] - self.columns.shape[0]
        self.bias[..., P:].copy_(torch.where(self.columns <= self.step, 0.0, float("-inf")))


def _narrowed(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Returns `t` in `dtype` where it is a wider float (as it is otherwise)."""
    wider = t.is_floating_point() and t.dtype.itemsize > dtype.itemsize
    return t.to(dtype) if wider else t


def scales_exactly(scaling: float) -> bool:
    """Returns whether `scaling` is a power of two (head size 16, 64, 256: 1 / sqrt(head size)), which scales a dot
    product's rounded result bit for bit as it scales one of its operands."""
    return math.frexp(scaling)[0] == 0.5


def _step_decode(module, query, key, value, plan: StepPlan, scaling):
    """Returns the attention output [N, 1, H, D] of a static decode step: prompt keys (one copy per group) and
    the T own keys of each row (key, value: [N, Hkv, T, D], unwritten columns zero and masked by the plan's bias)."""
    n, heads, _, dim = query.shape
    kp, vp = plan.prompt_kv[module.layer_idx]  # [B, Hkv, P, D]
    B, kv_heads, P = kp.shape[0], kp.shape[1], kp.shape[2]
    width, rep = plan.width, heads // kv_heads
    scaling = dim**-0.5 if scaling is None else scaling
    # a power of two is applied in the bias add below: the query needs no kernel of its own
    scale_scores = scales_exactly(scaling)
    q = query[:, :, 0, :].reshape(n, kv_heads, rep, dim)  # [n, Hkv, rep, D]
    if not scale_scores:
        q = q * scaling
    # once, after the scaling: what autocast would do in each product (StepPlan.narrow)
    if plan.low is not None:
        q = _narrowed(q, plan.low)
    # Rows of a group are contiguous and none is ever dropped: grouping them is a view, not an index copy.
    grouped = q.reshape(B, width, kv_heads, rep, dim).permute(0, 2, 1, 3, 4).reshape(B, kv_heads, -1, dim)
    s_prompt = grouped @ kp.transpose(-1, -2)  # [B, Hkv, width*rep, P]
    s_prompt = s_prompt.view(B, kv_heads, width, rep, P).transpose(1, 2).reshape(n, kv_heads, rep, P)
    s_own = q @ key.transpose(-1, -2)  # [n, Hkv, rep, T]
    # (a cat reading the prompt part in place would not save its copy on a GPU: CUDA's cat copies inputs of more
    # than four dimensions one by one)
    scores = torch.cat([s_prompt, s_own], dim=-1)  # [n, Hkv, rep, P + T]
    scores = torch.add(plan.bias, scores, alpha=scaling) if scale_scores else scores + plan.bias
    probs = scores.to(torch.promote_types(scores.dtype, torch.float32)).softmax(dim=-1).to(q.dtype)
    own = probs[..., P:] @ value  # [n, Hkv, rep, D]
    p_prompt = (
        probs[..., :P].reshape(B, width, kv_heads, rep, P).permute(0, 2, 1, 3, 4).reshape(B, kv_heads, -1, P)
    )
    shared = (p_prompt @ vp).view(B, kv_heads, width, rep, dim).transpose(1, 2)  # [B, width, Hkv, rep, D]
    # One kernel: the add reads the group layout in place (a row-major copy of it first was a second kernel a layer,
    # of ~50 in a GPU's step); the row-major operand first, so the sum comes out row-major and the reshape is a view.
    return (own.view(B, width, kv_heads, rep, dim) + shared).reshape(n, 1, heads, dim)


FLASH_FIRST = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
"""sdpa's backends in the order fast.flash_first asks for (torch.nn.attention.SDPBackend names)."""


_SETTLED: set[torch.device] = set()


def settle_sdp_order(device: torch.device) -> None:
    """Returns None once torch has set its own sdpa backend order for `device`'s process (once per device).

    On CUDA torch decides its default order at the first backend choice of the process, not at start: on a
    Hopper or Blackwell GPU with a recent cuDNN it then puts cuDNN first, overwriting the order in force. Were that
    first choice inside flash_first's block (a process whose first attention is the update: rollout workers sample
    elsewhere), the block would run with cuDNN first, and leaving it would restore the order read before torch had
    settled it. One backend choice on a tiny tensor settles it first (no attention kernel runs)."""
    if device in _SETTLED:
        return
    _SETTLED.add(device)
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return
    try:
        q = torch.zeros(1, 1, 1, 8, device=device, dtype=torch.bfloat16)
        choose(q, q, q)
    except Exception:  # noqa: BLE001 - a private call: without it the order is torch's, as before
        pass


@contextlib.contextmanager
def flash_first(setting: str, device: torch.device) -> Iterator[bool]:
    """Yields whether sdpa tries FlashAttention and memory-efficient attention before cuDNN's inside the block
    (fast.flash_first: `auto` on CUDA only, `on` anywhere, `off` never); torch's own order is back after it."""
    if setting == "off" or (setting == "auto" and device.type != "cuda"):
        yield False
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type == "cuda":
        settle_sdp_order(device)
    order = [getattr(SDPBackend, name) for name in FLASH_FIRST]
    if "set_priority" in inspect.signature(sdpa_kernel).parameters:
        scope = sdpa_kernel(order, set_priority=True)
    else:  # a torch that cannot reorder: cuDNN's attention left out instead
        scope = sdpa_kernel([b for b in order if b != SDPBackend.CUDNN_ATTENTION])
    with scope:
        yield True


def custom_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Returns (attention output [B, L, H, D], None) following a SegmentPlan, PrefixPlan or StepPlan; plain sdpa
    otherwise."""
    plan = module.__dict__.get(STEP_PLAN)
    if plan is None:
        plan = plan_of(attention_mask)
    if isinstance(plan, PrefixPlan):
        return _prefix_decode(module, query, key, value, plan, scaling), None
    if isinstance(plan, StepPlan):
        return _step_decode(module, query, key, value, plan, scaling), None
    if not isinstance(plan, SegmentPlan):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"segment attention expects one packed row, got a batch of {query.shape[0]}")
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[-1]
    q = query[0].transpose(0, 1)  # [N, H, D]
    k = key[0].transpose(0, 1)  # [N, Hkv, D]
    v = value[0].transpose(0, 1)  # [N, Hkv, D]
    outs = []
    # Sliding-window layers say so (transformers passes `sliding_window` to the attention function).
    window = kwargs.get("sliding_window")
    for b, mask in zip(plan.buckets, plan.masks(window if isinstance(window, int) and window > 0 else None)):
        # index_select, not advanced indexing: its backward is an index_add, several times faster on CPU
        # than the accumulating index_put that indexing's backward runs.
        qb = _rows(q, b.q_idx)  # [b, H, Tq, D]
        kb = _rows(k, b.k_idx)  # [b, Hkv, Tk, D]
        vb = _rows(v, b.k_idx)  # [b, Hkv, Tk, D]
        if kv_heads != heads:
            kb = kb.repeat_interleave(heads // kv_heads, dim=1)  # [b, H, Tk, D]
            vb = vb.repeat_interleave(heads // kv_heads, dim=1)
        o = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, is_causal=mask is None, dropout_p=dropout, scale=scaling
        )  # [b, H, Tq, D]
        outs.append(o.transpose(1, 2).reshape(-1, heads, dim))  # [b*Tq, H, D]
    out = torch.cat(outs).index_select(0, plan.inverse)  # [N, H, D]
    return out[None], None


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Returns x [N, H, D] gathered at idx [b, T] as [b, H, T, D]."""
    return x.index_select(0, idx.reshape(-1)).view(*idx.shape, *x.shape[1:]).transpose(1, 2)


AttentionInterface.register(NAME, custom_attention_forward)
# Masks are handed over pre-built (plan_carrier); a model that builds its own gets sdpa's.
AttentionMaskInterface.register(NAME, sdpa_mask)


@contextlib.contextmanager
def plan_attention(model: torch.nn.Module) -> Iterator[None]:
    """Yields with every config of `model` selecting cohort's attention, then restores each one's own choice."""
    configs = {
        id(c): c for m in model.modules() if isinstance(c := getattr(m, "config", None), PretrainedConfig)
    }
    saved = [(c, c._attn_implementation_internal) for c in configs.values()]
    for c, _ in saved:
        c._attn_implementation_internal = NAME
    try:
        yield
    finally:
        for c, impl in saved:
            c._attn_implementation_internal = impl


@contextlib.contextmanager
def attach_step_plan(model: torch.nn.Module, plan: StepPlan) -> Iterator[None]:
    """Yields with `plan` held by every module of `model` that has a `layer_idx` (its attention modules), then
    takes it away.

    torch.compile traces an attribute of the module that calls the attention function, where it cannot trace
    the look-up of a plan by its carrier mask (a weak-key dictionary): one graph break a layer otherwise."""
    holders = [m for m in model.modules() if hasattr(m, "layer_idx")]
    for m in holders:
        setattr(m, STEP_PLAN, plan)
    try:
        yield
    finally:
        for m in holders:
            if STEP_PLAN in m.__dict__:
                delattr(m, STEP_PLAN)


_HELD: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Models whose cohort attention stays selected through forward and backward passes (hold_attention)."""


@contextlib.contextmanager
def hold_attention(model: torch.nn.Module) -> Iterator[None]:
    """Yields with cohort's attention selected on `model` for every forward and backward pass inside.

    A gradient-checkpointed layer recomputes its forward during the backward pass, after a forward's own
    plan_attention has ended: held, the recomputation follows the plan its forward was given."""
    with plan_attention(model):
        _HELD.add(model)
        try:
            yield
        finally:
            _HELD.discard(model)


def attention_held(model: torch.nn.Module) -> bool:
    """Returns whether `model` is inside hold_attention (recomputed layers keep cohort's attention)."""
    return model in _HELD


_PLANS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Each plan under the mask that stands for it (plan_carrier); an entry goes when its mask is freed."""


def plan_carrier(device: torch.device, plan: SegmentPlan | PrefixPlan | StepPlan) -> torch.Tensor:
    """Returns the `attention_mask` that hands `plan` to every attention layer: a 1-element 4-D tensor standing for it.

    Mask builders return a 4-D mask as it is, so the same object reaches every layer (and a checkpointed
    layer's recomputation, which keeps it). The plan is not a forward keyword: some models' heads do not
    hand extra keywords on (GPT-2's in transformers 5.0), and a recomputation without it would be plain
    attention. A model that reshapes or slices masks loses the plan and gets plain sdpa over this dummy
    mask, which the once-per-model checks of both plans catch.
    """
    carrier = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    _PLANS[carrier] = plan
    return carrier


def plan_of(attention_mask: object) -> SegmentPlan | PrefixPlan | StepPlan | None:
    """Returns the plan `attention_mask` stands for (plan_carrier), or None for any other mask."""
    return _PLANS.get(attention_mask) if isinstance(attention_mask, torch.Tensor) else None
