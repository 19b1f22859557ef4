"""What padded rows pass as their attention mask when they run without one (fast.unmasked_padding).

With attention_mask=None, transformers makes the mask itself, and with position ids given and no cache it first
looks in them for packed sequences (masking_utils.find_packed_sequence_indices). Eagerly that check reads a device
value on the host, so every forward of the update waited for the device; under torch.compile it cannot be decided,
so a full [R, 1, L, L] mask was built and sdpa's causal kernels (FlashAttention's among them) were not taken (found
reading transformers 5.0 and 5.25; no GPU has run either form). Many decoders of transformers 5 also take the mask
already made, one per kind of layer: {"full_attention": None} is the causal kernel, with no check and no mask.

Whether a decoder takes that form is checked once, on a tiny batch: the same hidden states, bit for bit, as with
attention_mask=None. A decoder that does not (its forward hands the argument to create_causal_mask, which has no
use for a dict), or that has layers of another kind (a sliding window, whose mask None would widen), gets None.
So does a model under FSDP (torchrun): the check's forward would be one more collective call, which every process
would have to make at the same point.
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import torch

from cohort.models import text_config

_FORM: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def no_mask(decoder: torch.nn.Module) -> dict[str, None] | None:
    """Returns the attention_mask argument for `decoder`'s unmasked padded rows: {"full_attention": None} where
    it takes that form (checked once per decoder), else None."""
    takes = _FORM.get(decoder)
    if takes is None:
        takes = _FORM[decoder] = _takes_mask_mapping(decoder)
    return {"full_attention": None} if takes else None


def _takes_mask_mapping(decoder: torch.nn.Module) -> bool:
    kinds = getattr(text_config(decoder), "layer_types", None)
    if not kinds or any(kind != "full_attention" for kind in kinds):
        return False  # no per-kind masks to hand over, or a kind that None would not describe
    try:
        embeddings = cast(Any, decoder).get_input_embeddings()
        vocab = int(embeddings.num_embeddings)
        device = embeddings.weight.device
    except (AttributeError, NotImplementedError, TypeError):
        return False
    ids = (torch.arange(10, device=device) % vocab).view(2, 5)
    positions = torch.arange(5, device=device).expand(2, 5)
    try:
        with torch.no_grad():
            plain = _last_hidden(
                decoder(input_ids=ids, attention_mask=None, position_ids=positions, use_cache=False)
            )
            mapped = _last_hidden(
                decoder(
                    input_ids=ids,
                    attention_mask={"full_attention": None},
                    position_ids=positions,
                    use_cache=False,
                )
            )
    except Exception:  # noqa: BLE001 - a forward with no use for the mapping: None, as before
        return False
    return plain.shape == mapped.shape and torch.equal(plain, mapped)


def _last_hidden(out: Any) -> torch.Tensor:
    if hasattr(out, "logits") and not hasattr(out, "last_hidden_state"):
        return out.logits
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
