"""Batched multi-turn decoding: every episode of a batch decodes together, and between turns the KV cache is
extended with the inserted tokens (tool results, environment observations, turn markers) instead of
re-encoding the episode.

The batch decodes turn by turn. In a turn every live episode samples until it ends its turn (an end-of-turn
id) or reaches its token budget. An episode that ended its turn waits (its cache row gets masked holes while
the others decode) and its agent gets the turn at once, so tools run on their threads while the rest of the
batch still decodes. When no episode decodes any more, the agents hand back the tokens to insert; the
episodes they finish leave the batch; the rest feed their inserted tokens in one forward pass (right-padded,
the padding masked) and the next turn starts from their logits. Prompts that several episodes share (a
group's prompt) are prefilled once.

Positions are explicit per row, so holes in the cache cost memory and a little attention work but change no
result; `extend_cache=False` re-encodes every continuing episode from scratch instead (the reference the
speed table compares against, and the check that extension is exact).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from cohort.errors import NonFiniteSamplingError
from cohort.fastpath.kv_cache import preallocated_cache
from cohort.models import cache_kwargs
from cohort.rollout.base import SamplingParams, left_pad, prefill
from cohort.rollout.graph import CaptureError, continue_decoder
from cohort.rollout.sampling import sample_next
from cohort.runtime.transfer import long_tensors

NON_FINITE = "the policy's next-token logits were not finite while sampling a multi-turn episode"
"""What NonFiniteSamplingError says when a sampled token's log-prob is not finite (eager or static turns)."""


class TurnAgent(Protocol):
    """What the decoder asks of the episodes' owner between turns."""

    def turn_ended(self, row: int, turn: list[int], *, truncated: bool) -> bool:
        """Returns whether episode `row` may go on after the turn it just ended (its sampled tokens `turn`);
        called as soon as the turn ends, so the owner can start the turn's tools while others decode.
        `truncated`: the episode reached its token budget without an end-of-turn (it is over)."""
        ...

    def continuation(self, row: int, room: int) -> list[int] | None:
        """Returns the tokens to insert before episode `row`'s next turn, or None when the episode is over.
        `room` is how many tokens the episode may still hold: the owner ends the episode (None) when its
        insertion would leave no room for a sampled token."""
        ...


@dataclass
class DecodedEpisodes:
    """Each episode's tokens after its prompt: sampled and inserted, a loss mask and the sampler's log-probs."""

    tokens: list[list[int]]
    masks: list[list[bool]]
    """True where the policy sampled the token."""
    logprobs: list[list[float]]
    """The sampler's log-prob of each sampled token (0.0 for inserted ones)."""
    truncated: list[bool]
    """The episode reached its token budget in the middle of a turn."""
    turns: list[int]
    """Turns the policy sampled in each episode."""


def decode_episodes(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    generator: torch.Generator | None,
    agent: TurnAgent,
    *,
    end_of_turn_ids: Sequence[int],
    pad_token_id: int,
    device: torch.device,
    extend_cache: bool = True,
    budgets: Sequence[int] | None = None,
    preallocate: bool = True,
    forward: Callable[..., Any] | None = None,
    static: StaticTurns | None = None,
) -> DecodedEpisodes:
    """Returns the decoded episodes of `prompts` (one per episode; equal prompts are prefilled once), each at most
    its budget (`budgets`, default params.max_completion_length) of tokens after its prompt, sampled and
    inserted together. `preallocate`: the cache writes in place into buffers sized for prompt + budget (growing
    geometrically past it, as holes may need), instead of transformers' DynamicCache, which copies itself at
    every step (measured on a 0.5 M model: extension with it ran at 0.72x re-encoding's speed, with the
    preallocated cache at 2.0x). forward: what calls `model` (cohort.rollout.casts.cast_once), `model` itself by
    default. static: decode each turn long enough with the builtin engine's static step (captured as a CUDA graph
    on a GPU: fast.graph_decode), where it can."""
    n_rows = len(prompts)
    budget = [params.max_completion_length] * n_rows if budgets is None else list(budgets)
    if len(budget) != n_rows or min(budget, default=1) < 1:
        raise ValueError(f"decode_episodes needs one budget >= 1 per prompt, got {budgets!r}")
    out = new_episodes(n_rows)
    ends = frozenset(int(t) for t in end_of_turn_ids)
    capacity = max(len(p) for p in prompts) + max(budget)
    call = forward or model
    state = _Batch.prefill(
        model, prompts, pad_token_id, device, capacity=capacity if preallocate else None, forward=call
    )
    while state.rows:
        if static is None or not static.takes(state, out, budget):
            _decode_turn(call, state, params, generator, agent, out, ends, budget)
        else:
            static.decode_turn(model, call, state, params, generator, agent, out, ends, budget, pad_token_id)
        blocks = insert_continuations(agent, [row for row in state.rows if state.live[row]], out, budget)
        keep = [row for row in state.rows if row in blocks]
        if not keep:
            break
        if extend_cache:
            state.select(keep)
            state.extend(call, [state.pending[row] + blocks[row] for row in keep], pad_token_id)
        else:
            state = _Batch.prefill(
                model,
                [list(prompts[row]) + out.tokens[row] for row in keep],
                pad_token_id,
                device,
                rows=keep,
                capacity=capacity if preallocate else None,
                forward=call,
            )
    return out


def new_episodes(n_rows: int) -> DecodedEpisodes:
    """Returns the empty DecodedEpisodes of `n_rows` episodes (nothing decoded yet)."""
    return DecodedEpisodes(
        tokens=[[] for _ in range(n_rows)],
        masks=[[] for _ in range(n_rows)],
        logprobs=[[] for _ in range(n_rows)],
        truncated=[False] * n_rows,
        turns=[0] * n_rows,
    )


def insert_continuations(
    agent: TurnAgent, rows: Sequence[int], out: DecodedEpisodes, budget: Sequence[int]
) -> dict[int, list[int]]:
    """Returns row -> the tokens the agent inserted after each of `rows`' last turn (rows it ended are absent),
    after appending them to `out` (mask False, log-prob 0.0); ValueError for an insertion that leaves no room
    for a sampled token."""
    blocks: dict[int, list[int]] = {}
    for row in rows:
        room = budget[row] - len(out.tokens[row])
        ids = agent.continuation(row, room)
        if ids is None:
            continue
        if not 0 < len(ids) < room:
            raise ValueError(
                f"episode {row}: the agent inserted {len(ids)} tokens where {room - 1} at most fit "
                "(an insertion must leave room for a sampled token)"
            )
        blocks[row] = ids
        out.tokens[row] += ids
        out.masks[row] += [False] * len(ids)
        out.logprobs[row] += [0.0] * len(ids)
    return blocks


class _Batch:
    """The decoding batch: live rows, their cache, attention mask with holes, next positions and last logits."""

    def __init__(self, rows, cache, mask, pos, logits, model) -> None:
        self.rows: list[int] = rows
        """slot -> episode row"""
        self.cache, self.mask, self.pos, self.logits = cache, mask, pos, logits
        # asked of the model, once: `forward` may be a function that calls it, whose signature says nothing
        self.cache_kwargs = cache_kwargs(model, cache)
        self.live: dict[int, bool] = dict.fromkeys(rows, True)
        """row -> may still continue (False once its agent ended it)"""
        self.pending: dict[int, list[int]] = {row: [] for row in rows}
        """row -> sampled tokens not yet in the cache (an episode's last token until the next forward)"""

    @classmethod
    def prefill(cls, model, prompts, pad_token_id, device, rows=None, capacity=None, forward=None) -> _Batch:
        """Returns the batch after one forward of the distinct prompts, expanded to one slot per episode (a
        preallocated cache of `capacity` positions when given, else a DynamicCache); forward: as in `prefill`."""
        rows = list(range(len(prompts))) if rows is None else rows
        distinct: dict[tuple[int, ...], int] = {}
        index = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        ids, attn = left_pad(list(distinct), pad_token_id, device)  # [U, P]
        config = getattr(model, "config", None)
        cache = preallocated_cache(config, capacity) if capacity else DynamicCache(config=config)
        logits = prefill(model, ids, attn, cache, forward)  # [U, V]
        (expand,) = long_tensors([index], device)  # [n]
        cache.batch_select_indices(expand)
        return cls(rows, cache, attn[expand], attn.sum(-1)[expand], logits[expand], model)

    def select(self, keep: list[int]) -> None:
        """Keeps only the slots of rows `keep` (in the batch's order)."""
        if keep == self.rows:
            return
        slot = {row: i for i, row in enumerate(self.rows)}
        (index,) = long_tensors([[slot[row] for row in keep]], self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask, self.pos, self.logits = self.mask[index], self.pos[index], self.logits[index]
        self.rows = keep

    def step(self, forward, tokens: torch.Tensor, fed: torch.Tensor) -> None:
        """Feeds one token per slot ([n]; `fed` [n] bool: the slots whose token is real, the rest are holes)
        through `forward` (the model, or what calls it)."""
        self.mask = torch.cat([self.mask, fed.long()[:, None]], dim=1)  # [n, L+1]
        self.logits = forward(
            input_ids=tokens[:, None],
            attention_mask=self.mask,
            position_ids=self.pos[:, None],
            **self.cache_kwargs,
        ).logits[:, -1, :]  # [n, V]
        self.pos = self.pos + fed.long()

    def extend(self, forward, blocks: list[list[int]], pad_token_id: int) -> None:
        """Feeds each slot its block of tokens in one forward (right-padded, padding masked; `forward` as in
        `step`); the logits become those after each block's last token."""
        device = self.mask.device
        width = max(len(b) for b in blocks)
        ids, lengths = long_tensors(
            [[b + [pad_token_id] * (width - len(b)) for b in blocks], [len(b) for b in blocks]], device
        )  # [n, K], [n]
        span = torch.arange(width, device=device)  # [K]
        block_mask = (span[None, :] < lengths[:, None]).long()  # [n, K]
        self.mask = torch.cat([self.mask, block_mask], dim=1)  # [n, L+K]
        logits = forward(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=self.pos[:, None] + span[None, :],
            **self.cache_kwargs,
        ).logits  # [n, K, V]
        self.logits = logits[torch.arange(len(blocks), device=device), lengths - 1]  # [n, V]
        self.pos = self.pos + lengths
        self.live = dict.fromkeys(self.rows, True)
        self.pending = {row: [] for row in self.rows}


def _decode_turn(
    forward,
    state: _Batch,
    params,
    generator,
    agent,
    out: DecodedEpisodes,
    ends: frozenset[int],
    budget: list[int],
) -> None:
    """Samples one turn of every slot of `state` until each has ended it or reached its budget.

    Which slots still decode is known on the host (it decides it), so a step reads the device once: the sampled
    tokens and their log-probs, in one copy. The slots it feeds go to the device in one queued copy."""
    device = state.mask.device
    decoding = [True] * len(state.rows)  # slot -> samples this turn
    turn_start = {row: len(out.tokens[row]) for row in state.rows}
    for row in state.rows:
        out.turns[row] += 1
    while True:
        n = len(state.rows)
        live = [slot for slot in range(n) if decoding[slot]]
        if len(live) == n:
            logits, index = state.logits, None
        else:
            index, fed = long_tensors([live, decoding], device)  # [m], [n]
            logits = state.logits[index]
        tok, lp = sample_next(logits, params, generator)  # [m], [m]
        sampled = torch.stack([tok.double(), lp.double()]).tolist()  # the step's one read of the device
        for slot, token, logp in zip(live, map(int, sampled[0]), sampled[1]):
            if not math.isfinite(logp):
                # On a GPU the draw takes a uniform token from a non-finite row (drawable: CUDA's multinomial would
                # assert, uncatchably); the log-prob says so, read here with the token at no extra wait.
                raise NonFiniteSamplingError(NON_FINITE)
            row = state.rows[slot]
            out.tokens[row].append(token)
            out.masks[row].append(True)
            out.logprobs[row].append(logp)
            state.pending[row] = [token]
            stop = token in ends
            full = len(out.tokens[row]) >= budget[row]
            if stop or full:
                decoding[slot] = False
                truncated = full and not stop
                out.truncated[row] = truncated
                turn = out.tokens[row][turn_start[row] :]
                state.live[row] = agent.turn_ended(row, turn, truncated=truncated) and not truncated
        if not any(decoding):
            return  # the last tokens wait in `pending`: fed with the next turn's inserted block
        if index is None:
            tokens, fed = tok, torch.ones(n, dtype=torch.long, device=device)  # [n] x2
        else:
            tokens = torch.zeros(n, dtype=torch.long, device=device).index_copy_(0, index, tok)  # [n]
        state.step(forward, tokens, fed)  # the slots that sampled this step feed their token
        for slot in live:
            state.pending[state.rows[slot]] = []
        decoding = _drop_finished(state, decoding)


def _drop_finished(state: _Batch, decoding: list[bool]) -> list[bool]:
    """Returns `decoding` for the slots kept after dropping those whose episode is over, once they are a quarter
    of the batch (until then their cache rows only cost a little memory)."""
    keep_slots = [i for i, row in enumerate(state.rows) if state.live[row] or decoding[i]]
    if (len(state.rows) - len(keep_slots)) * 4 < len(state.rows) or not keep_slots:
        return decoding
    state.select([state.rows[i] for i in keep_slots])
    return [decoding[i] for i in keep_slots]


@dataclass
class StaticTurns:
    """How multi-turn episodes decode their turns with the builtin engine's static step (cohort.rollout.graph): each
    turn continues every episode of the batch from its cache so far (the holes masked), end-of-turn ids as its EOS,
    captured as a CUDA graph when `capture`. `on_failure(error)` is told once when a capture fails; that turn and
    every later one then decode eagerly (`failed`)."""

    capture: bool
    min_tokens: int = 16
    """A turn decodes statically only when some episode may sample this many tokens in it."""
    check_every: int = 8
    compiled: bool = False
    weights: dict[str, torch.Tensor] | None = None
    """The Linear weights cast once for the whole batch (cast_once), handed to the step instead of casting again."""
    on_failure: Callable[[Exception], None] | None = None
    failed: bool = False
    turns: int = 0
    """Turns decoded statically so far."""

    def takes(self, state: _Batch, out: DecodedEpisodes, budget: Sequence[int]) -> bool:
        """Returns whether the next turn of `state` decodes statically."""
        room = max(budget[row] - len(out.tokens[row]) for row in state.rows)
        return not self.failed and room >= self.min_tokens

    def decode_turn(
        self,
        model,
        forward,
        state: _Batch,
        params,
        generator,
        agent,
        out: DecodedEpisodes,
        ends: frozenset[int],
        budget: list[int],
        pad_token_id: int,
    ) -> None:
        """Samples one turn of every slot of `state` with the static step, as `_decode_turn` samples it eagerly: each
        row until its end-of-turn id or its budget, the agent told of each ended turn as soon as the host hears of
        it, the last token of each turn left pending; the keys of the others join the cache (holes where a row had
        ended). A failed capture leaves everything as it was and decodes the turn eagerly (through `forward`)."""
        rows, device = list(state.rows), state.mask.device
        room = [budget[row] - len(out.tokens[row]) for row in rows]  # [n] tokens each row may still sample
        told: dict[int, bool] = {}  # slot -> the agent's answer, for turns ended by an end-of-turn id

        def finished(slot: int, turn: list[int]) -> None:
            if len(turn) <= room[slot]:  # an end-of-turn beyond the row's budget: cut by the budget, below
                told[slot] = agent.turn_ended(rows[slot], turn, truncated=False)

        turn_params = dataclasses.replace(params, max_completion_length=max(room))
        try:
            with continue_decoder(
                model,
                [_filled(layer) for layer in state.cache.layers],
                state.mask,
                state.logits,
                state.pos,
                turn_params,
                generator,
                device,
                eos_token_ids=sorted(ends),
                pad_token_id=pad_token_id,
                compiled=self.compiled,
                weights=self.weights,
            ) as decoder:
                tokens, lengths, ended, logps = decoder.run(
                    generator, capture=self.capture, check_every=self.check_every, on_finished=finished
                )
                own = [_filled(layer) for layer in decoder.cache.layers]  # [n, Hkv, T, D] each
                host = torch.stack([tokens.double(), logps.double()]).cpu()  # [2, n, T], one copy
                lengths_h, ended_h = lengths.tolist(), ended.tolist()
                taken = [
                    lengths_h[i] if ended_h[i] and lengths_h[i] <= room[i] else room[i]
                    for i in range(len(rows))
                ]
                width = max(taken) - 1  # own columns fed: every token of the turn but its last (pending)
                if width > 0:
                    for layer, (k, v) in zip(state.cache.layers, own):
                        dtype = _filled(layer)[0].dtype  # the static step's keys may be autocast's dtype
                        layer.update(k[:, :, :width].to(dtype), v[:, :, :width].to(dtype))
        except CaptureError as e:
            self.failed = True
            if self.on_failure is not None:
                self.on_failure(e)
            if told:  # the agent heard of turns (it cannot: run() captures before its first report)
                raise
            _decode_turn(forward, state, params, generator, agent, out, ends, budget)
            return
        self.turns += 1
        columns = torch.arange(max(width, 0), device=device)  # [W]
        (fed,) = long_tensors([[t - 1 for t in taken]], device)  # [n] own columns each row fed
        state.mask = torch.cat([state.mask, (columns[None, :] < fed[:, None]).long()], dim=1)  # [n, L + W]
        state.pos = state.pos + fed
        for i, row in enumerate(rows):
            turn = [int(t) for t in host[0, i, : taken[i]].tolist()]
            logps_row = host[1, i, : taken[i]].tolist()
            if not all(math.isfinite(lp) for lp in logps_row):
                # the race drew a uniform token from a non-finite row (drawable); its log-prob says so
                raise NonFiniteSamplingError(NON_FINITE)
            out.turns[row] += 1
            out.tokens[row] += turn
            out.masks[row] += [True] * taken[i]
            out.logprobs[row] += logps_row
            state.pending[row] = [turn[-1]]
            stop = i in told
            out.truncated[row] = not stop
            live = told[i] if stop else agent.turn_ended(row, turn, truncated=True)
            state.live[row] = live and stop
        _drop_finished(state, [False] * len(rows))


def _filled(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns a full-attention cache layer's (keys, values) [n, Hkv, L, D]."""
    return layer.keys, layer.values
