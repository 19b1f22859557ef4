"""One policy update over a scored rollout batch: μ passes × minibatches × micro-batches.

Where the work goes is decided here, so the levers of the speed issue live in one place:
- rows whose advantage is exactly 0 are skipped when beta = 0 (they add nothing to the gradient) while
  the loss normalisers (`num_sequences`, `num_items`) still count them, so the gradient is unchanged;
- π_old is only computed when the policy moves before a minibatch is used (μ > 1 or several minibatches);
  otherwise the ratio is taken against the detached current log-probs, which is the same number;
- π_ref is only computed when beta > 0 (with LoRA, by switching the adapter off, not a second model);
- micro-batches are built from whole groups bucketed by length under a token budget, and each group's
  prompt is laid out once (see :func:`cohort.logprobs.completion_logprobs`).
With several processes the per-process losses use the global normalisers and gradients are summed, so
the update equals the one a single process would make on the whole batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from cohort import distributed as dist
from cohort.algo import policy_loss
from cohort.config import AlgoConfig
from cohort.logprobs import completion_logprobs


@dataclass
class PolicyBatch:
    """A scored rollout batch, ready for the update (N rows, group-contiguous)."""

    prompt_ids: list[list[int]]  # B prompts
    completion_ids: list[list[int]]  # N completions
    group_size: int
    advantages: torch.Tensor  # [N] float32
    in_loss: torch.Tensor  # [N] bool: False for rows removed by filters

    @property
    def lengths(self) -> list[int]:
        """Return each completion's length in tokens."""
        return [len(c) for c in self.completion_ids]


def plan_micro_batches(
    rows: Sequence[int],
    group_size: int,
    prompt_lengths: Sequence[int],
    completion_lengths: Sequence[int],
    token_budget: int,
) -> list[list[int]]:
    """Return `rows` split into micro-batches of whole groups whose padded grouped layout fits the budget.

    A group costs its prompt once plus its selected completions; groups are sorted by that cost so the
    groups batched together have similar lengths (little padding). A group larger than the budget on
    its own is split into several micro-batches.
    """
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


def _skippable(advantages: torch.Tensor, rows: Sequence[int]) -> list[int]:
    """Return the rows whose advantage is exactly 0: at beta = 0 they add exactly 0 to loss and gradient."""
    zero = (advantages == 0).tolist()
    return [r for r in rows if zero[r]]


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
        layout: str = "grouped",
    ):
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
        self.layout = layout
        # Zero (not None) gradients make a step whose rows were all skipped identical to one that
        # back-propagated zeros: AdamW still advances its moments and applies weight decay.
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    # ------------------------------------------------------------------ helpers
    def _logprobs(self, model, batch: PolicyBatch, rows: list[int], *, with_entropy: bool = False):
        with self.autocast():
            return completion_logprobs(
                model,
                batch.prompt_ids,
                batch.completion_ids,
                batch.group_size,
                rows=rows,
                temperature=self.temperature,
                with_entropy=with_entropy,
                layout=self.layout,
            )

    def _micro_batches(self, batch: PolicyBatch, rows: Sequence[int]) -> list[list[int]]:
        return plan_micro_batches(
            rows, batch.group_size, [len(p) for p in batch.prompt_ids], batch.lengths, self.micro_batch_tokens
        )

    @torch.no_grad()
    def _frozen_logprobs(self, model, batch: PolicyBatch, rows: Sequence[int]) -> dict[int, torch.Tensor]:
        """Return {row: [T_row] log-probs} under `model` without gradients."""
        out: dict[int, torch.Tensor] = {}
        for micro in self._micro_batches(batch, rows):
            lp = self._logprobs(model, batch, micro)
            for i, r in enumerate(micro):
                out[r] = lp.logp[i, : len(batch.completion_ids[r])].float()
        return out

    @staticmethod
    def _stack(values: dict[int, torch.Tensor], rows: list[int], width: int) -> torch.Tensor:
        out = torch.zeros(len(rows), width, dtype=torch.float32, device=next(iter(values.values())).device)
        for i, r in enumerate(rows):
            v = values[r]
            out[i, : v.numel()] = v
        return out  # [n, T]

    def _minibatches(self, batch: PolicyBatch, generator: torch.Generator | None) -> Iterator[list[int]]:
        groups = len(batch.prompt_ids)
        order = torch.randperm(groups, generator=generator).tolist() if self.algo.num_minibatches > 1 else list(range(groups))
        per = groups // self.algo.num_minibatches
        for m in range(self.algo.num_minibatches):
            chosen = order[m * per : (m + 1) * per]
            yield [g * batch.group_size + i for g in sorted(chosen) for i in range(batch.group_size)]

    # ------------------------------------------------------------------ the update
    def update(self, batch: PolicyBatch, generator: torch.Generator | None = None) -> dict[str, float]:
        """Return the metrics of μ × num_minibatches optimizer steps on `batch`."""
        a = self.algo
        n = len(batch.completion_ids)
        in_loss = batch.in_loss.tolist()
        lengths = batch.lengths
        loss_rows = [r for r in range(n) if in_loss[r]]
        multi_step = a.num_iterations * a.num_minibatches > 1
        old = self._frozen_logprobs(self.model, batch, loss_rows) if multi_step else None
        ref = None
        if a.beta > 0 and self.reference is not None:
            with self.reference() as ref_model:
                ref = self._frozen_logprobs(ref_model, batch, loss_rows)
        adv = batch.advantages
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}

        def add(name: str, value: float, weight: float) -> None:
            sums[name] = sums.get(name, 0.0) + value * weight
            weights[name] = weights.get(name, 0.0) + weight

        for it in range(a.num_iterations):
            for mb_rows in self._minibatches(batch, generator):
                rows = [r for r in mb_rows if in_loss[r]]
                num_seq = dist.all_sum_int(len(rows))
                tokens = sum(lengths[r] for r in rows)
                num_items = dist.all_sum_int(tokens) if a.loss_type == "dapo" else tokens
                skip = set(_skippable(adv, rows)) if a.beta == 0 else set()
                work = [r for r in rows if r not in skip]
                self.optimizer.zero_grad(set_to_none=False)
                total_loss = 0.0
                for micro in self._micro_batches(batch, work):
                    lp = self._logprobs(self.model, batch, micro, with_entropy=(it == 0))
                    width = lp.logp.shape[1]
                    kwargs = {}
                    if old is not None:
                        kwargs["old_logp"] = self._stack(old, micro, width)
                    if ref is not None:
                        kwargs["ref_logp"] = self._stack(ref, micro, width)
                    loss, metrics = policy_loss(
                        lp.logp,
                        kwargs.get("old_logp"),
                        adv[micro].to(lp.logp.device),
                        lp.mask,
                        loss_type=a.loss_type,
                        eps_low=a.eps_low,
                        eps_high=a.eps_high,
                        delta=a.delta,
                        beta=a.beta,
                        ref_logp=kwargs.get("ref_logp"),
                        max_completion_length=self.max_completion_length,
                        num_items=max(num_items, 1),
                        num_sequences=max(num_seq, 1),
                        importance=a.importance,
                    )
                    loss.backward()
                    total_loss += float(loss.detach())
                    ntok = float(lp.mask.sum())
                    for k, v in metrics.items():
                        add(k, float(v), ntok)
                    if lp.entropy is not None:
                        add("entropy", float((lp.entropy.detach() * lp.mask).sum() / max(ntok, 1.0)), ntok)
                dist.all_sum_grads(self.model)
                params = [p for p in self.model.parameters() if p.requires_grad]
                if self.max_grad_norm and self.max_grad_norm > 0:
                    gn = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
                else:
                    gn = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
                self.optimizer.step()
                if self.scheduler is not None:
                    self.scheduler.step()
                add("loss", dist.all_sum_float(total_loss), 1.0)
                add("grad_norm", float(gn), 1.0)
                add("rows_computed_frac", len(work) / max(len(mb_rows), 1), 1.0)
        out = {k: sums[k] / weights[k] for k in sums if weights[k] > 0}
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        return out
