"""Per-token entropy of the policy from logits, chunked so a [rows, V] float32 copy never exceeds one chunk."""

from __future__ import annotations

import torch

from ._checks import check_tensor


def token_entropy(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Return H = logsumexp(z) - sum_v softmax(z)_v z_v for each position of `logits` [..., V], shape [...].

    Positions are processed `chunk_size` at a time and upcast to float32 per chunk, so bf16/fp16 logits
    give float32 entropies without materialising a float32 copy of the whole [..., V] tensor.
    Differentiable; under torch.no_grad() peak extra memory is one [chunk_size, V] float32 block.
    """
    check_tensor("logits", logits)
    if logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a floating tensor [..., V], got dtype {logits.dtype} and shape {tuple(logits.shape)}."
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (positions per chunk), got {chunk_size!r}.")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])  # [P, V]
    out_dtype = torch.promote_types(logits.dtype, torch.float32)
    parts = []
    for chunk in flat.split(chunk_size):
        z = chunk.to(out_dtype)  # [c, V]
        logz = torch.logsumexp(z, dim=-1, keepdim=True)  # [c, 1]
        p = torch.exp(z - logz)  # [c, V]
        parts.append(logz.squeeze(-1) - (p * z).sum(-1))  # [c]
    if not parts:
        return torch.zeros(lead, dtype=out_dtype, device=logits.device)
    return torch.cat(parts).reshape(lead)  # [...]
