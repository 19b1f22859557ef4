"""Reward models: a sequence-classification model with one output, called like a reward function.

``RewardModel("path/or/org-name")`` (or a loaded ``PreTrainedModel``) scores each prompt + completion
with the model's single logit. Texts are built as TRL builds them: plain prompts are concatenated with
their completion; conversational ones go through the reward tokenizer's chat template (prompt messages,
then the assistant's completion). transformers is imported only when a reward model is built.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import PurePath
from typing import Any, TypeVar

import torch

from cohort.rewards.rules import completion_text

__all__ = ["RewardModel", "load_score_model"]


def share_pad_token(model: Any, tokenizer: Any, name: str) -> None:
    """Gives `tokenizer` a pad token (its eos when it has none) and tells the model its id.

    A sequence-classification model reads its score at the last token that is not padding, so it must know
    the pad id; raises ValueError when the tokenizer has neither a pad nor an eos token."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"the tokenizer of reward model {name!r} has neither a pad token nor an eos token, so texts of "
                "different lengths cannot be batched; set tokenizer.pad_token (adding a token means resizing the "
                "model's embeddings) and pass the tokenizer"
            )
        tokenizer.pad_token = tokenizer.eos_token
    model_config: Any = model.config
    model_config.pad_token_id = tokenizer.pad_token_id
    text_config = getattr(model_config, "get_text_config", None)
    if callable(text_config):
        text_config().pad_token_id = tokenizer.pad_token_id


def _check_num_labels(config: Any, name: str) -> None:
    """Raises ValueError unless the model's classification head has exactly one output."""
    num_labels = getattr(config, "num_labels", None)
    archs = [str(a) for a in getattr(config, "architectures", None) or []]
    if num_labels != 1 and archs and all(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise ValueError(
            f"reward model {name!r} is a causal language model ({', '.join(archs)}), not a reward model: it has no "
            f"score head (its num_labels={num_labels} is transformers' default). Give a folder trained as a reward "
            "model (`cohort rm`, or AutoModelForSequenceClassification with num_labels=1), or score with a reward "
            "function"
        )
    if num_labels != 1:
        raise ValueError(
            f"reward model {name!r} has a head with num_labels={num_labels}; a reward model scores each text with "
            "one number (num_labels=1). Use a model trained as a reward model (AutoModelForSequenceClassification "
            "with num_labels=1), or wrap your classifier in a reward function that turns its logits into one float "
            "per completion"
        )


def load_score_model(
    source: str | os.PathLike,
    *,
    new_head: bool = False,
    trust_remote_code: bool = False,
    dtype: str | torch.dtype | None = None,
) -> Any:
    """Returns the sequence-classification model with one output at `source` (a folder or hub id).

    `new_head`: `source` may be a causal LM, and a one-output score head is added (to be trained; the
    "newly initialised" notice for it is silenced); else `source` must already be a reward model, whose
    head is checked before the weights are read (ValueError for more than one output)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    options: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if dtype is not None:
        options["dtype"] = dtype
    if new_head:
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            return AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, **options)
        finally:
            hf_logging.set_verbosity(level)
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    _check_num_labels(config, os.fspath(source))
    return AutoModelForSequenceClassification.from_pretrained(source, config=config, **options)


def check_tokenizer_fits(model: Any, tokenizer: Any, name: str) -> None:
    """Raises ValueError when the tokenizer has ids beyond the model's embedding table (not the model's own)."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is not None and len(tokenizer) > rows:
        raise ValueError(
            f"the tokenizer given for reward model {name!r} has {len(tokenizer)} tokens but the model embeds "
            f"{rows}: it is not this model's tokenizer; pass the model's own (or leave it out to load it)"
        )


_M = TypeVar("_M", bound="ModelReward")


class ModelReward:
    """What the reward functions backed by a transformers model share: the model, its device, its name."""

    model: torch.nn.Module

    @staticmethod
    def name_of(source: str, model: torch.nn.Module) -> str:
        """Returns the name a model's reward is logged under: its folder's or hub id's last part."""
        return PurePath(source.rstrip("/\\")).name or type(model).__name__

    @property
    def device(self) -> torch.device:
        """Returns the device the model's weights are on."""
        first = next(self.model.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    def to(self: _M, device: str | torch.device) -> _M:
        """Returns self, after moving the model to `device`."""
        self.model.to(device)
        return self

    def check_fits(self, tokens: int) -> None:
        """Raises ValueError when a text of `tokens` tokens is longer than the model's learned position table.

        A model with absolute position embeddings (GPT-2's, OPT's, BERT's) indexes that table by position: past
        its end the lookup fails, on a GPU as a device-side assert that ends the process's use of CUDA (nothing
        can be saved after it). Rotary models have no table; they are left to score, as before."""
        config = getattr(self.model, "config", None)
        longest = getattr(config, "max_position_embeddings", None)
        rotary = any(
            getattr(config, k, None) is not None for k in ("rope_theta", "rope_scaling", "rope_parameters")
        )
        if isinstance(longest, int) and tokens > longest and not rotary:
            name = getattr(self, "__name__", type(self.model).__name__)
            raise ValueError(
                f"reward model {name!r} reads at most {longest} tokens (max_position_embeddings) and a text to "
                f"score has {tokens}: lower rollout.max_completion_length or the prompts' length, or use a reward "
                "model with a longer context"
            )


class RewardModel(ModelReward):
    """A reward function backed by a sequence-classification model with one output (TRL's reward models).

    `model`: a local folder written by ``save_pretrained``, a hub id, or a loaded ``PreTrainedModel``
    (``AutoModelForSequenceClassification`` with ``num_labels=1``). `tokenizer`: the model's own one
    is loaded when None. Scores are computed in batches of `batch_size` texts without gradients, on
    `device` (or wherever :meth:`to` moves the model); the reward is ``logits[:, 0]``.
    """

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module,
        tokenizer: Any = None,
        *,
        batch_size: int = 32,
        device: str | torch.device | None = None,
        trust_remote_code: bool = False,
        dtype: str | torch.dtype | None = None,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"RewardModel: batch_size={batch_size!r} must be a positive integer")
        if isinstance(model, (str, os.PathLike)):
            source = os.fspath(model)
            model = load_score_model(source, trust_remote_code=trust_remote_code, dtype=dtype)
        elif not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
            raise TypeError(
                f"RewardModel needs a folder, a hub id or a transformers model, got {type(model).__name__}"
            )
        else:
            source = str(getattr(model.config, "_name_or_path", "") or "")
        assert isinstance(model, torch.nn.Module)
        self.name_or_path = source
        # The name the reward is reported under: the model folder's or hub id's last part.
        self.__name__ = self.name_of(source, model)
        _check_num_labels(model.config, source or self.__name__)
        if tokenizer is None:
            if not source:
                raise ValueError(
                    f"reward model {self.__name__!r} was built in memory and has no name_or_path to load its "
                    "tokenizer from; pass it (reward_processing_classes=[tokenizer], or RewardModel(model, tokenizer))"
                )
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        share_pad_token(model, tokenizer, self.__name__)
        check_tokenizer_fits(model, tokenizer, self.__name__)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        if device is not None:
            self.to(device)

    def __repr__(self) -> str:
        return f"RewardModel({self.name_or_path or self.__name__!r}, batch_size={self.batch_size}, device={self.device})"

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """Returns the texts the model scores: prompt + completion, or the chat template over the messages."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, str):
                out.append(prompt + completion_text(completion))
                continue
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(
                    f"the tokenizer of reward model {self.__name__!r} has no chat template, which conversational "
                    "prompts need; pass one that has (reward_processing_classes) or use plain-text prompts"
                )
            if isinstance(completion, str):
                completion = [{"role": "assistant", "content": completion}]
            out.append(self.tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=False))
        return out

    def score_texts(self, texts: Sequence[str]) -> list[float]:
        """Returns the model's score (logits[:, 0]) of each text, computed in batches without gradients."""
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                list(texts[start : start + self.batch_size]),
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
            )
            self.check_fits(int(batch["input_ids"].shape[1]))
            device = self.device
            with torch.inference_mode():
                logits = self.model(
                    input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
                ).logits
            scores += logits[:, 0].float().cpu().tolist()
        return scores

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        """Returns one score per completion (the reward function convention; other arguments are ignored)."""
        return self.score_texts(self.texts(prompts, completions))
