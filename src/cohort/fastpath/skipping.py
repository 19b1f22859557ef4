"""Zero-advantage skipping: rows that cannot move the gradient are not computed.

With beta = 0 a completion whose advantage is exactly 0 contributes 0 to the clipped surrogate of every
token and so 0 to the loss and its gradient (its ratio multiplies a zero advantage). Late in a run most
groups have all-equal rewards, so most rows are such rows. The loss normalisers (`num_items`,
`num_sequences`) still count them, so the gradient is the one of the whole batch. With beta > 0 the KL
term of those rows does carry a gradient, so nothing is skipped; nor with a user's own loss (it may not
vanish at A = 0) or token selections made per micro-batch (entropy, covariance: skipping rows would change
which tokens they select).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def skip_unavailable(
    beta: float,
    *,
    builtin_loss: bool = True,
    selection: str | None = None,
    entropy_bonus: bool = False,
    kl_tau: float = 0.0,
) -> str | None:
    """Returns why zero-advantage rows cannot be skipped (None: they can)."""
    if beta != 0:
        return f"beta={beta} > 0: the KL term of a zero-advantage row has a gradient"
    if kl_tau != 0:
        return (
            f"algo.kl_tau={kl_tau} > 0: the squared log-ratio penalty of a zero-advantage row has a gradient"
        )
    if entropy_bonus:
        return "algo.entropy_coef / algo.adaptive_entropy: the entropy term of a zero-advantage row has a gradient"
    if not builtin_loss:
        return "a user loss may not vanish where the advantage is 0"
    if selection is not None:
        return f"{selection} selects tokens per micro-batch, among zero-advantage rows too"
    return None


def zero_advantage_rows(advantages: torch.Tensor, rows: Sequence[int]) -> list[int]:
    """Returns the rows of `rows` whose advantage is exactly 0 (they add exactly 0 when beta = 0)."""
    zero = (advantages == 0).tolist()
    return [r for r in rows if zero[r]]
