"""A causal LM whose next token is written in a script by position: it drives episodes deterministically."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class ScriptedLM(torch.nn.Module):
    """Predicts script[position + 1] after the token at `position` (EOS where the script is silent), whatever
    the context; a KV cache it is handed stays empty (nothing is cached, nothing needs to be)."""

    def __init__(self, vocab_size: int, eos: int, script: dict[int, int]) -> None:
        super().__init__()
        self.vocab_size, self.eos, self.script = vocab_size, eos, dict(script)
        self.bias = torch.nn.Parameter(torch.zeros(vocab_size))

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None
    ):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None, :].expand_as(input_ids)
        nxt = [[self.script.get(int(p) + 1, self.eos) for p in row] for row in position_ids.tolist()]
        logits = torch.full((*input_ids.shape, self.vocab_size), -30.0)
        logits.scatter_(-1, torch.tensor(nxt)[..., None], 30.0)
        return SimpleNamespace(logits=logits + self.bias)


def script_of(start: int, pieces: list[tuple[bool, list[int]]]) -> dict[int, int]:
    """Returns the position -> token script of an episode starting at `start`: (sampled?, tokens) pieces in
    order; only sampled pieces are scripted, inserted ones only take their positions."""
    script, pos = {}, start
    for sampled, tokens in pieces:
        for t in tokens:
            if sampled:
                script[pos] = t
            pos += 1
    return script
