"""Process supervision: where each reasoning step of a completion ends, and process reward models.

A process reward (DeepSeekMath section 4.1.3) scores every step of a completion instead of the whole. A reward
function gives one by returning, per completion, a list of step rewards (or a StepRewards / {"rewards",
"ends"} mapping with explicit step ends); the trainer turns the group's step rewards into per-token
advantages with `cohort.algo.process_advantages` (normalised over every step of the group, then each
token's advantage is the sum of the rewards of its step and every later one).

Steps without explicit ends are found in the completion's text by a separator (`process.step_separator`,
"\\n" by default): step j ends with the j-th separator, the last step with the text's end (a separator at the
very end closes the last step rather than opening an empty one). Text positions are mapped to tokens by
decoding each token on its own, which is exact for character and most BPE tokenizers; where a character
spans several byte-level tokens the step ends at the token that completes it.

`ProcessRewardModel` scores every step of a completion in one forward pass of a token-classification model
(`AutoModelForTokenClassification`, as TRL's PRMTrainer trains them): the score of a step is read at the
token where the step's text ends; with 2 labels it is the probability of label 1 ("correct"), with 1 label
the raw logit. Other heads are refused.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from cohort.rewards.reward_models import ModelReward, check_tokenizer_fits
from cohort.rewards.rules import completion_text
from cohort.rewards.scoring import RewardFunctionError, StepRewards

__all__ = ["ProcessRewardModel", "step_char_ends", "step_token_ends"]


def step_char_ends(text: str, separator: str) -> list[int]:
    """Returns the index of each step's last character in `text` (steps split by `separator`; blank ones skipped)."""
    if not separator:
        raise ValueError("the step separator is empty; set process.step_separator, e.g. '\\n'")
    ends, start, pos = [], 0, 0
    while True:
        at = text.find(separator, pos)
        if at < 0:
            break
        pos = at + len(separator)
        # A blank step (an empty line) is no step: its separator joins the next step, so a function that
        # scores the non-blank lines counts the same steps.
        if text[start:at].strip():
            ends.append(pos - 1)
            start = pos
    if text[start:].strip():  # text after the last separator is a step of its own
        ends.append(len(text) - 1)
    elif not ends and text:
        ends.append(len(text) - 1)
    return ends


def step_token_ends(token_texts: Sequence[str], separator: str) -> list[int]:
    """Returns the index of each step's last token, given each token's decoded text."""
    text = "".join(token_texts)
    bounds, total = [], 0
    for piece in token_texts:
        total += len(piece)
        bounds.append(total)  # character end (exclusive) of each token
    out: list[int] = []
    t = 0
    for c in step_char_ends(text, separator):
        while t < len(bounds) and bounds[t] <= c:
            t += 1
        idx = min(t, len(bounds) - 1)
        if not out or idx > out[-1]:
            out.append(idx)
    return out


def resolve_step_ends(
    steps: Sequence[StepRewards | None],
    completion_ids: Sequence[Sequence[int]],
    token_texts: Any,
    separator: str,
    func_name: str,
) -> list[tuple[list[float], list[int]] | None]:
    """Returns per completion (step rewards, step end token indices), checking that they match the tokens.

    `token_texts(ids)` returns the decoded text of each token of one completion (used only when a
    StepRewards has no explicit ends)."""
    out: list[tuple[list[float], list[int]] | None] = []
    for i, (step, ids) in enumerate(zip(steps, completion_ids, strict=True)):
        if step is None:
            out.append(None)
            continue
        n_tok = len(ids)
        ends = list(step.ends) if step.ends is not None else step_token_ends(token_texts(ids), separator)
        if len(ends) != len(step.rewards):
            found = "explicit ends" if step.ends is not None else f"steps split by {separator!r} in the text"
            raise RewardFunctionError(
                func_name,
                f"completion {i} has {len(ends)} {found} but {len(step.rewards)} step rewards; return one reward "
                "per step (or give 'ends' explicitly)",
            )
        if any(b <= a for a, b in zip(ends, ends[1:])) or (
            ends and (ends[0] < 0 or ends[-1] >= max(n_tok, 1))
        ):
            raise RewardFunctionError(
                func_name,
                f"completion {i}: step ends {ends} must increase strictly and lie in [0, {n_tok}) (its token count)",
            )
        out.append((list(step.rewards), ends))
    return out


class ProcessRewardModel(ModelReward):
    """A process reward function backed by a token-classification model: one score per step, one forward pass.

    `model`: a folder written by save_pretrained, a hub id or a loaded model (AutoModelForTokenClassification
    with 1 or 2 labels). Each prompt + completion is scored in batches of `batch_size` without gradients; the
    score of a step is read at the model token where the step's text ends (steps split by `separator`).
    """

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module,
        tokenizer: Any = None,
        *,
        separator: str = "\n",
        batch_size: int = 16,
        trust_remote_code: bool = False,
    ):
        from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

        if isinstance(model, (str, os.PathLike)):
            source = os.fspath(model)
            config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
            _check_labels(config, source)
            model = AutoModelForTokenClassification.from_pretrained(
                source, config=config, trust_remote_code=trust_remote_code
            )
        elif not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
            raise TypeError(
                f"ProcessRewardModel needs a folder, a hub id or a transformers model, got {type(model).__name__}"
            )
        else:
            source = str(getattr(model.config, "_name_or_path", "") or "")
        assert isinstance(model, torch.nn.Module)
        _check_labels(model.config, source)
        self.name_or_path = source
        self.__name__ = self.name_of(source, model)
        if tokenizer is None:
            if not source:
                raise ValueError(
                    f"process reward model {self.__name__!r} was built in memory: pass its tokenizer"
                )
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        check_tokenizer_fits(model, tokenizer, self.__name__)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.separator = separator
        self.batch_size = batch_size

    def __repr__(self) -> str:
        return f"ProcessRewardModel({self.name_or_path or self.__name__!r})"

    def _token_ids_and_ends(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        """Returns the model's token ids of prompt + completion and the token index where each step ends."""
        encode = self.tokenizer
        prompt_ids = encode(prompt, add_special_tokens=False)["input_ids"] if prompt else []
        comp_ids = encode(completion, add_special_tokens=False)["input_ids"] if completion else []
        token_texts = [self.tokenizer.decode([t]) for t in comp_ids]
        ends = [len(prompt_ids) + e for e in step_token_ends(token_texts, self.separator)] if comp_ids else []
        return list(prompt_ids) + list(comp_ids), ends

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[StepRewards]:
        """Returns each completion's step scores (the step ends are left to the trainer's separator)."""
        items = []
        for p, c in zip(prompts, completions, strict=True):
            if not isinstance(p, str):
                raise ValueError(
                    f"process reward model {self.__name__!r} scores plain-text prompts; conversational prompts are "
                    "not supported yet: wrap the model in a reward function that builds the text"
                )
            items.append(self._token_ids_and_ends(p, completion_text(c)))
        out: list[StepRewards] = []
        for start in range(0, len(items), self.batch_size):
            chunk = items[start : start + self.batch_size]
            width = max(max(len(ids) for ids, _ in chunk), 1)
            self.check_fits(width)
            pad = self.tokenizer.pad_token_id
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            attention = torch.zeros(len(chunk), width, dtype=torch.long)
            for i, (ids, _) in enumerate(chunk):
                input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                attention[i, : len(ids)] = 1
            with torch.inference_mode():
                logits = (
                    self.model(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device))
                    .logits.float()
                    .cpu()
                )  # [B, L, labels]
            scores = logits.softmax(-1)[..., 1] if logits.shape[-1] == 2 else logits[..., 0]  # [B, L]
            for i, (_, ends) in enumerate(chunk):
                out.append(StepRewards([float(scores[i, e]) for e in ends]))
        return out


def _check_labels(config: Any, name: str) -> None:
    """Raises ValueError unless the model is a token classifier with 1 or 2 labels."""
    archs = list(getattr(config, "architectures", None) or [])
    if archs and not any(a.endswith("ForTokenClassification") for a in archs):
        raise ValueError(
            f"process reward model {name!r} is a {archs[0]}; a process reward model is a token classifier "
            "(AutoModelForTokenClassification) that scores each step's last token"
        )
    if getattr(config, "num_labels", None) not in (1, 2):
        raise ValueError(
            f"process reward model {name!r} has num_labels={getattr(config, 'num_labels', None)}; use 1 (a score) or "
            "2 (probability of label 1 = the step is correct)"
        )


def process_metrics(steps: Sequence[tuple[list[float], list[int]] | None]) -> dict[str, float]:
    """Returns process/steps_per_completion, process/step_reward_mean and process/step_reward_std of a batch."""
    scored = [s[0] for s in steps if s is not None]
    flat = [r for rewards in scored for r in rewards]
    if not flat:
        return {"process/steps_per_completion": 0.0}
    mean = sum(flat) / len(flat)
    std = (sum((r - mean) ** 2 for r in flat) / len(flat)) ** 0.5
    return {
        "process/steps_per_completion": len(flat) / max(len(scored), 1),
        "process/step_reward_mean": mean,
        "process/step_reward_std": std,
    }
