"""The episode loop: rollouts that call tools and talk to environments over several turns.

`EpisodeGeneration` is a generation source (cohort.train.generation): for each row it gives every rollout its
own environment instance (reset with the row; a string it returns is appended to the last user message),
renders the prompt with the rollout's tool schemas, and lets `decode_episodes` sample all rollouts together.
When a rollout ends a turn its text is parsed for tool calls: calls run at once on the tool executor (while
the other rollouts still decode); a turn without a call ends the episode, or, in a TextEnvironment, is the
action its `step` answers. Tool results and observations enter through the chat template (the difference of
two renderings) and are masked out of the loss. The RolloutBatch carries, per rollout, its EpisodeRecord:
the conversation in TRL's form for the reward functions and the samples, its counts and its environment.

With rollout workers (`remote`) the same agent drives `decode_episodes_remote` instead: each round of turns is
sampled by the workers and everything else stays here (cohort.episodes.remote).

A group's rollouts usually share their prompt; where an environment's reset gives them different ones, the
group's prompt is their common start and each rollout's remainder opens its completion, masked like any
inserted token.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from cohort.data import is_conversational
from cohort.episodes.control_tokens import control_tokens, parse_text, unmark
from cohort.episodes.decoding import DecodedEpisodes, StaticTurns, decode_episodes
from cohort.episodes.environments import env_reset, env_step
from cohort.episodes.execution import ToolExecutor, ToolResult
from cohort.episodes.parsers import ToolParser, parser_for
from cohort.episodes.remote import decode_episodes_remote
from cohort.episodes.spec import EnvironmentSpec, EpisodeSpec
from cohort.episodes.templates import check_tool_template, render_prompt, render_tool_turn
from cohort.episodes.tools import Tool
from cohort.errors import NonFiniteError, NonFiniteSamplingError, TrainingError
from cohort.fastpath import FastConfig
from cohort.fastpath.packed_linear import packed_linears, packing_plan
from cohort.models import eval_mode, input_device
from cohort.rollout import EpisodeRecord, RolloutBatch, SamplingParams
from cohort.rollout.builtin import BuiltinEngine, capture_failed
from cohort.rollout.casts import CastForward, cast_once
from cohort.rollout.sampler_copy import SamplerCopy
from cohort.runtime.sharding import gathered

if TYPE_CHECKING:
    from cohort.serve.client import RemoteGeneration

EMPTY_PROMPT: list[dict[str, Any]] = [{"role": "user", "content": ""}]
"""The prompt given to rows of a routing-only dataset (an `environment` column and no prompt): the environment's
reset writes the task, and, as in TRL, the placeholder is not passed to reset."""

COUNTERS = ("episodes", "turns", "calls", "failures", "malformed", "budget_stops", "env_errors")
"""What the loop counts over a run (kept in checkpoints): episodes, sampled turns, executed tool calls,
failed ones, unparsable calls, insertions that did not fit the token budget, environment steps that failed."""


class _Pending:
    """A call running on a daemon thread (a thread cannot be stopped: one that never returns is abandoned at
    its timeout and cannot keep the process from exiting)."""

    def __init__(self, fn: Callable[..., Any], *args: Any, timeout: float) -> None:
        self.timeout, self.done = timeout, threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.start = time.perf_counter()
        threading.Thread(target=self._run, args=(fn, args), daemon=True, name="cohort-env-step").start()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            value = fn(*args)
            self.value = asyncio.run(value) if inspect.iscoroutine(value) else value
        except BaseException as exc:  # handed to the episode, which survives it
            self.error = exc
        finally:
            self.done.set()

    def result(self) -> Any:
        """Returns the call's value; raises its exception, or TimeoutError past the timeout."""
        left = self.timeout - (time.perf_counter() - self.start)
        if not self.done.wait(max(left, 0.0)):
            raise TimeoutError(f"no answer after {self.timeout:g} s")
        if self.error is not None:
            raise self.error
        return self.value


class _Rollout:
    """One rollout's episode while it is decoded."""

    def __init__(
        self,
        record: EpisodeRecord,
        tools: dict[str, Tool],
        schemas: list[dict[str, Any]],
        env: EnvironmentSpec | None,
        offset: int,
    ) -> None:
        self.record, self.tools, self.schemas, self.env = record, tools, schemas, env
        self.offset = offset  # the prompt remainder opening the completion
        self.length = 0  # tokens decoded so far (sampled and inserted)
        self.iterations = 0  # tool-calling turns executed
        self.waiting: tuple[str, Any] | None = None  # ("tools", Future) | ("step", _Pending)


class EpisodeGeneration:
    """Rolls out multi-turn episodes of the current policy (a GenerationSource)."""

    def __init__(
        self,
        spec: EpisodeSpec,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        end_of_turn_ids: Sequence[int],
        pad_token_id: int,
        prompt_column: str = "prompt",
        chat_template_kwargs: dict[str, Any] | None = None,
        sampler_copy: SamplerCopy | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        extend_cache: bool = True,
        fresh: bool = False,
        preallocate: bool = True,
        remote: RemoteGeneration | None = None,
        fast: FastConfig | None = None,
    ) -> None:
        """fresh: make this loop's own environment instances (a held-out loop must not touch the training ones);
        remote: rollout workers that sample every policy turn (cohort.episodes.remote), instead of this process;
        fast: the switches the local decoding reads (`packed_weights`, `cast_once`)."""
        self.spec, self.model, self.tokenizer = spec, model, tokenizer
        self.end_ids, self.pad_id = list(end_of_turn_ids), pad_token_id
        self.prompt_column, self.template_kwargs = prompt_column, chat_template_kwargs or None
        self.sampler_copy, self.autocast, self.extend_cache = sampler_copy, autocast, extend_cache
        self.preallocate, self.remote, self.fast = preallocate, remote, fast
        self.paths: dict[str, bool] = {}  # the fast paths the last local decoding took
        if spec.tools or any(env.tools for env in spec.environments.values()):
            check_tool_template(tokenizer, chat_template_kwargs=self.template_kwargs)
            self.parser: ToolParser | None = parser_for(
                tokenizer, tool_parser=spec.tool_parser, tools=spec.all_schemas()
            )
        else:
            self.parser = None
        self.control = control_tokens(tokenizer) if self.parser is not None else {}
        self.executor = ToolExecutor(
            timeout=spec.timeout,
            max_chars=spec.max_chars,
            result_format="json" if spec.result_format == "json" else "str",
        )
        self.pools: dict[str | None, list[Any]] = {
            name: [] if fresh else [env.first] for name, env in spec.environments.items()
        }
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.warned: set[str] = set()  # environment steps whose failure was said already

    # ------------------------------------------------------------------ the GenerationSource call
    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        rows: list[dict] | None = None,
        on_finished: Callable[[int, list[int]], None] | None = None,
    ) -> RolloutBatch:
        """Returns G episodes of each row (group-contiguous) with loss masks and episode records (on_finished is
        not called: an episode's reward reads its messages, known when the batch ends)."""
        if rows is None or len(rows) != len(prompt_ids):
            raise TrainingError(
                "the episode loop needs the rows of the prompts (their environments reset from them)"
            )
        rollouts, prompts = self._start(rows, group_size)
        starts = _group_starts(prompts, group_size)
        budgets = [params.max_completion_length - r.offset for r in rollouts]
        if min(budgets) < 1:
            worst = min(range(len(budgets)), key=budgets.__getitem__)
            raise TrainingError(
                f"rollout {worst}: its environment's reset made the prompt {rollouts[worst].offset} tokens longer "
                f"than its group's, leaving no room in rollout.max_completion_length="
                f"{params.max_completion_length}; raise it"
            )
        agent = _Agent(self, rollouts)
        if self.remote is not None:
            out = self._decode_remote(prompts, group_size, params, generator, agent, budgets)
        else:
            out = self._decode_local(prompts, params, generator, agent, budgets)
        completions, masks, logprobs = [], [], []
        for i, r in enumerate(rollouts):
            remainder = prompts[i][len(starts[i // group_size]) :]
            completions.append(remainder + out.tokens[i])
            masks.append(torch.tensor([False] * len(remainder) + out.masks[i], dtype=torch.bool))
            logprobs.append(torch.tensor([0.0] * len(remainder) + out.logprobs[i], dtype=torch.float32))
            if out.truncated[i]:
                r.record.stop = "length"
        self.counts["episodes"] += len(rollouts)
        self.counts["turns"] += sum(out.turns)
        return RolloutBatch(
            prompt_ids=starts,
            completion_ids=completions,
            truncated=torch.tensor(out.truncated, dtype=torch.bool),
            group_size=group_size,
            sampling_logprobs=logprobs,
            loss_masks=masks,
            episodes=[r.record for r in rollouts],
            paths={} if self.remote is not None else dict(self.paths),
        )

    def _decode_local(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        generator: torch.Generator | None,
        agent: _Agent,
        budgets: list[int],
    ) -> DecodedEpisodes:
        """Returns the episodes decoded in this process (the policy, or its sampling copy, gathered if sharded)."""
        with self.autocast(), gathered(self.model):
            model = self.model if self.sampler_copy is None else self.sampler_copy.sync(self.model)
            device = input_device(model)
            try:
                with (
                    torch.inference_mode(),
                    eval_mode(model),
                    self._packing(model, device, len(prompts), max(budgets)) as packed,
                    cast_once(model, device, self.fast, self.paths) as forward,
                ):
                    self.paths["packed_weights"] = packed > 0
                    static = self._static_turns(model, device, prompts, budgets, forward)
                    out = decode_episodes(
                        model,
                        prompts,
                        params,
                        generator,
                        agent,
                        end_of_turn_ids=self.end_ids,
                        pad_token_id=self.pad_id,
                        device=device,
                        extend_cache=self.extend_cache,
                        budgets=budgets,
                        preallocate=self.preallocate,
                        forward=forward,
                        static=static,
                    )
                    self.paths["graph_decode"] = static is not None and static.turns > 0
            except NonFiniteSamplingError as e:
                raise NonFiniteError(
                    f"the policy produced non-finite logits while sampling ({e}); usually half-precision "
                    "overflow (try model.dtype=float32 or bfloat16)"
                ) from None
        return out

    def _packing(
        self, model: torch.nn.Module, device: torch.device, rows: int, budget: int
    ) -> contextlib.AbstractContextManager[int]:
        """Returns the block in which the episodes decode through oneDNN-packed weights (fast.packed_weights, CPU
        only; it yields how many layers were packed, 0 for none): packed where the builtin engine would pack a
        rollout as long as the longest budget, but once for the whole batch of episodes, from its first step (a
        batch of episodes decodes for many turns)."""
        plan = packing_plan(self.fast or FastConfig(), model, device, budget)
        if plan is None:
            return contextlib.nullcontext(0)
        return packed_linears(model, rows, plan[1])

    def _static_turns(
        self,
        model: torch.nn.Module,
        device: torch.device,
        prompts: list[list[int]],
        budgets: list[int],
        forward: Any,
    ) -> StaticTurns | None:
        """Returns how the batch's turns decode with the builtin engine's captured step (fast.graph_decode: on a
        CUDA GPU, for a model the engine's once-per-model check passed), None where they decode eagerly."""
        f = self.fast or FastConfig()
        if f.graph_decode == "off" or (f.graph_decode == "auto" and device.type != "cuda"):
            return None
        engine = BuiltinEngine(eos_token_ids=self.end_ids, pad_token_id=self.pad_id, fast=f)
        longest = max(budgets)
        if not engine.takes_captured_step(model, device, max(len(p) for p in prompts) + longest, longest):
            return None
        return StaticTurns(
            capture=device.type == "cuda",
            min_tokens=0 if f.compile_decode == "on" else f.graph_decode_min_tokens,
            check_every=f.graph_decode_check_every,
            compiled=engine.compiles_captured_step(model, device),
            weights=forward.weights if isinstance(forward, CastForward) else None,
            on_failure=lambda error: capture_failed(model, f.graph_decode, error, "a turn's decode step"),
        )

    def _decode_remote(
        self,
        prompts: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        agent: _Agent,
        budgets: list[int],
    ) -> DecodedEpisodes:
        """Returns the episodes whose turns the rollout workers sampled (the weights pushed first when they
        changed), each round's request seeded from `generator`."""
        remote = self.remote
        assert remote is not None
        remote.push_weights()

        def sample(
            prompt_ids: list[list[int]],
            group_size: int,
            params: SamplingParams,
            generator: torch.Generator | None,
        ) -> RolloutBatch:
            """Returns one round's turns, each chunk sampled from a seed drawn from `generator`."""
            return remote.collect(remote.submit(prompt_ids, group_size, params, generator))

        return decode_episodes_remote(
            sample,
            prompts,
            params,
            generator,
            agent,
            end_of_turn_ids=self.end_ids,
            budgets=budgets,
            group_size=group_size,
        )

    # ------------------------------------------------------------------ episode start
    def _start(self, rows: list[dict], group_size: int) -> tuple[list[_Rollout], list[list[int]]]:
        """Returns each rollout's state and prompt ids: environments drawn from the pools and reset."""
        handed: dict[str | None, int] = {}
        rollouts: list[_Rollout] = []
        prompts: list[list[int]] = []
        for row in rows:
            env = self.spec.environment_for(row)
            for _ in range(group_size):
                instance = self._instance(env, handed) if env is not None else None
                messages = self._prompt_messages(row, env, instance)
                tools = dict(self.spec.tools)
                if env is not None and instance is not None and env.kind == "tools":
                    tools.update(env.tools_of(instance))
                schemas = self.spec.schemas(env)
                ids = render_prompt(
                    self.tokenizer, messages, tools=schemas or None, chat_template_kwargs=self.template_kwargs
                )
                record = EpisodeRecord(prompt=messages, environment=instance)
                rollouts.append(_Rollout(record, tools, schemas, env, 0))
                prompts.append(ids)
        starts = _group_starts(prompts, group_size)
        for i, r in enumerate(rollouts):
            r.offset = len(prompts[i]) - len(starts[i // group_size])
        return rollouts, prompts

    def _instance(self, env: EnvironmentSpec, handed: dict[str | None, int]) -> Any:
        """Returns the next free instance of `env`'s pool for this batch, making one when all are handed out."""
        pool = self.pools[env.name]
        index = handed.get(env.name, 0)
        if index == len(pool):
            pool.append(env.factory())
        handed[env.name] = index + 1
        return pool[index]

    def _prompt_messages(self, row: dict, env: EnvironmentSpec | None, instance: Any) -> list[dict[str, Any]]:
        """Returns the rollout's prompt as messages: the row's (a text prompt as one user message, an empty
        user message when an environment owns the data), its environment's reset observation appended."""
        prompt = row.get(self.prompt_column)
        if prompt is None and env is None:
            raise TrainingError(f"a row has no {self.prompt_column!r} column; every row needs a prompt")
        messages = prompt_messages(prompt)
        if env is None:
            return messages
        # One factory: the row as it is (prompt included); several: without the routing column, as TRL.
        kwargs = {
            k: v
            for k, v in row.items()
            if not (self.spec.routed and k == "environment")
            and not (k == self.prompt_column and v is EMPTY_PROMPT)
        }
        try:
            observation = env_reset(instance.reset(**kwargs), env_label=instance)
        except Exception as exc:
            raise TrainingError(
                f"environment {env.cls.__qualname__}.reset raised {type(exc).__name__}: {exc}; reset(**row) must "
                f"start an episode for any training row (row keys: {sorted(kwargs)})"
            ) from exc
        if observation:
            messages[-1] = {**messages[-1], "content": str(messages[-1].get("content") or "") + observation}
        return messages

    def warn_env_error(self, environment: Any, exc: BaseException) -> None:
        """Returns None after warning, the first time an environment class's step raises, what it raised (the
        episode ends and is counted; a bug that ends every episode would otherwise show only in a metric)."""
        name = f"{type(environment).__qualname__}.step"
        if name in self.warned:
            return
        self.warned.add(name)
        warnings.warn(
            f"environment {name} raised {type(exc).__name__}: {exc}; its episode ended there (stop 'env_error', "
            f"counted in episodes/stop_env_error; this warning is shown once per environment class): fix the "
            "environment's step(), which must return an observation for any action",
            stacklevel=2,
        )

    # ------------------------------------------------------------------ checkpoints and metrics
    def state_dict(self) -> dict[str, Any]:
        """Returns the loop's counters and the state of every pooled environment that has a state_dict()."""
        pools = {
            str(name): [
                inst.state_dict() if callable(getattr(inst, "state_dict", None)) else None for inst in pool
            ]
            for name, pool in self.pools.items()
        }
        return {"counts": dict(self.counts), "pools": pools}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores counters and pooled environments' states (instances are made as needed)."""
        self.counts.update({k: int(v) for k, v in state.get("counts", {}).items() if k in self.counts})
        for name, env in self.spec.environments.items():
            saved = state.get("pools", {}).get(str(name), [])
            pool = self.pools[name]
            while len(pool) < len(saved):
                pool.append(env.factory())
            for inst, inst_state in zip(pool, saved):
                if inst_state is not None and callable(getattr(inst, "load_state_dict", None)):
                    inst.load_state_dict(inst_state)

    def close(self) -> None:
        """Stops the tool executor and closes the pooled environments."""
        self.executor.close()
        for pool in self.pools.values():
            for inst in pool:
                close = getattr(inst, "close", None)
                if callable(close):
                    with contextlib.suppress(Exception):
                        close()


class _Agent:
    """The decoder's TurnAgent: parses each ended turn, runs its tools or its environment step, and renders what
    comes back as the tokens to insert."""

    def __init__(self, loop: EpisodeGeneration, rollouts: list[_Rollout]) -> None:
        self.loop, self.rollouts = loop, rollouts

    def turn_ended(self, row: int, turn: list[int], *, truncated: bool) -> bool:
        """Returns whether the rollout goes on: its calls (or its environment step) are started at once."""
        loop, r = self.loop, self.rollouts[row]
        r.length += len(turn)
        r.record.turn_ends.append(r.offset + r.length - 1)
        text = loop.tokenizer.decode(turn, skip_special_tokens=True)
        if truncated:
            r.record.messages.append({"role": "assistant", "content": text})
            r.record.stop = "length"
            return False
        parsed = None
        if loop.parser and r.tools:
            # a delimiter counts only where the model sampled its token (cohort.episodes.control_tokens)
            parsed = unmark(loop.parser.parse(parse_text(loop.tokenizer, turn, loop.control)))
        if parsed is not None and parsed.status == "calls":
            r.record.messages.append(parsed.message())
            limit = loop.spec.max_iterations
            if limit is not None and r.iterations >= limit:
                r.record.stop = "max_tool_calls"  # the call stays unexecuted in the last message, as in TRL
                return False
            r.waiting = ("tools", loop.executor.submit(parsed.calls, r.tools))
            return True
        if parsed is not None and parsed.status == "malformed":
            loop.counts["malformed"] += 1
            r.record.stop = "malformed"
        r.record.messages.append({"role": "assistant", "content": text})
        if r.env is not None and r.env.kind == "text":
            r.waiting = ("step", _Pending(r.record.environment.step, text, timeout=loop.spec.timeout))
            return True
        if r.record.stop != "malformed":
            r.record.stop = "answer"
        return False

    def continuation(self, row: int, room: int) -> list[int] | None:
        """Returns the tool turn (or the environment's observation) to insert, None when the episode is over."""
        r = self.rollouts[row]
        if r.waiting is None:
            return None
        kind, pending = r.waiting
        r.waiting = None
        if kind == "tools":
            results: list[ToolResult] = pending.result()
            r.record.calls += len(results)
            r.record.failures += sum(res.failed for res in results)
            self.loop.counts["calls"] += len(results)
            self.loop.counts["failures"] += sum(res.failed for res in results)
            new = [res.message() for res in results]
        else:
            step = self._step(r, pending)
            if step is None:
                return None
            new = [{"role": "user", "content": step.observation}]
        ids = render_tool_turn(
            self.loop.tokenizer,
            [*r.record.prompt, *r.record.messages],
            new,
            tools=r.schemas or None,
            end_of_turn=self.loop.end_ids,
            chat_template_kwargs=self.loop.template_kwargs,
        )
        if len(ids) >= room:
            # TRL drops a result that would pass the completion budget and ends the episode as it is.
            self.loop.counts["budget_stops"] += 1
            r.record.stop = "budget"
            return None
        r.record.messages += new
        r.iterations += kind == "tools"
        r.length += len(ids)
        return ids

    def _step(self, r: _Rollout, pending: _Pending) -> Any:
        """Returns the environment's EnvStep for the rollout's last turn, or None when the episode ends there."""
        try:
            step = env_step(pending.result(), env_label=r.record.environment)
        except Exception as exc:
            self.loop.counts["env_errors"] += 1
            r.record.stop = "env_error"
            self.loop.warn_env_error(r.record.environment, exc)
            r.record.messages.append(
                {"role": "user", "content": f"environment error: {type(exc).__name__}: {exc}"}
            )
            return None
        r.record.turn_rewards.append(float(step.reward))
        if step.done:
            r.record.stop = "done"
            if step.observation:
                r.record.messages.append({"role": "user", "content": step.observation})
            return None
        return step


def prompt_messages(prompt: Any) -> list[dict[str, Any]]:
    """Returns a row's prompt as chat messages: a conversation as it is, a text as one user message, None (an
    environment owns the data) as one empty user message."""
    if prompt is None:
        return [{"role": "user", "content": ""}]
    if is_conversational(prompt):
        return [dict(m) for m in prompt]
    return [{"role": "user", "content": str(prompt)}]


STOPS = ("answer", "done", "length", "max_tool_calls", "budget", "malformed", "env_error")
"""Why an episode ended (EpisodeRecord.stop)."""


def episode_metrics(
    records: Sequence[EpisodeRecord], all_sum: Callable[[float], float] = float
) -> dict[str, float]:
    """Returns a step's episode metrics over every process (`all_sum` sums a number across them): TRL's
    tools/call_frequency (calls per rollout) and tools/failure_frequency (failures per call), and cohort's
    episodes/turns_mean and the share of episodes per stop reason."""
    n = all_sum(float(len(records)))
    calls = all_sum(float(sum(r.calls for r in records)))
    failures = all_sum(float(sum(r.failures for r in records)))
    turns = all_sum(float(sum(1 for r in records for m in r.messages if m.get("role") == "assistant")))
    out = {
        "tools/call_frequency": calls / n if n else 0.0,
        "tools/failure_frequency": failures / calls if calls else 0.0,
        "episodes/turns_mean": turns / n if n else 0.0,
    }
    for stop in STOPS:
        out[f"episodes/stop_{stop}"] = all_sum(float(sum(r.stop == stop for r in records))) / n if n else 0.0
    return out


def _group_starts(prompts: list[list[int]], group_size: int) -> list[list[int]]:
    """Returns each group's prompt: the longest start its G rollouts' prompts share."""
    starts = []
    for g in range(0, len(prompts), group_size):
        group = prompts[g : g + group_size]
        first = group[0]
        n = len(first)
        for other in group[1:]:
            n = min(n, len(other))
            n = next((i for i in range(n) if other[i] != first[i]), n)
        if n == 0:
            raise TrainingError(
                "the rollouts of one row start with different tokens (their environment's reset observations "
                "change the chat template's first token); reset should return text appended to the prompt"
            )
        starts.append(first[:n])
    return starts
