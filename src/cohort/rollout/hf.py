"""The reference engine: transformers' `generate`, with the model's own generation defaults switched off."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from cohort.errors import NonFiniteSamplingError
from cohort.rollout.base import RolloutEngine, Sampled, SamplingParams, completion_ends, left_pad


class HFEngine(RolloutEngine):
    """Samples with `model.generate` on every prompt repeated G times (each prompt is prefilled G times)."""

    name = "hf"

    def sample(
        self,
        model: torch.nn.Module,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        device: torch.device,
    ) -> Sampled:
        """Returns group_size completions per prompt sampled by transformers' generate, as Sampled rows."""
        input_ids, attn = left_pad(prompt_ids, self.pad_token_id, device)  # [B, P]
        # Repeated rows rather than num_return_sequences, which greedy decoding rejects for G > 1.
        input_ids = input_ids.repeat_interleave(group_size, dim=0)  # [N, P]
        attn = attn.repeat_interleave(group_size, dim=0)  # [N, P]
        recorder = _LogprobRecorder(1.0 if params.greedy else params.temperature)
        kwargs = {
            "max_new_tokens": params.max_completion_length,
            "eos_token_id": self.eos_token_ids,
            "pad_token_id": self.pad_token_id,
            "do_sample": not params.greedy,
            "repetition_penalty": 1.0,
        }
        if not params.greedy:
            # top_k must be explicit: transformers fills a missing top_k with 50.
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        # get_base_model (peft) and generate (transformers) are methods that nn.Module's __getattr__ types as
        # Tensor | Module, hence the two ignores.
        hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
        with _plain_generation_config(hf_model), _seeded_from(generator, device):
            try:
                sequences = model.generate(  # type: ignore[operator]
                    input_ids=input_ids,
                    attention_mask=attn,
                    logits_processor=LogitsProcessorList([recorder]),
                    **kwargs,
                )  # [N, P + T']
            except RuntimeError as e:
                # torch.multinomial refuses NaN / inf probabilities with an error of no type of its own; the
                # failing step's log-probs, recorded before the draw, say whether that was the reason.
                if recorder.pending is not None and bool(torch.isnan(recorder.pending).any()):
                    raise NonFiniteSamplingError(str(e)) from e
                raise
            if recorder.undrawable is not None and bool(recorder.undrawable.any()):
                raise NonFiniteSamplingError(
                    "probability tensor contains either `inf`, `nan` or element < 0: the policy's next-token "
                    "logits were not finite while sampling"
                )
            new_tokens = sequences[:, input_ids.shape[1] :]  # [N, T']
            logps = recorder.finish(new_tokens)  # [N, T']
        lengths, truncated = completion_ends(new_tokens, self.eos_token_ids, params.max_completion_length)
        return Sampled(tokens=new_tokens, lengths=lengths, truncated=truncated, logprobs=logps)


class _LogprobRecorder(LogitsProcessor):
    """Records log_softmax(raw logits / temperature) at each sampled token, keeping only one step's [N, V]."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.pending: torch.Tensor | None = None  # [N, V] log-probs of the step whose token is not yet known
        self.steps: list[torch.Tensor] = []  # each [N]
        # [N] bool: a row's scores had a NaN or +inf, or were all -inf, at some step
        self.undrawable: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.steps.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # [N, V]
        # CUDA's multinomial asserts inside its kernel on NaN / inf probabilities (no exception, and the process's
        # CUDA context is lost): such rows are sampled from flat scores and reported after generate, no host sync.
        bad = torch.isnan(scores).any(-1) | torch.isposinf(scores).any(-1)  # [N]
        bad = bad | torch.isneginf(scores).all(-1)  # [N]
        self.undrawable = bad if self.undrawable is None else self.undrawable | bad
        return torch.where(bad[:, None], torch.zeros_like(scores), scores)

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """Returns the log-probs [N, T'] of the generated tokens new_tokens [N, T']."""
        if self.pending is not None and new_tokens.shape[1] > len(self.steps):
            self.steps.append(self.pending.gather(-1, new_tokens[:, -1:]).squeeze(-1))
        self.pending = None
        if not self.steps:
            return torch.zeros(new_tokens.shape, dtype=torch.float32, device=new_tokens.device)
        return torch.stack(self.steps, dim=1)


@contextlib.contextmanager
def _plain_generation_config(hf_model: torch.nn.Module) -> Iterator[None]:
    """Yields with the model's generation_config replaced by a blank one.

    A checkpoint's generation_config.json (e.g. Qwen's top_k=20, repetition_penalty=1.05) would
    otherwise silently override the sampling settings we did not pass.
    """
    if not hasattr(hf_model, "generation_config"):
        yield
        return
    saved = hf_model.generation_config
    # nn.Module.__setattr__ is typed for Tensor | Module values, but any attribute may be set:
    hf_model.generation_config = GenerationConfig()  # type: ignore[assignment]
    try:
        yield
    finally:
        hf_model.generation_config = saved


@contextlib.contextmanager
def _seeded_from(generator: torch.Generator | None, device: torch.device) -> Iterator[None]:
    """Yields with the global RNG seeded from `generator` (generate() takes no generator), restoring it after."""
    if generator is None:
        yield
        return
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.manual_seed(seed)
        yield
