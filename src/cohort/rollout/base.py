"""Types shared by the rollout engines: sampling settings, the rollout batch, the engine interface.

An engine implements `sample` (its decoding, on the model's device); `RolloutEngine.generate`, shared by
every engine, checks the request, runs `sample` without gradients in eval mode and makes the RolloutBatch.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cohort.choices import check_sampling
from cohort.models import cache_kwargs, eval_mode, forward_accepts, input_device


@dataclass
class SamplingParams:
    """How completions are sampled."""

    max_completion_length: int
    """Most new tokens per completion; a completion that reaches it without EOS is marked truncated."""
    temperature: float = 1.0
    """Logits are divided by it before softmax (ignored when `greedy`)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches top_p (1.0 = off)."""
    top_k: int = 0
    """Keep only the top_k most likely tokens (0 = off)."""
    greedy: bool = False
    """Take the argmax at every step; temperature, top_p and top_k are ignored."""
    logprobs_topk: int = 0
    """Also return, per completion token, the K most likely tokens and their log-probs under the distribution of
    `sampling_logprobs`, the sampled token forced in (RolloutBatch.topk_ids / topk_logprobs; DPPO's top-K
    divergence). 0 = off; only engines with `returns_topk` (the builtin one) honour it."""

    def __post_init__(self) -> None:
        if isinstance(self.max_completion_length, bool) or not isinstance(self.max_completion_length, int):
            raise TypeError(
                f"max_completion_length must be an int, got {self.max_completion_length!r} "
                f"({type(self.max_completion_length).__name__}); pass e.g. max_completion_length=256"
            )
        if self.max_completion_length < 1:
            raise ValueError(
                f"max_completion_length must be >= 1, got {self.max_completion_length}; "
                "pass the number of new tokens each completion may have"
            )
        check_sampling(self.temperature, self.top_p, self.top_k, greedy=self.greedy)
        k = self.logprobs_topk
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"logprobs_topk must be an int >= 0, got {k!r}; use 0 to switch it off")


@dataclass
class EpisodeRecord:
    """What a multi-turn episode was, beyond its tokens: its conversation, tool use and environment."""

    prompt: list[dict[str, Any]]
    """The conversation the episode started from (an environment's reset observation included): reward
    functions' `prompts` entry."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The episode after its prompt in TRL's form: assistant turns (with `tool_calls`), tool results (role
    `tool`), an environment's observations (role `user`): reward functions' `completions` entry."""
    calls: int = 0
    """Tool calls executed."""
    failures: int = 0
    """Executed calls that failed (raised, timed out, unknown tool, bad arguments)."""
    stop: str = "answer"
    """Why the episode ended: answer (a turn without a call), done (the environment ended it), length (the
    token budget ran out mid-turn), max_tool_calls (a call past the limit), budget (an insertion did not fit),
    malformed (an unparsable call)."""
    environment: Any = None
    """The rollout's environment instance (None without one)."""
    turn_rewards: list[float] = field(default_factory=list)
    """A TextEnvironment's reward for each of the episode's turns."""
    turn_ends: list[int] = field(default_factory=list)
    """For each assistant turn, the completion index of its last token."""


@dataclass
class RolloutBatch:
    """G completions for each of B prompts, stored group-contiguously (prompt j owns rows j*G ... j*G+G-1)."""

    prompt_ids: list[list[int]]
    """The B unique prompts, unpadded."""
    completion_ids: list[list[int]]
    """N = B*G completions, unpadded; EOS included when the row ended with one, nothing after it."""
    truncated: torch.Tensor
    """[N] bool on CPU: the row reached max_completion_length without emitting EOS."""
    group_size: int
    """G, the number of completions per prompt."""
    sampling_logprobs: list[torch.Tensor] | None = None
    """Per row a float32 [T_i] CPU tensor: log-prob of each sampled token under logits / temperature
    (raw logits when greedy), before top-k / top-p filtering; None when the engine cannot report it."""
    paths: dict[str, bool] = field(default_factory=dict)
    """Which fast paths the engine took for this batch ({shared_prefix, preallocated_kv, packed_weights}:
    True/False for the builtin engine; empty for engines without any)."""
    loss_masks: list[torch.Tensor] | None = None
    """Per row a bool [T_i] CPU tensor: True where the policy sampled the token (it is trained on), False where
    something else inserted it (a tool's output, the chat template's turn markers of a multi-turn episode).
    None: every token is the policy's, as in a single completion; the update and the length metrics read
    `loss_lengths` and `token_mask`, never the field itself, so both forms flow the same way."""
    episodes: list[EpisodeRecord] | None = None
    """Per row its episode record when the rollout was multi-turn (None for single completions)."""
    topk_ids: list[torch.Tensor] | None = None
    """Per row a long [T_i, K] CPU tensor: at each completion token the sampler's K most likely token ids under
    the distribution of `sampling_logprobs`, the sampled token forced in (it replaces the K-th when it is not
    among them); None unless asked for (SamplingParams.logprobs_topk)."""
    topk_logprobs: list[torch.Tensor] | None = None
    """Per row a float32 [T_i, K] CPU tensor: the log-probs of `topk_ids` under that distribution."""

    def __post_init__(self) -> None:
        self._check_topk()
        if self.loss_masks is None:
            return
        if len(self.loss_masks) != len(self.completion_ids):
            raise ValueError(
                f"loss_masks has {len(self.loss_masks)} rows for {len(self.completion_ids)} completions; "
                "an engine that returns loss masks returns one per completion"
            )
        for i, (m, c) in enumerate(zip(self.loss_masks, self.completion_ids)):
            if m.dtype != torch.bool or m.dim() != 1 or m.numel() != len(c):
                raise ValueError(
                    f"loss_masks[{i}] must be a bool tensor of shape [{len(c)}] (one flag per completion token), "
                    f"got {m.dtype} of shape {tuple(m.shape)}"
                )

    def _check_topk(self) -> None:
        """Raises ValueError unless topk_ids and topk_logprobs are both None, or both one [T_i, K] per row."""
        ids, lps = self.topk_ids, self.topk_logprobs
        if ids is None and lps is None:
            return
        if ids is None or lps is None:
            raise ValueError("topk_ids and topk_logprobs come together: pass both or neither")
        if len(ids) != len(self.completion_ids) or len(lps) != len(self.completion_ids):
            raise ValueError(
                f"topk_ids / topk_logprobs have {len(ids)} / {len(lps)} rows for {len(self.completion_ids)} "
                "completions; an engine that returns top-K log-probs returns them for every completion"
            )
        K = int(ids[0].shape[-1]) if ids and ids[0].dim() == 2 else None
        for i, (t, lp, c) in enumerate(zip(ids, lps, self.completion_ids)):
            if t.dtype != torch.long or t.dim() != 2 or t.shape != (len(c), K):
                raise ValueError(
                    f"topk_ids[{i}] must be a long tensor of shape [{len(c)}, K] (K ids per completion token, the "
                    f"same K in every row), got {t.dtype} of shape {tuple(t.shape)}"
                )
            if lp.dtype != torch.float32 or lp.shape != t.shape:
                raise ValueError(
                    f"topk_logprobs[{i}] must be a float32 tensor of topk_ids[{i}]'s shape {tuple(t.shape)}, got "
                    f"{lp.dtype} of shape {tuple(lp.shape)}"
                )

    @property
    def num_prompts(self) -> int:
        """Returns B, the number of unique prompts."""
        return len(self.prompt_ids)

    @property
    def num_completions(self) -> int:
        """Returns N = B * G, the number of completions."""
        return len(self.completion_ids)

    @property
    def completion_lengths(self) -> torch.Tensor:
        """Returns the length of each completion, LongTensor [N] (EOS counted)."""
        return torch.tensor([len(c) for c in self.completion_ids], dtype=torch.long)

    @property
    def loss_lengths(self) -> torch.Tensor:
        """Returns each completion's tokens the policy generated, LongTensor [N]: its length, less the tokens
        inserted by tools or templates (what TRL's length metrics and num_tokens count)."""
        if self.loss_masks is None:
            return self.completion_lengths
        return torch.tensor([int(m.sum()) for m in self.loss_masks], dtype=torch.long)

    def token_mask(self, row: int) -> torch.Tensor:
        """Returns row's loss mask, bool [T_row]: all True for a completion with no inserted tokens."""
        if self.loss_masks is None:
            return torch.ones(len(self.completion_ids[row]), dtype=torch.bool)
        return self.loss_masks[row]


def select_groups(parts: Sequence[tuple[RolloutBatch, Sequence[int]]]) -> RolloutBatch:
    """Returns one RolloutBatch of the chosen groups (prompt indices) of several batches, in order.

    Dynamic sampling assembles a step's batch from the informative groups of several generation rounds."""
    if not parts:
        raise ValueError("select_groups needs at least one (batch, groups) pair")
    G = parts[0][0].group_size
    prompts: list[list[int]] = []
    completions: list[list[int]] = []
    truncated: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] | None = []
    masks: list[torch.Tensor] = []
    records: list[EpisodeRecord] | None = []
    top_ids: list[torch.Tensor] | None = []
    top_lps: list[torch.Tensor] = []
    episodes = any(batch.loss_masks is not None for batch, _ in parts)
    for batch, groups in parts:
        if batch.group_size != G:
            raise ValueError(f"cannot join batches of group size {G} and {batch.group_size}")
        rows = [g * G + i for g in groups for i in range(G)]
        prompts += [batch.prompt_ids[g] for g in groups]
        completions += [batch.completion_ids[r] for r in rows]
        truncated.append(batch.truncated[rows] if rows else batch.truncated[:0])
        if logprobs is not None and batch.sampling_logprobs is not None:
            logprobs += [batch.sampling_logprobs[r] for r in rows]
        else:
            logprobs = None
        if episodes:  # a round without inserted tokens joins one with them as all-True masks
            masks += [batch.token_mask(r) for r in rows]
        if records is not None and batch.episodes is not None:
            records += [batch.episodes[r] for r in rows]
        else:
            records = None
        if top_ids is not None and batch.topk_ids is not None and batch.topk_logprobs is not None:
            top_ids += [batch.topk_ids[r] for r in rows]
            top_lps += [batch.topk_logprobs[r] for r in rows]
        else:
            top_ids = None
    return RolloutBatch(
        prompt_ids=prompts,
        completion_ids=completions,
        truncated=torch.cat(truncated),
        group_size=G,
        sampling_logprobs=logprobs,
        paths=dict(parts[0][0].paths),
        loss_masks=masks if episodes else None,
        episodes=records,
        topk_ids=top_ids,
        topk_logprobs=top_lps if top_ids is not None else None,
    )


@dataclass
class Sampled:
    """An engine's sampled rows on the model's device, before generate() makes them a RolloutBatch."""

    tokens: torch.Tensor
    """[N, T] long: each row's tokens; those past its length are ignored."""
    lengths: torch.Tensor
    """[N] long: each completion's length (its EOS included)."""
    truncated: torch.Tensor
    """[N] bool: the row reached max_completion_length without emitting EOS."""
    logprobs: torch.Tensor
    """[N, T] float32: log-prob of each sampled token under logits / temperature (see RolloutBatch)."""
    paths: dict[str, bool] = field(default_factory=dict)
    """The fast paths the engine took (RolloutBatch.paths)."""
    topk_ids: torch.Tensor | None = None
    """[N, T, K] long: each token's top-K ids, the sampled one forced in (RolloutBatch.topk_ids); None unless
    asked for."""
    topk_logprobs: torch.Tensor | None = None
    """[N, T, K] float32: their log-probs (RolloutBatch.topk_logprobs)."""


class RolloutEngine(abc.ABC):
    """Generates group_size completions for every prompt; subclasses implement `sample`."""

    name: str = "?"
    streams_finished: bool = False
    """Whether `sample` takes `on_finished` and calls it as each completion ends (else generate calls it after)."""
    returns_topk: bool = False
    """Whether `sample` honours SamplingParams.logprobs_topk (generate refuses a request for it otherwise)."""

    def __init__(self, *, eos_token_ids: Sequence[int], pad_token_id: int) -> None:
        eos = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
        if not eos or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos):
            raise ValueError(
                f"eos_token_ids must be a non-empty list of token ids >= 0, got {eos_token_ids!r}; "
                "pass e.g. [tokenizer.eos_token_id]"
            )
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise ValueError(
                f"pad_token_id must be a token id >= 0, got {pad_token_id!r}; pass tokenizer.pad_token_id "
                "(or the EOS id when the tokenizer has no pad token)"
            )
        self.eos_token_ids = eos
        self.pad_token_id = pad_token_id

    def generate(
        self,
        model: torch.nn.Module,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        *,
        on_finished: Callable[[int, list[int]], None] | None = None,
    ) -> RolloutBatch:
        """Returns a RolloutBatch with group_size completions per prompt and their sampling log-probs.

        on_finished(row, completion_ids) is called for each completion that ends with EOS, as soon as it has
        when the engine streams (`streams_finished`), else after sampling: a caller starts work on finished
        completions (a code reward's sandbox runs) while the others are still being generated."""
        validate_request(prompt_ids, group_size, params)
        if params.logprobs_topk > 0 and not self.returns_topk:
            raise ValueError(
                f"the {self.name} engine does not return top-K log-probs (logprobs_topk={params.logprobs_topk}); "
                "use the builtin engine (make_engine('builtin', ...)), or logprobs_topk=0"
            )
        device = input_device(model)
        stream = {"on_finished": on_finished} if on_finished is not None and self.streams_finished else {}
        with torch.inference_mode(), eval_mode(model):
            out = self.sample(model, prompt_ids, group_size, params, generator, device, **stream)
        # Out of inference mode, so the batch holds ordinary tensors a caller may change in place.
        lengths = out.lengths.tolist()
        if on_finished is not None and not stream:
            tokens = out.tokens.cpu()  # one copy from a GPU for every finished row, not one each
            for row in (~out.truncated).nonzero().flatten().tolist():
                on_finished(row, tokens[row, : lengths[row]].tolist())
        logps = out.logprobs.cpu()
        top_ids = top_lps = None
        if params.logprobs_topk > 0:
            if out.topk_ids is None or out.topk_logprobs is None:
                raise RuntimeError(f"the {self.name} engine was asked for top-K log-probs and returned none")
            ids, lps = out.topk_ids.cpu(), out.topk_logprobs.cpu()
            top_ids = [ids[i, :n].clone() for i, n in enumerate(lengths)]
            top_lps = [lps[i, :n].clone() for i, n in enumerate(lengths)]
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids],
            completion_ids=[row[:n] for row, n in zip(out.tokens.tolist(), lengths)],
            truncated=out.truncated.to("cpu", copy=True),
            group_size=group_size,
            sampling_logprobs=[logps[i, :n].clone() for i, n in enumerate(lengths)],
            paths=out.paths,
            topk_ids=top_ids,
            topk_logprobs=top_lps,
        )

    @abc.abstractmethod
    def sample(
        self,
        model: torch.nn.Module,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        device: torch.device,
    ) -> Sampled:
        """Returns the Sampled rows of a checked request (called by generate, under inference mode, model in eval)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(eos_token_ids={self.eos_token_ids}, pad_token_id={self.pad_token_id})"


def validate_request(prompt_ids: object, group_size: object, params: object) -> None:
    """Returns None; raises a clear error when a generate() request is malformed."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if not isinstance(prompt_ids, list | tuple) or len(prompt_ids) == 0:
        raise ValueError(
            f"prompt_ids must be a non-empty list of token-id lists, got {type(prompt_ids).__name__} "
            f"of length {len(prompt_ids) if hasattr(prompt_ids, '__len__') else '?'}"
        )
    for j, p in enumerate(prompt_ids):
        if not isinstance(p, list | tuple) or len(p) == 0:
            raise ValueError(
                f"prompt {j} must be a non-empty list of token ids, got {p!r}; drop empty prompts "
                "or prepend a BOS token"
            )


def completion_ends(
    tokens: torch.Tensor, eos_token_ids: Sequence[int], max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (lengths [N] long, truncated [N] bool) of raw generated rows tokens [N, T] on their device.

    A row is cut at max_len tokens, then after its first EOS (included); it is truncated when it has no
    EOS and holds max_len tokens."""
    tokens = tokens[:, :max_len]
    hit = torch.isin(tokens, torch.tensor(list(eos_token_ids), dtype=tokens.dtype, device=tokens.device))
    ended = hit.any(-1)  # [N]
    before = (hit.cumsum(-1) == 0).sum(-1)  # [N] tokens before the first EOS (all of them without one)
    return before + ended.long(), ~ended & (tokens.shape[1] >= max_len)


def prefill(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attn: torch.Tensor,
    cache: Any,
    forward: Callable[..., Any] | None = None,
) -> torch.Tensor:
    """Returns the next-token logits [B, V] after the left-padded prompts input_ids / attn [B, P], with `cache`
    filled in place (reading it back from the output would touch a field transformers renamed). forward: what
    calls `model` (cohort.rollout.casts.cast_once), `model` itself by default."""
    extra = {"logits_to_keep": 1} if forward_accepts(model, "logits_to_keep") else {}
    out = (forward or model)(
        input_ids=input_ids,
        attention_mask=attn,
        position_ids=(attn.cumsum(-1) - 1).clamp(min=0),  # [B, P]
        **cache_kwargs(model, cache),
        **extra,
    )
    return out.logits[:, -1, :]


def left_pad(prompt_ids: Sequence[Sequence[int]], pad_token_id: int, device: torch.device):
    """Returns (input_ids [B, P], attention_mask [B, P] long) with the prompts left-padded to the longest."""
    width = max(len(p) for p in prompt_ids)
    ids = [[pad_token_id] * (width - len(p)) + list(p) for p in prompt_ids]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids]
    return (
        torch.tensor(ids, dtype=torch.long, device=device),  # [B, P]
        torch.tensor(mask, dtype=torch.long, device=device),  # [B, P]
    )
