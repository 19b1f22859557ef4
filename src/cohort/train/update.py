"""One policy update over a scored rollout batch: μ passes × minibatches × micro-batches.

- π_old is only computed when the policy moves before a minibatch is used (μ > 1 or several minibatches);
  otherwise the ratio is taken against the detached current log-probs, which is the same number;
- π_ref is only computed when beta > 0 (with LoRA, by switching the adapter off, not a second model);
- micro-batches fit a token budget counted in the layout their pass takes (`cohort.logprobs.pass_layout`): whole
  groups bucketed by length for the grouped layouts, rows sorted by length for padded ones;
- the fast paths (zero-advantage skipping, the log-prob layouts, the chunked LM head) follow the `fast`
  switches (`cohort.fastpath`) and the update reports which ones ran (UpdateStats.paths).
With several processes the per-process losses use the global normalisers (`cohort.algo.loss_normalisers`)
and gradients are summed, so the update equals the one a single process would make on the whole batch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.nn.utils.rnn import pad_sequence

from cohort.algo import (
    LOSS_TYPES,
    POLICY_LOSSES,
    check_loss_options,
    loss_normalisers,
    optimal_token_baseline,
    policy_loss,
    sampler_correction,
    topk_divergence_from_logprobs,
)
from cohort.algo.controls import SAMPLER_CORRECTIONS, ControlSettings, TokenControls, token_controls
from cohort.algo.entropy import adapt_entropy_coef, applied_entropy_coef, entropy_bonus
from cohort.config import AlgoConfig, ClipCov, KLCov
from cohort.config.kinds import kind_name
from cohort.errors import NonFiniteError, TrainingError
from cohort.fastpath import FastConfig
from cohort.fastpath.attention import flash_first, hold_attention
from cohort.fastpath.skipping import skip_unavailable, zero_advantage_rows
from cohort.fastpath.switches import choose
from cohort.logprobs import completion_logprobs, pass_layout
from cohort.models import input_device, text_config
from cohort.runtime import distributed as dist
from cohort.runtime import seeds
from cohort.runtime.optim import applied_lr
from cohort.runtime.sharding import full_value, gathered, idle_backward, idle_forward, is_sharded, reshard
from cohort.runtime.transfer import to_device
from cohort.train.accumulate import UpdateMeter, UpdateStats, WeightedMeans


@dataclass
class PolicyBatch:
    """A scored rollout batch, ready for the update (N rows, group-contiguous)."""

    prompt_ids: list[list[int]]  # B prompts
    completion_ids: list[list[int]]  # N completions
    group_size: int
    advantages: torch.Tensor  # [N] float32
    in_loss: torch.Tensor  # [N] bool: False for rows removed by filters
    sampling_logprobs: list[torch.Tensor] | None = None
    """Per row the sampler's log-prob of each sampled token (the rollout's), to measure the trainer's gap to it."""
    token_advantages: list[torch.Tensor] | None = None
    """Per row one advantage per completion token (process supervision); then `advantages` holds row means."""
    group_offset: int = 0
    """Global index of this process's first group (several processes: the groups of lower ranks before it)."""
    total_groups: int | None = None
    """Groups in the whole batch over every process (None: this process's own), so minibatches are drawn from
    the global batch the same way whatever the number of processes."""
    loss_masks: list[torch.Tensor] | None = None
    """Per row a bool [T_row]: True where the policy sampled the token, False where a tool or a template
    inserted it (RolloutBatch.loss_masks). None: every token is the policy's. Inserted tokens stay in the
    forward pass (the policy reads them) but not in the loss, its normalisers, the KL, entropy, clip and
    sampler-gap metrics."""
    rewards: torch.Tensor | None = None
    """[N] each row's combined reward: the return the Optimal Token Baseline's per-token advantages are taken
    from (algo.advantage=optimal_token_baseline; None otherwise)."""
    topk_ids: list[torch.Tensor] | None = None
    """Per row the sampler's top-K token ids [T_row, K] (RolloutBatch.topk_ids): DPPO's top-K divergence
    (algo.dppo_topk > 0) is taken over them; None otherwise."""
    topk_logprobs: list[torch.Tensor] | None = None
    """Per row the sampler's log-probs [T_row, K] of topk_ids (RolloutBatch.topk_logprobs)."""

    @property
    def lengths(self) -> list[int]:
        """Return each completion's length in tokens (every token the forward pass reads)."""
        return [len(c) for c in self.completion_ids]

    @property
    def loss_lengths(self) -> list[int]:
        """Return each completion's tokens in the loss: its length, less the tokens inserted by tools."""
        if self.loss_masks is None:
            return self.lengths
        return [int(m.sum()) for m in self.loss_masks]


@dataclass
class PlannedMinibatch:
    """One minibatch of an update, planned before its passes (PolicyUpdater._plan)."""

    rows: list[int]
    """Its rows on this process."""
    work: list[int]
    """Those in the loss that are computed (not skipped for a zero advantage)."""
    micro_batches: list[list[int]]
    """`work` in micro-batches, sharded: padded with empty ones to the busiest process's count."""
    fast: FastConfig
    """The switches its micro-batches compute their log-probs with (cohort.logprobs.pass_layout)."""
    num_items: int
    num_sequences: int
    """The loss's normalisers over every process (loss_normalisers)."""
    tokens: int
    """Tokens in the loss over every process (the entropy bonus's mean)."""


def pad_rows(
    values: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
    n: int | Sequence[int],
    dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """Returns rows 0..n-1 of `values` (or the rows `n` lists, in its order) zero-padded to the longest,
    [n, T_max] (or [n, T_max, K]), in `dtype` (the first row's when None) on the first row's device; a row a
    mapping lacks is all zeros; None when there is none."""
    present = list(values.values()) if isinstance(values, Mapping) else list(values)
    if not present:
        return None
    first = present[0]
    if isinstance(values, Mapping):
        empty = first.new_zeros((0, *first.shape[1:]))
        rows = [values.get(r, empty) for r in (range(n) if isinstance(n, int) else n)]
    else:
        rows = present if isinstance(n, int) else [present[r] for r in n]
    if not rows:
        return first.new_zeros((0, 0, *first.shape[1:]), dtype=dtype)
    if dtype is not None:
        rows = [v.to(dtype) for v in rows]
    return pad_sequence(rows, batch_first=True)


@dataclass
class TokenTable:
    """An update's per-token inputs, each padded once to [N, T_max] over the N rows the update computes (`index`
    maps a batch row to its table row; zero-advantage rows it skips are left out), so that a micro-batch takes its
    rows by index (TokenTable.take) instead of stacking them from per-row tensors.

    Each entry costs N x T_max values (float32: 4 MiB for 1024 rows of 1024 tokens; top-K entries K times
    that), next to which one micro-batch's activations are large; the tables on the model's device are
    π_old's and π_ref's, whose per-row tensors are the same values already held there."""

    sampled: torch.Tensor | None = None
    """The sampler's log-probs (PolicyBatch.sampling_logprobs)."""
    inserted: torch.Tensor | None = None
    """bool: the policy's own tokens (PolicyBatch.loss_masks; None: every token is the policy's)."""
    token_adv: torch.Tensor | None = None
    """Per-token advantages (process rewards or the Optimal Token Baseline), in their widest dtype."""
    old: torch.Tensor | None = None
    """log π_old, when a pass computed it."""
    ref: torch.Tensor | None = None
    """log π_ref, when beta > 0."""
    sampled_topk: torch.Tensor | None = None
    """[N, T_max, K] the sampler's top-K log-probs (DPPO's anchor under trust_region_anchor=sampler)."""
    old_topk: torch.Tensor | None = None
    """[N, T_max, K] π_old's log-probs at those ids (DPPO's anchor after a π_old pass)."""
    index: dict[int, int] | None = None
    """Batch row -> table row, when the table holds only the rows the update computes (None: row r at r)."""

    def at(self, rows: Sequence[int]) -> list[int]:
        """Returns the table rows of batch rows `rows` (what TokenTable.take takes)."""
        return list(rows) if self.index is None else [self.index[r] for r in rows]

    @staticmethod
    def take(
        values: torch.Tensor,
        rows: Sequence[int],
        width: int,
        device: torch.device,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Returns the table's `rows` cut to `width` tokens, [n, width] (or [n, width, K]), on `device`."""
        # One gather and at most one copy to the device per micro-batch; the padding is the zeros the per-row
        # stacking wrote, so the micro-batch is the same tensor bit for bit.
        index = to_device(torch.tensor(rows, dtype=torch.long), values.device)
        return to_device(values[index, :width], device, dtype)


@contextlib.contextmanager
def checkpointing_layers(model: torch.nn.Module) -> Iterator[None]:
    """Yields with the model's gradient-checkpointed layers in training mode, restoring them after.

    transformers recomputes a layer in the backward pass only when the layer is training; cohort keeps the
    policy in eval mode (no dropout), so only the checkpointed layers themselves are switched (not their
    submodules: dropout stays off) and only for the update's forward and backward passes.
    """
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    before = [m.training for m in layers]
    # The backward pass recomputes layers after the forward's attention switch has been undone: cohort's
    # attention (segment plans, plain sdpa for any other mask) stays selected for the whole update instead,
    # so recomputed segment attention follows the same plan (see cohort.logprobs, attention_held).
    hold = bool(layers) and getattr(text_config(model), "_attn_implementation", None) == "sdpa"
    for m in layers:
        m.training = True
    try:
        with hold_attention(model) if hold else contextlib.nullcontext():
            yield
    finally:
        for m, flag in zip(layers, before):
            m.training = flag


def plan_micro_batches(
    rows: Sequence[int],
    group_size: int,
    prompt_lengths: Sequence[int],
    completion_lengths: Sequence[int],
    token_budget: int,
    *,
    padded: bool = False,
) -> list[list[int]]:
    """Return `rows` split into micro-batches whose layout fits the budget: whole groups in the grouped layout,
    or, with `padded`, completions in one padded row each.

    Grouped: a group costs its prompt once plus its selected completions; groups are sorted by that cost so the
    groups batched together have similar lengths (little padding). A group larger than the budget on
    its own is split into several micro-batches. Padded: a row costs its prompt plus its completion, and a
    micro-batch its longest row times its rows; rows are sorted by cost, longest first, and a row longer than the
    budget is a micro-batch of its own.
    """
    if padded:
        return _plan_padded(rows, group_size, prompt_lengths, completion_lengths, token_budget)
    by_group: dict[int, list[int]] = {}
    for r in rows:
        by_group.setdefault(r // group_size, []).append(r)
    pieces: list[tuple[int, list[int]]] = []
    for g, members in by_group.items():
        cost = prompt_lengths[g]
        chunk: list[int] = []
        for r in members:
            extra = completion_lengths[r]
            if chunk and cost + extra > token_budget:
                pieces.append((cost, chunk))
                cost, chunk = prompt_lengths[g], []
            chunk.append(r)
            cost += extra
        pieces.append((cost, chunk))
    pieces.sort(key=lambda p: -p[0])
    micro: list[list[int]] = []
    current: list[int] = []
    longest = count = 0
    for cost, chunk in pieces:
        if current and max(longest, cost) * (count + 1) > token_budget:
            micro.append(current)
            current, longest, count = [], 0, 0
        current += chunk
        longest = max(longest, cost)
        count += 1
    if current:
        micro.append(current)
    return micro


def _plan_padded(rows, group_size, prompt_lengths, completion_lengths, token_budget) -> list[list[int]]:
    """Returns `rows` in micro-batches of padded rows (plan_micro_batches with padded=True): as few as the budget
    allows, as even as that many can be (the largest sets the peak memory, and a small last one saves no pass)."""
    cost = {r: prompt_lengths[r // group_size] + completion_lengths[r] for r in rows}
    order = sorted(rows, key=lambda r: -cost[r])  # stable: equal costs keep their order

    def fill(budget: int) -> list[list[int]]:
        micro: list[list[int]] = []
        current: list[int] = []
        longest = 0
        for r in order:
            if current and max(longest, cost[r]) * (len(current) + 1) > budget:
                micro.append(current)
                current, longest = [], 0
            current.append(r)
            longest = max(longest, cost[r])
        if current:
            micro.append(current)
        return micro

    fewest = fill(token_budget)
    # The smallest budget that still needs no more micro-batches (their count only grows as the budget shrinks).
    low, high = max(cost.values(), default=1), token_budget
    while low < high:
        mid = (low + high) // 2
        if len(fill(mid)) <= len(fewest):
            high = mid
        else:
            low = mid + 1
    return fill(high) if high < token_budget else fewest


class PolicyUpdater:
    """Applies the GRPO-family objective to a PolicyBatch: computes log-probs, losses and optimizer steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        algo: AlgoConfig,
        *,
        temperature: float,
        max_completion_length: int,
        micro_batch_tokens: int,
        max_grad_norm: float,
        reference: Callable[[], contextlib.AbstractContextManager[torch.nn.Module]] | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        fast: FastConfig | None = None,
        gather_frozen: bool = True,
    ):
        """gather_frozen: with a sharded model, the passes without gradients (pi_old, the reference, evaluate_loss)
        run on the whole model gathered once (fast; the memory of the whole parameters, which in-process sampling
        needs anyway) rather than layer by layer as the update does (rollout workers: no process ever holds the
        whole model)."""
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.algo = algo
        self.temperature = temperature
        self.max_completion_length = max_completion_length
        self.micro_batch_tokens = micro_batch_tokens
        self.max_grad_norm = max_grad_norm
        self.reference = reference
        self.autocast = autocast
        self.fast = (FastConfig() if fast is None else fast).validate()
        self.sharded = is_sharded(model)
        self.gather_frozen = gather_frozen
        self.device = input_device(model)
        cov = algo.cov
        correction = algo.applied_sampler_is()
        selection = (
            f"algo.cov={cov.KIND}"
            if cov is not None
            else "algo.top_entropy_quantile"
            if algo.top_entropy_quantile < 1
            else None
        )
        builtin_loss = algo.loss_type in LOSS_TYPES
        self.controls = ControlSettings(
            top_entropy_quantile=algo.top_entropy_quantile,
            cov_method=cov.KIND if cov is not None else "none",
            cov_ratio=cov.ratio if cov is not None else None,
            clip_cov_bounds=(float(cov.bounds[0]), float(cov.bounds[1]))
            if isinstance(cov, ClipCov)
            else (1.0, 5.0),
            sampler_correction=kind_name(correction),
            sampler_is_max=correction.max_ratio if correction is not None else 2.0,
            sampler_is_min=getattr(correction, "min_ratio", None),
            off_policy_mask_threshold=algo.off_policy_mask_threshold,
        )
        # trust_region_anchor=sampler: the ratio, DPPO's masks and kl_tau are taken against the sampler's
        # log-probs, which then stand in for pi_old on every pass (the config refuses a sampler correction).
        self.sampler_anchor = algo.trust_region_anchor == "sampler"
        # DPPO's top-K mask (algo.dppo_topk = K > 0): the divergence over the sampler's top-K ids replaces the
        # binary one; its anchor follows trust_region_anchor like the ratio's.
        self.topk = int(algo.dppo_topk)
        # Entropy regularisation: the controller's coefficient and last measured entropy are run state
        # (saved in checkpoints through entropy_state).
        self.entropy_on = algo.entropy_coef != 0 or algo.adaptive_entropy is not None
        # The adaptive coefficient's controller (None: a constant coefficient).
        self.adaptive = algo.adaptive_entropy
        # The objective's settings, the same keywords for every policy_loss call (update, evaluate_loss), which
        # checks them once; checked here too, so that a bad one fails before any work.
        self._loss_settings: dict[str, Any] = dict(
            loss_type=algo.loss_type,
            aggregation=algo.aggregation,
            loss_kwargs=algo.loss_kwargs,
            eps_low=algo.eps_low,
            eps_high=algo.eps_high,
            delta=algo.delta,
            beta=algo.beta,
            max_completion_length=max_completion_length,
            importance=algo.importance,
            kl_kind=algo.kl_estimator,
            kl_tau=algo.kl_tau,
            use_bias_correction_kl=algo.use_bias_correction_kl,
        )
        spec = POLICY_LOSSES.get(check_loss_options(**self._loss_settings).loss_type)
        self.folds_sampler_weights = spec is not None and spec.folds_sampler_weights
        self.entropy_coef = float(algo.entropy_coef)
        self.last_entropy: float | None = None
        # `on` that cannot be honoured fails here, before any work.
        self.skip_zero = choose(
            self.fast.skip_zero_advantage,
            "skip_zero_advantage",
            model,
            # where it cannot apply, auto simply computes every row; `on` is an error
            worth=algo.beta == 0
            and algo.kl_tau == 0
            and builtin_loss
            and selection is None
            and not self.entropy_on,
            unavailable=lambda: skip_unavailable(
                algo.beta,
                builtin_loss=builtin_loss,
                selection=selection,
                entropy_bonus=self.entropy_on,
                kl_tau=algo.kl_tau,
            ),
        )
        # Zero (not None) gradients make a step whose rows were all skipped identical to one that
        # back-propagated zeros: AdamW still advances its moments and applies weight decay.
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    # ------------------------------------------------------------------ helpers
    def _logprobs(
        self,
        model,
        batch: PolicyBatch,
        rows: list[int],
        meter: UpdateMeter | None = None,
        *,
        with_entropy=False,
        with_sum_pi_squared=False,
        with_topk=False,
        fast: FastConfig | None = None,
    ):
        with self.autocast():
            lp = completion_logprobs(
                model,
                batch.prompt_ids,
                batch.completion_ids,
                batch.group_size,
                rows=rows,
                temperature=self.temperature,
                with_entropy=with_entropy,
                fast=self.fast if fast is None else fast,
                with_sum_pi_squared=with_sum_pi_squared,
                topk_ids=batch.topk_ids if with_topk else None,
            )
        if meter is not None:
            meter.path(lp)
        return lp

    @staticmethod
    def _loss_mask(lp, inserted: torch.Tensor | None, rows: list[int]) -> torch.Tensor:
        """Returns the micro-batch's [n, T] tokens in the loss: the completions' tokens less those inserted
        (`inserted`: the update's table of PolicyBatch.loss_masks, None when there are none)."""
        if inserted is None:
            return lp.mask
        return lp.mask & TokenTable.take(inserted, rows, lp.mask.shape[1], lp.mask.device)

    def _micro_batches(
        self, model, batch: PolicyBatch, rows: Sequence[int]
    ) -> tuple[list[list[int]], FastConfig]:
        """Returns `rows` in micro-batches planned for the layout a pass on `model` takes, and the switches that keep
        each micro-batch on it (so that each fits micro_batch_tokens)."""
        layout = pass_layout(model, batch.prompt_ids, batch.completion_ids, batch.group_size, rows, self.fast)
        micros = plan_micro_batches(
            rows,
            batch.group_size,
            [len(p) for p in batch.prompt_ids],
            batch.lengths,
            self.micro_batch_tokens,
            padded=layout.padded,
        )
        return micros, layout.fast

    def _lockstep(self, micros: list[list[int]]) -> list[list[int]]:
        """Returns `micros` padded with empty micro-batches to the busiest process's count (sharded: FSDP gathers
        each layer inside its forward, a collective every process must join as often as the others)."""
        if not self.sharded:
            return micros
        return micros + [[] for _ in range(dist.all_max_int(len(micros)) - len(micros))]

    def _plan(
        self,
        batch: PolicyBatch,
        generator: torch.Generator | None,
        in_loss: list[bool],
        row_zero: torch.Tensor,
    ) -> list[list[PlannedMinibatch]]:
        """Returns each iteration's minibatches, planned. Their sums over the processes and the busiest process's
        micro-batch count (sharded: every process joins as many passes) are reduced in one collective before
        the first pass, none inside the loops; the shuffle stream advances as the loops would advance it."""
        a, lengths = self.algo, batch.loss_lengths
        wanted, local = dist.Reductions(), []
        for it in range(a.num_iterations):
            for mb, mb_rows in enumerate(self._minibatches(batch, generator)):
                rows = [r for r in mb_rows if in_loss[r]]
                asked: list[int] = []  # the sums loss_normalisers asks for, in its order

                def ask(value: int, asked: list[int] = asked) -> int:
                    asked.append(int(value))
                    return int(value)

                loss_normalisers(
                    a.loss_type, [lengths[r] for r in rows], ask, dist.world_size(), aggregation=a.aggregation
                )
                skip = set(zero_advantage_rows(row_zero, rows)) if self.skip_zero else set()
                work = [r for r in rows if r not in skip]
                micros, fast = self._micro_batches(self.model, batch, work)
                key = f"{it}/{mb}"
                for k, v in enumerate(asked):
                    wanted.sum(f"{key}/normaliser/{k}", v)
                wanted.sum(f"{key}/tokens", sum(lengths[r] for r in rows))
                if self.sharded:
                    wanted.max(f"{key}/micro_batches", len(micros))
                local.append((it, key, mb_rows, rows, work, micros, fast, len(asked)))
        total = wanted.reduce()
        plan: list[list[PlannedMinibatch]] = [[] for _ in range(a.num_iterations)]
        for it, key, mb_rows, rows, work, micros, fast, asked_count in local:
            sums = iter([int(total[f"{key}/normaliser/{k}"]) for k in range(asked_count)])

            def summed(value: int, sums: Iterator[int] = sums) -> int:
                return next(sums)

            num_items, num_seq = loss_normalisers(
                a.loss_type, [lengths[r] for r in rows], summed, dist.world_size(), aggregation=a.aggregation
            )
            if self.sharded:
                micros = micros + [[] for _ in range(int(total[f"{key}/micro_batches"]) - len(micros))]
            plan[it].append(
                PlannedMinibatch(mb_rows, work, micros, fast, num_items, num_seq, int(total[f"{key}/tokens"]))
            )
        return plan

    @contextlib.contextmanager
    def _frozen(
        self, model, batch: PolicyBatch, rows: Sequence[int]
    ) -> Iterator[tuple[list[list[int]], FastConfig]]:
        """Yields the micro-batches of `rows` for forwards without gradients on `model`, and their switches: on the
        whole model gathered once (gather_frozen), else layer by layer with empty micro-batches (idle forwards)
        keeping the processes in step, the model resharded after."""
        micros, fast = self._micro_batches(model, batch, rows)
        if self.gather_frozen or not is_sharded(model):
            with gathered(model):
                yield micros, fast
            return
        yield self._lockstep(micros), fast
        reshard(model)  # a forward without gradients leaves FSDP's root module unsharded

    def _frozen_passes(
        self, model, batch: PolicyBatch, rows: Sequence[int], **options
    ) -> Iterator[tuple[list[int], Any]]:
        """Yields (a micro-batch's rows, their log-probs under `model`) of a pass over `rows` (call it without
        gradients); a micro-batch this process has no rows in runs an idle forward, so sharded processes stay in
        step. `options`: _logprobs's (with_entropy, with_sum_pi_squared, with_topk)."""
        with self._frozen(model, batch, rows) as (micros, fast):
            for micro in micros:
                if not micro:
                    with self.autocast():
                        idle_forward(model, self.device)
                    continue
                yield micro, self._logprobs(model, batch, micro, fast=fast, **options)

    @torch.no_grad()
    def frozen_logprobs(
        self,
        model,
        batch: PolicyBatch,
        rows: Sequence[int],
        topk_out: dict[int, torch.Tensor] | None = None,
    ) -> dict[int, torch.Tensor]:
        """Return {row: [T_row] log-probs} under `model` without gradients; topk_out, when given, receives
        {row: [T_row, K]} the log-probs at the batch's top-K ids from the same pass."""
        out: dict[int, torch.Tensor] = {}
        with_topk = topk_out is not None
        for micro, lp in self._frozen_passes(model, batch, rows, with_topk=with_topk):
            for i, r in enumerate(micro):
                out[r] = lp.logp[i, : len(batch.completion_ids[r])]
                if topk_out is not None:
                    topk_out[r] = cast(torch.Tensor, lp.topk_logp)[i, : len(batch.completion_ids[r])]
        return out

    @torch.no_grad()
    def _otb_pass(
        self, batch: PolicyBatch, topk_out: dict[int, torch.Tensor] | None = None
    ) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
        """Returns ({row: [T_row] log pi_old}, per-row [T_row] token advantages) of the Optimal Token Baseline
        over every row of `batch`: one pass without gradients at the sampling temperature whose chunked LM head
        also gives sum_v pi_old(v)^2; the sampler correction's weights, when one is on, scale the proxy (verl).
        topk_out: as in frozen_logprobs."""
        if batch.rewards is None:
            raise TrainingError(
                "algo.advantage=optimal_token_baseline needs each row's reward in the batch, and none was given"
            )
        if batch.token_advantages is not None:
            raise TrainingError(
                "algo.advantage=optimal_token_baseline computes its own per-token advantages from outcome rewards; "
                "a process reward gives per-token advantages too: use algo.advantage=grpo with process rewards"
            )
        n = len(batch.completion_ids)
        rows = list(range(n))
        old: dict[int, torch.Tensor] = {}
        square: dict[int, torch.Tensor] = {}
        keep: dict[int, torch.Tensor] = {}
        inserted = pad_rows(batch.loss_masks, n) if batch.loss_masks is not None else None
        passes = self._frozen_passes(
            self.model, batch, rows, with_sum_pi_squared=True, with_topk=topk_out is not None
        )
        for micro, lp in passes:
            mask = self._loss_mask(lp, inserted, micro)
            squares = cast(torch.Tensor, lp.sum_pi_squared)
            for i, r in enumerate(micro):
                length = len(batch.completion_ids[r])
                old[r], square[r], keep[r] = lp.logp[i, :length], squares[i, :length], mask[i, :length]
                if topk_out is not None:
                    topk_out[r] = cast(torch.Tensor, lp.topk_logp)[i, :length]
        if (
            n == 0
        ):  # a process without groups: it joined the pass's collectives above, and has nothing to score
            return old, []
        width = max((len(c) for c in batch.completion_ids), default=0)
        old_all = self._stack(old, rows, width)  # [N, T]
        mask_all = self._stack(
            {r: m.to(old_all.dtype) for r, m in keep.items()}, rows, width
        ).bool()  # [N, T]
        is_weights = None
        correction = SAMPLER_CORRECTIONS[self.controls.sampler_correction]
        if correction is not None and batch.sampling_logprobs is not None:
            sampled = self._stack({r: batch.sampling_logprobs[r].to(old_all) for r in rows}, rows, width)
            is_weights, _ = sampler_correction(
                old_all,
                sampled,
                mask_all,
                level=correction[0],
                mode=correction[1],
                max_ratio=self.controls.sampler_is_max,
                min_ratio=self.controls.sampler_is_min,
            )
        adv = optimal_token_baseline(
            batch.rewards.to(old_all.device),
            batch.group_size,
            old_logp=old_all,
            sum_pi_squared=self._stack(square, rows, width),
            mask=mask_all,
            is_weights=is_weights,
        )  # [N, T]
        token_adv = [adv[r, : len(batch.completion_ids[r])].float().cpu() for r in rows]
        return old, token_adv

    def _check_topk(self, batch: PolicyBatch) -> None:
        """Raises TrainingError unless the batch carries the sampler's top-K of width algo.dppo_topk."""
        if batch.topk_ids is None or batch.topk_logprobs is None:
            raise TrainingError(
                f"algo.dppo_topk={self.topk} takes DPPO's divergence over the sampler's top-{self.topk} "
                "log-probs, but this rollout carries none; use rollout.engine=builtin without rollout workers or "
                "episodes, or algo.dppo_topk=0"
            )
        widths = {int(t.shape[-1]) for t in batch.topk_ids}
        if widths - {self.topk}:
            raise TrainingError(
                f"algo.dppo_topk={self.topk}, but the rollout's top-K log-probs have K = {sorted(widths)}; sample "
                f"with SamplingParams(logprobs_topk={self.topk})"
            )

    def _topk_divergence(self, lp, table: TokenTable, at: list[int], width: int) -> torch.Tensor:
        """Returns the micro-batch's [n, T] detached top-K divergence of the policy from its anchor (TV for
        dppo_tv, KL for dppo_kl; `at`: the micro-batch's rows in the token table): the sampler's top-K log-probs (trust_region_anchor=sampler), pi_old's at the same
        ids (old, with a pi_old pass), else the current policy's own (pi_old = the policy: divergence 0)."""
        policy = cast(torch.Tensor, lp.topk_logp).detach()  # [n, T, K]
        if self.sampler_anchor:
            assert table.sampled_topk is not None  # _check_topk
            anchor = TokenTable.take(table.sampled_topk, at, width, policy.device)
        elif table.old_topk is not None:
            anchor = TokenTable.take(table.old_topk, at, width, policy.device)
        else:
            anchor = policy
        kl, tv = topk_divergence_from_logprobs(policy, anchor)  # [n, T] each
        return (kl if self.algo.loss_type == "dppo_kl" else tv).detach()

    def _token_table(
        self,
        batch: PolicyBatch,
        token_adv: torch.Tensor | None,
        old: dict[int, torch.Tensor] | None,
        ref: dict[int, torch.Tensor] | None,
        old_topk: dict[int, torch.Tensor] | None,
        rows: list[int],
    ) -> TokenTable:
        """Returns the update's TokenTable over `rows` (those its micro-batches compute, in order): every per-token
        input they read, padded once. `token_adv` is already the padded table of every row."""
        # A zero-advantage row skipped by the update is never read: most of a typical batch, so not padded.
        picked = (
            token_adv[to_device(torch.tensor(rows, dtype=torch.long), token_adv.device)]
            if token_adv is not None
            else None
        )
        return TokenTable(
            sampled=pad_rows(batch.sampling_logprobs, rows) if batch.sampling_logprobs is not None else None,
            inserted=pad_rows(batch.loss_masks, rows) if batch.loss_masks is not None else None,
            token_adv=picked,
            old=pad_rows(old, rows) if old is not None else None,
            ref=pad_rows(ref, rows) if ref is not None else None,
            sampled_topk=(
                pad_rows(batch.topk_logprobs, rows)
                if self.topk > 0 and self.sampler_anchor and batch.topk_logprobs is not None
                else None
            ),
            old_topk=pad_rows(old_topk, rows) if old_topk is not None else None,
            index={r: i for i, r in enumerate(rows)},
        )

    @staticmethod
    def _token_advantages(token_adv: Sequence[torch.Tensor], n: int) -> torch.Tensor:
        """Returns the per-token advantages of every row padded to [n, T_max], in their widest dtype."""
        # Each row was cast straight to the log-probs' dtype: a table in the widest dtype casts exactly so.
        widest = token_adv[0].dtype if token_adv else torch.get_default_dtype()
        for t in token_adv:
            widest = torch.promote_types(widest, t.dtype)
        padded = pad_rows(token_adv, n, widest)
        return padded if padded is not None else torch.zeros(n, 0, dtype=widest)

    @staticmethod
    def _stack(values: dict[int, torch.Tensor], rows: list[int], width: int) -> torch.Tensor:
        first = next(iter(values.values()))
        out = torch.zeros(len(rows), width, *first.shape[1:], dtype=first.dtype, device=first.device)
        for i, r in enumerate(rows):
            v = values[r]
            out[i, : v.shape[0]] = v
        return out  # [n, T] (or [n, T, K] for per-token vectors)

    def _minibatches(self, batch: PolicyBatch, generator: torch.Generator | None) -> Iterator[list[int]]:
        local = len(batch.prompt_ids)
        total = local if batch.total_groups is None else batch.total_groups
        lo = batch.group_offset
        # The permutation is of the global batch's groups (every process draws the same one), and each process
        # keeps its own groups of each part: K processes make the minibatches one process would.
        order = (
            torch.randperm(total, generator=generator).tolist()
            if self.algo.num_minibatches > 1
            else list(range(total))
        )
        # Near-equal parts: a batch that dynamic sampling could not fill may not divide evenly, and no group
        # is left out (a part may be empty when there are fewer groups than minibatches).
        for part in torch.tensor(order, dtype=torch.long).tensor_split(self.algo.num_minibatches):
            chosen = [g - lo for g in part.tolist() if lo <= g < lo + local]
            yield [g * batch.group_size + i for g in sorted(chosen) for i in range(batch.group_size)]

    def _token_controls(
        self,
        lp,
        mask: torch.Tensor,
        old: torch.Tensor | None,
        sampled: torch.Tensor | None,
        adv: torch.Tensor,
        generator,
    ) -> TokenControls:
        """Returns one micro-batch's token controls (cohort.algo.controls), a missing input as TrainingError."""
        try:
            return token_controls(
                lp.logp,
                mask,
                adv,
                self.controls,
                entropy=lp.entropy,
                old_logp=old,
                sampled_logp=sampled,
                generator=generator,
            )
        except ValueError as e:  # the engine or the log-prob path did not provide what a control reads
            raise TrainingError(f"algo.{e}") from None  # algo's messages name the setting without its section

    # ------------------------------------------------------------------ the update
    def update(self, batch: PolicyBatch, generator: torch.Generator | None = None) -> UpdateStats:
        """Returns the UpdateStats of μ × num_minibatches optimizer steps on `batch`."""
        # The attention backend order holds for the backwards too, and so for recomputed layers (checkpointing).
        with checkpointing_layers(self.model), flash_first(self.fast.flash_first, self.device) as flash:
            stats = self._update(batch, generator)
        stats.paths["flash_first"] = float(flash)
        return stats

    def _update(self, batch: PolicyBatch, generator: torch.Generator | None) -> UpdateStats:
        a = self.algo
        n = len(batch.completion_ids)
        in_loss = batch.in_loss.tolist()
        loss_rows = [r for r in range(n) if in_loss[r]]
        multi_step = a.num_iterations * a.num_minibatches > 1
        if self.sampler_anchor and batch.sampling_logprobs is None:
            raise TrainingError(
                "algo.trust_region_anchor=sampler takes the ratio against the sampler's log-probs, but this rollout "
                "engine returned none; use rollout.engine=builtin or hf, or algo.trust_region_anchor=old"
            )
        if self.topk > 0:
            self._check_topk(batch)
        # Under the sampler anchor the sampler's log-probs are pi_old: no pass computes the trainer's own.
        need_old = multi_step and not self.sampler_anchor
        # DPPO's top-K anchor under trust_region_anchor=old: pi_old's log-probs at the sampler's top-K ids, from
        # the pi_old pass itself (without one, pi_old is the current policy detached, as for the ratio).
        old_topk: dict[int, torch.Tensor] | None = {} if self.topk > 0 and need_old else None
        token_adv = batch.token_advantages
        if a.advantage == "optimal_token_baseline":
            # Its pi_old pass gives the per-token advantages, and pi_old itself where the update needs it.
            otb_old, token_adv = self._otb_pass(batch, topk_out=old_topk)
            old = {r: otb_old[r] for r in loss_rows} if need_old else None
            del otb_old  # its rows are padded into the token table below, where the update reads them
        else:
            old = self.frozen_logprobs(self.model, batch, loss_rows, topk_out=old_topk) if need_old else None
        ref = None
        if a.beta > 0 and self.reference is not None:
            with self.reference() as ref_model:
                ref = self.frozen_logprobs(ref_model, batch, loss_rows)
        adv = batch.advantages
        token_table = self._token_advantages(token_adv, n) if token_adv is not None else None
        del token_adv
        # A row can be skipped when every one of its tokens has advantage 0.
        if token_table is None:
            row_zero = adv
        elif token_table.shape[1] == 0:
            row_zero = torch.zeros(n)
        else:  # the padding's zeros never raise a row's largest |advantage|
            row_zero = token_table.abs().amax(-1).to("cpu", torch.get_default_dtype())
        # Clip-Cov's random draws: a stream per process, seeded from the shared one, so the shared stream
        # (the minibatch permutations) advances the same on every process.
        cov_gen = None
        if isinstance(a.cov, ClipCov):
            seed = int(torch.randint(2**62, (1,), generator=generator)) if generator is not None else 0
            cov_gen = seeds.generator(seeds.clip_cov_draws(seed, dist.rank()))
        meter = UpdateMeter()
        plan = self._plan(batch, generator, in_loss, row_zero)
        computed = sorted(
            {r for planned in plan for p in planned for micro in p.micro_batches for r in micro}
        )
        table = self._token_table(batch, token_table, old, ref, old_topk, computed)
        del old, ref, old_topk, token_table  # the table holds what the update reads of them
        # Each optimizer step's loss on this process (summed over the processes after the loops) and what the
        # meter adds with it.
        steps: list[tuple[float, float, float, float | None]] = []

        for it, minibatches in enumerate(plan):
            for mb_index, planned in enumerate(minibatches):
                mb_rows, work, micros = planned.rows, planned.work, planned.micro_batches
                num_items, num_seq, step_tokens = planned.num_items, planned.num_sequences, planned.tokens
                self.optimizer.zero_grad(set_to_none=False)
                # The entropy bonus is a mean over the optimizer step's loss tokens, every process's.
                if self.entropy_on:
                    apply_coef = self._applied_entropy_coef()
                    entropy_sum = entropy_count = 0.0
                # Sharded: gradients are reduced inside each backward too; the extra passes idle (loss 0).
                for micro in micros:
                    if not micro:
                        with self.autocast():
                            idle_backward(self.model, self.device)
                        continue
                    with_entropy: bool | str = it == 0 or a.top_entropy_quantile < 1 or self.entropy_on
                    if self.entropy_on and apply_coef != 0:
                        with_entropy = "grad"
                    lp = self._logprobs(
                        self.model,
                        batch,
                        micro,
                        meter,
                        with_entropy=with_entropy,
                        with_topk=self.topk > 0,
                        fast=planned.fast,
                    )
                    at = table.at(micro)  # the micro-batch's rows in the token table
                    mask = self._loss_mask(lp, table.inserted, at)
                    width, device = lp.logp.shape[1], lp.logp.device
                    old_mb = TokenTable.take(table.old, at, width, device) if table.old is not None else None
                    # Only before the first optimizer step does the policy still equal the sampler's: the gap is
                    # measured there; the sampler's log-probs are stacked only where something reads them.
                    gap_here = it == 0 and mb_index == 0
                    sampled_mb = None
                    if table.sampled is not None and (
                        gap_here
                        or self.controls.sampler_correction != "none"
                        or self.controls.off_policy_mask_threshold is not None
                        or self.sampler_anchor
                    ):
                        sampled_mb = TokenTable.take(table.sampled, at, width, device)
                    if self.sampler_anchor:
                        old_mb = sampled_mb
                    if gap_here and sampled_mb is not None:
                        meter.sampler_gap(lp.logp, sampled_mb, mask)
                    if table.token_adv is None:
                        adv_mb = to_device(adv[micro], device)
                    else:
                        adv_mb = TokenTable.take(table.token_adv, at, width, device, lp.logp.dtype)
                    # Most runs have no control: the micro-batch loop then skips them entirely.
                    ctl = (
                        self._token_controls(lp, mask, old_mb, sampled_mb, adv_mb, cov_gen)
                        if self.controls.active
                        else None
                    )
                    divergence = self._topk_divergence(lp, table, at, width) if self.topk > 0 else None
                    weights, kl_cov, kept = (ctl.weights, ctl.kl_cov, ctl.kept) if ctl else (None, None, None)
                    sampler_weights = None
                    if ctl and self.folds_sampler_weights:
                        # vespo folds the sampler's ratios into its sequence weight: passed apart, once.
                        weights, sampler_weights = ctl.unsampled_weights, ctl.sampler_weights
                    loss, metrics = policy_loss(
                        lp.logp,
                        old_mb,
                        adv_mb,
                        mask,
                        token_weights=weights,
                        sampler_weights=sampler_weights,
                        kl_cov_mask=kl_cov,
                        kl_cov_coef=a.cov.coef if isinstance(a.cov, KLCov) else 1.0,
                        ref_logp=TokenTable.take(table.ref, at, width, device)
                        if table.ref is not None
                        else None,
                        num_items=num_items,
                        num_sequences=num_seq,
                        divergence=divergence,
                        **self._loss_settings,
                    )
                    if divergence is not None:  # a mean over the loss tokens, weighted by them in the meter
                        kept_div = torch.where(mask, divergence, 0)
                        metrics["dppo/topk_divergence_mean"] = kept_div.sum() / mask.sum().clamp(min=1)
                    if self.entropy_on:  # on the tokens the policy term trains (top-entropy's when set)
                        ent = cast(torch.Tensor, lp.entropy)
                        active = mask if kept is None else mask & kept.bool()
                        if apply_coef != 0:
                            loss = loss + entropy_bonus(ent, active, apply_coef, max(step_tokens, 1))
                        if (
                            self.adaptive is not None
                        ):  # the controller's measurement (a host sync: only when read)
                            entropy_sum += float((ent.detach() * active).sum())
                            entropy_count += float(active.sum())
                    loss.backward()
                    # read after the step's last backward is queued: a read here would make the host wait for
                    # this backward before it queues the next micro-batch's forward
                    meter.queue_micro_batch(loss, mask, metrics, lp.entropy, ctl.metrics if ctl else None)
                total_loss = meter.read_micro_batches()
                params = [p for p in self.model.parameters() if p.requires_grad]
                if self.max_grad_norm and self.max_grad_norm > 0:
                    gn = full_value(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
                else:  # DTensor gradients of a sharded model give the global norm too
                    gn = full_value(
                        torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                    )
                # Both numbers are already on the host: checking them costs no extra synchronisation.
                if not (math.isfinite(total_loss) and math.isfinite(float(gn))):
                    self.optimizer.zero_grad(set_to_none=False)
                    raise NonFiniteError(
                        f"non-finite {'loss' if not math.isfinite(total_loss) else 'gradient'} (loss {total_loss}, "
                        f"gradient norm {float(gn)}); the weights were not updated. Usual causes: a learning rate "
                        f"too high for this model (optim.lr={self.optimizer.param_groups[0]['lr']:g}), half-precision "
                        "overflow (model.dtype), or no gradient clipping (optim.max_grad_norm)"
                    )
                self.optimizer.step()
                if self.scheduler is not None:
                    self.scheduler.step()
                if self.entropy_on:
                    self._adapt_entropy(entropy_sum, entropy_count)
                steps.append(
                    (
                        total_loss,
                        float(gn),
                        len(work) / max(len(mb_rows), 1),
                        self.entropy_coef if self.entropy_on else None,
                    )
                )
        # Each optimizer step's loss over every process: one all-reduce after the update, not one per step.
        losses = dist.Reductions()
        for k, (step_loss, *_) in enumerate(steps):
            losses.sum(str(k), step_loss)
        summed = losses.reduce()
        for k, (_, norm, frac, coef) in enumerate(steps):
            meter.optimizer_step(
                loss=summed[str(k)], grad_norm=norm, rows_computed_frac=frac, entropy_coef=coef
            )
        if dist.is_distributed():  # token-weighted means, extremes and the gap over every process's tokens
            meter.merge_processes(dist.all_gather_objects, dist.rank())
        return meter.stats(
            lr=applied_lr(self.optimizer, self.scheduler),
            skip_zero=self.skip_zero,
            measured_gap=batch.sampling_logprobs is not None,
            entropy_coef=self.entropy_coef if self.entropy_on else None,
        )

    @torch.no_grad()
    def evaluate_loss(self, batch: PolicyBatch) -> dict[str, float]:
        """Returns the objective on `batch` without a step, over this process's rows alone: {"loss", "entropy",
        "kl" (beta > 0)}. The policy is the sampler here (ratio 1), so the policy term is the aggregated
        advantage; the token controls (top-entropy, Clip-Cov, KL-Cov, sampler IS) are left out."""
        a = self.algo
        rows = [r for r in range(len(batch.completion_ids)) if bool(batch.in_loss[r])]
        if not rows:
            return {}
        lengths = batch.loss_lengths
        num_items, num_seq = loss_normalisers(
            a.loss_type, [lengths[r] for r in rows], int, 1, aggregation=a.aggregation
        )
        n = len(batch.completion_ids)
        ref = None
        if a.beta > 0 and self.reference is not None:
            with self.reference() as ref_model:
                ref = pad_rows(self.frozen_logprobs(ref_model, batch, rows), n)
        inserted = pad_rows(batch.loss_masks, n) if batch.loss_masks is not None else None
        apply_coef = self._applied_entropy_coef()
        tokens = max(sum(lengths[r] for r in rows), 1)
        total, means = 0.0, WeightedMeans()
        for micro, lp in self._frozen_passes(self.model, batch, rows, with_entropy=True):
            mask = self._loss_mask(lp, inserted, micro)
            entropy = cast(torch.Tensor, lp.entropy)
            width = lp.logp.shape[1]
            loss, metrics = policy_loss(
                lp.logp,
                None,
                batch.advantages[micro].to(lp.logp.device),
                mask,
                ref_logp=TokenTable.take(ref, micro, width, lp.logp.device) if ref is not None else None,
                num_items=num_items,
                num_sequences=num_seq,
                **self._loss_settings,
            )
            if self.entropy_on and apply_coef != 0:
                loss = loss + entropy_bonus(entropy, mask, apply_coef, tokens)
            total += float(loss)
            ntok = float(mask.sum())
            if "kl" in metrics:
                means.add("kl", float(metrics["kl"]), ntok)
            means.add("entropy", float((entropy * mask).sum() / max(ntok, 1.0)), ntok)
        out = {"loss": total, "entropy": means.get("entropy", 0.0)}
        if means.get("kl") is not None:
            out["kl"] = means.get("kl")
        return out

    def _adapt_entropy(self, entropy_sum: float, entropy_count: float) -> None:
        """Moves the adaptive entropy coefficient after an optimizer step, from the step's entropy over
        every process's tokens (the same decision on every process)."""
        ae = self.adaptive
        if ae is None:
            return
        total, count = dist.all_sum_float(entropy_sum), dist.all_sum_float(entropy_count)
        if count <= 0:  # nothing measured (every row out of the loss): the coefficient stays
            return
        self.last_entropy = total / count
        self.entropy_coef = adapt_entropy_coef(
            self.entropy_coef,
            self.last_entropy,
            target=ae.target,
            delta=ae.delta,
            low=ae.coef_min,
            high=ae.coef_max,
        )

    def _applied_entropy_coef(self) -> float:
        """Returns the entropy coefficient the next optimizer step applies (see applied_entropy_coef)."""
        ae = self.adaptive
        target = ae.target if ae is not None else 0.0
        return applied_entropy_coef(
            self.entropy_coef, self.last_entropy, target=target, adaptive=ae is not None
        )

    def entropy_state(self) -> dict[str, float | None]:
        """Returns the entropy controller's state (coefficient, last measured entropy) for a checkpoint."""
        return {"coef": self.entropy_coef, "last_entropy": self.last_entropy}

    def load_entropy_state(self, state: dict[str, float | None]) -> None:
        """Restores entropy_state()."""
        coef = state.get("coef")
        self.entropy_coef = float(coef) if coef is not None else float(self.algo.entropy_coef)
        last = state.get("last_entropy")
        self.last_entropy = None if last is None else float(last)
