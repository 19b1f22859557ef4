"""Where each token goes in the update's forward pass: the grouped and padded layouts and their row plans.

- grouped: each prompt appears once, followed by its selected completions, and position ids restart at
  the prompt length for every completion, so each token sees exactly the context it has in a plain
  prompt + completion row; the prompt's activations are computed once and receive the gradients of all
  its completions. Either all groups share one unpadded row (segment attention regroups attention,
  `cohort.fastpath.attention`), or packed rows carry a dense block mask (`block_mask`) that lets every
  completion see its prompt and itself only; since a dense mask pays for masked (query, key) pairs too,
  a group whose single row would make attention dominate is split into pieces that each repeat the
  prompt, the width chosen by a FLOP estimate from the config (`plan_rows`).
- padded: one right-padded prompt + completion row per completion: the reference layout.

A layout lists, for every completion token, the flat position of the hidden state that predicts it
(`source`), the token (`target`) and its place in the [n, T] output (`dest`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from cohort.models import attention_shape, text_config


@dataclass
class Layout:
    """Token rows of one forward pass and where each completion token's prediction is read."""

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


def padded_layout(prompt_ids, completion_ids, group_size, sel, T) -> Layout:
    """Returns one right-padded row prompt + completion[:-1] per selected non-empty completion."""
    items = [(i, r) for i, r in enumerate(sel) if len(completion_ids[r]) > 0]
    width = max(len(prompt_ids[r // group_size]) + len(completion_ids[r]) - 1 for _, r in items)
    attention_mask: list[list[int]] = []
    lay = Layout([], [], [], [], [], attention_mask=attention_mask)
    for row, (i, r) in enumerate(items):
        prompt, comp = prompt_ids[r // group_size], completion_ids[r]
        seq = [*prompt, *comp[:-1]]
        pad = width - len(seq)
        lay.input_ids.append(seq + [seq[-1]] * pad)
        lay.position_ids.append(list(range(width)))
        attention_mask.append([1] * len(seq) + [0] * pad)
        # Position p-1+t (the last prompt token, then each completion token) predicts token t.
        start = row * width + len(prompt) - 1
        lay.source.extend(range(start, start + len(comp)))
        lay.target.extend(comp)
        lay.dest.extend(range(i * T, i * T + len(comp)))
    return lay


def grouped_layout(
    prompt_ids, completion_ids, group_size, sel, T, pair_cost: float = 0.0, one_row=False
) -> Layout:
    """Returns packed rows of pieces [prompt, c1[:-1], c2[:-1], ...], one or more pieces per group.

    See plan_rows for how groups are split into pieces and pieces placed into rows; with one_row,
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
        width, bins = plan_rows(
            {g: len(prompt_ids[g]) for g in groups},
            {g: [(m, len(completion_ids[m[1]]) - 1) for m in members] for g, members in groups.items()},
            pair_cost,
        )
    grp_rows: list[list[int]] = []
    seg_rows: list[list[int]] = []
    isp_rows: list[list[bool]] = []
    prompt_pos: list[list[int]] = []
    body_pos: list[tuple[int, list[int]]] = []
    lay = Layout([], [], [], [], [], group=grp_rows, segment=seg_rows, is_prompt=isp_rows)
    lay.prompt_pos, lay.body_pos = prompt_pos, body_pos
    for row, pieces in enumerate(bins):
        ids: list[int] = []
        pos: list[int] = []
        grp: list[int] = []
        seg: list[int] = []
        isp: list[bool] = []
        for g, members in pieces:
            prompt = prompt_ids[g]
            p = len(prompt)
            last_prompt = row * width + len(ids) + p - 1
            piece_id = len(ids)  # unique within the row: a piece's tokens see only their own prompt copy
            prompt_pos.append(list(range(row * width + len(ids), row * width + len(ids) + p)))
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
                    body_pos.append((len(prompt_pos) - 1, list(range(start, start + len(body)))))
                ids.extend(body)
                pos.extend(range(p, p + len(body)))
                grp.extend([piece_id] * len(body))
                seg.extend([seg_id] * len(body))
                isp.extend([False] * len(body))
        pad = width - len(ids)
        lay.input_ids.append(ids + [ids[-1]] * pad)
        lay.position_ids.append(pos + [0] * pad)
        grp_rows.append(grp + [-1] * pad)
        seg_rows.append(seg + [-1] * pad)
        isp_rows.append(isp + [False] * pad)
    return lay


def plan_rows(prompt_len: dict, bodies: dict, pair_cost: float):
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
    assert best is not None  # the widest candidate is never skipped
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


def block_mask(lay: Layout, device, additive: bool, dtype: torch.dtype) -> torch.Tensor:
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
    if not additive:
        return allowed
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)  # [R, 1, L, L]


def widest_group(prompt_ids, completion_ids, group_size, sel) -> int:
    """Returns the most tokens any group lays out in the grouped layout: its prompt + its selected bodies."""
    sizes: dict[int, int] = {}
    for r in sel:
        g = r // group_size
        sizes[g] = sizes.get(g, len(prompt_ids[g])) + max(len(completion_ids[r]) - 1, 0)
    return max(sizes.values(), default=0)


def pair_cost(model: torch.nn.Module, attention_slowdown: float) -> float:
    """Returns attention FLOPs per (query, key) pair over dense FLOPs per token, from the config (0 if unknown).

    Layers cancel out; a dense-mask attention kernel pays for masked pairs too, and runs at a lower
    FLOP rate than the projections, by `attention_slowdown` (FastConfig.attention_slowdown).
    """
    config, shape = text_config(model), attention_shape(model)
    if shape is None or not hasattr(config, "hidden_size"):
        return 0.0
    heads, kv_heads, head_dim = shape
    hidden = config.hidden_size
    inter = getattr(config, "intermediate_size", None) or 4 * hidden
    per_token = 2 * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter)
    per_pair = 4 * heads * head_dim
    return attention_slowdown * per_pair / per_token
