"""`cohort doctor CONFIG`: a one-minute rehearsal of a run before committing hours to it.

It checks the config (its first error in full, with its fix), loads the model, tokenizer and data exactly as
`cohort train` would, samples a few real groups, scores them with the run's reward functions, and takes
one real update on them (on the loaded copy; nothing is saved). Then it reports what would go wrong:

- reward functions that raise, or return None for every completion (blocking);
- the share of groups whose rewards are all equal (they teach nothing), and the truncation rate, with
  "EOS never ends a completion" when no completion ended (a chat template or EOS token problem);
- one prompt's update laid out per completion, seed 002's check (a): reward, advantage, the ratio
  π_new / π_old after the update, whether it was clipped, and the KL to the reference;
- the batch arithmetic (prompts per step, minibatches, micro-batches);
- an estimate of seconds per step and of peak memory, from the rehearsal's own timings (a step of the run's
  size, or two sizes and the line through them for large steps, after the first draw has paid the
  once-per-model checks).

The exit code is 1 when a blocking problem was found (the run would fail or learn nothing), else 0.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from cohort.algo import zero_std_group_mask
from cohort.config import TrainConfig, from_dict, to_dict
from cohort.errors import ConfigError
from cohort.runtime.plugins import check_user_objective
from cohort.train.advantage_step import outcome_advantages
from cohort.train.scorer import as_text
from cohort.train.update import PolicyBatch
from cohort.trainer import GRPOTrainer


@dataclasses.dataclass
class Report:
    """What the rehearsal found: lines to print, and whether any problem blocks the run."""

    lines: list[str] = dataclasses.field(default_factory=list)
    blocking: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)

    def say(self, text: str) -> None:
        """Records a line of the report."""
        self.lines.append(text)

    def block(self, text: str) -> None:
        """Records a problem that would make the run fail or learn nothing."""
        self.blocking.append(text)
        self.lines.append(f"  PROBLEM: {text}")

    def warn(self, text: str) -> None:
        """Records a problem the run survives but should not ignore."""
        self.warnings.append(text)
        self.lines.append(f"  warning: {text}")


MEASURED_GROUPS = 16
"""Steps of at most this many groups are timed at their real size by the rehearsal's estimate."""


def rehearse(cfg: TrainConfig, *, groups: int = 4, reward_funcs: list[Callable] | None = None) -> Report:
    """Returns the doctor's report on the run `cfg` describes (see the module docstring)."""
    rep = Report()
    rep.say("config")
    try:
        cfg.validate(reward_funcs=reward_funcs)
        check_user_objective(cfg)  # the rehearsal runs the user's loss and estimator anyway
    except ConfigError as e:
        rep.block(str(e))
        return rep
    r, a = cfg.rollout, cfg.algo
    rep.say(
        f"  {cfg.prompts_per_step} prompts per step x G={r.group_size} = {r.batch_size} completions; "
        f"{a.num_minibatches} minibatch(es) x {a.num_iterations} pass(es) = {a.num_minibatches * a.num_iterations} "
        f"optimizer step(s) per batch; micro-batches of <= {cfg.micro_batch_tokens} tokens"
    )
    trial = from_dict(to_dict(cfg))  # a copy: the rehearsal writes to a temporary folder, never out_dir
    with tempfile.TemporaryDirectory(prefix="cohort-doctor-") as tmp:
        trial.out_dir, trial.resume, trial.progress, trial.steps = tmp, None, False, max(cfg.steps, 1)
        t0 = time.perf_counter()
        try:
            trainer = GRPOTrainer(trial, reward_funcs=reward_funcs)
        except Exception as e:  # noqa: BLE001 - loading is what is rehearsed: every failure is the finding
            rep.say("model and data")
            rep.block(f"{type(e).__name__}: {e}")
            return rep
        rep.say("model and data")
        n_params = sum(p.numel() for p in trainer.model.parameters())
        rep.say(
            f"  {cfg.model.name_or_path}: {n_params / 1e6:.2f} M parameters on {trainer.device}, loaded in "
            f"{time.perf_counter() - t0:.1f} s; {len(trainer.train_rows)} training prompts, "
            f"{len(trainer.eval_rows)} held-out"
        )
        k = max(1, min(groups, len(trainer.train_rows)))
        try:
            drawn = trainer.drawer.draw(k, step=1)
        except Exception as e:  # noqa: BLE001 - a reward function's own error is what the doctor reports
            rep.block(f"sampling or scoring {k} groups failed: {type(e).__name__}: {e}")
            return rep
        _rewards(rep, trainer, drawn)
        G = r.group_size
        # As training judges them: per weighted reward column under GDPO's decoupled normalisation.
        zero = zero_std_group_mask(trainer.drawer.signal(drawn), G).view(-1, G)[:, 0].float().mean().item()
        truncated = drawn.rollout.truncated.float().mean().item()
        rep.say("rollout")
        rep.say(
            f"  {k} groups: {100 * zero:.0f}% with all-equal rewards, {100 * truncated:.0f}% of completions "
            f"truncated at {r.max_completion_length} tokens, mean length "
            f"{drawn.rollout.loss_lengths.float().mean().item():.1f}"
        )
        if zero == 1.0 and not a.dynamic_sampling:
            rep.warn(
                "every sampled group has all-equal rewards: such steps teach nothing (prompts too easy or too "
                "hard for this model, or a reward that cannot tell completions apart); try algo.dynamic_sampling"
            )
        if truncated == 1.0:
            rep.warn(
                f"no completion ended within {r.max_completion_length} tokens: EOS never ends a completion. Check "
                "that the chat template ends turns with the EOS token the model emits (model.generation_config), "
                "or raise rollout.max_completion_length"
            )
        adv = outcome_advantages(
            drawn.per_func, drawn.reward, drawn.rollout, a, trainer.reward_weights
        )  # the run's
        table = _one_update(trainer, drawn, adv)
        rep.say(
            "one prompt's update (seed 002's check a): the first group, after one optimizer step on the sample"
        )
        rep.lines += table
        # Timed again, warm: the first draw and update paid the once-per-model checks and the allocations (a
        # tiny model's first step took 5-25 times its later ones).
        try:
            timed = _time_steps(trainer, k, cfg.prompts_per_step, a)
        except Exception as e:  # noqa: BLE001 - as the first draw's: the reward function's own error
            rep.block(f"sampling or scoring {k} more groups failed: {type(e).__name__}: {e}")
            return rep
        per_step, how = timed
        rep.say("estimates")
        rep.say(
            f"  about {per_step:.2f} s per step ({cfg.prompts_per_step} groups; {how}; more where a step scores "
            f"slower rewards or decodes longer), {per_step * cfg.steps / 60:.1f} min for {cfg.steps} steps"
        )
        rep.say(f"  peak memory so far: {_peak_memory(trainer.device)}")
    return rep


def _time_steps(trainer: Any, k: int, prompts: int, algo: Any) -> tuple[float, str]:
    """Returns the estimated seconds of one step of `prompts` groups, and how it was obtained.

    A step of up to MEASURED_GROUPS groups is timed whole. A larger one is timed at k and at 4k groups and
    extrapolated along the line through both: a step has fixed costs (the optimizer step, the decode's per-token
    launches) that scaling k groups' time alone multiplied."""
    available = len(trainer.train_rows)

    def timed(n: int, step: int) -> float:
        t0 = time.perf_counter()
        drawn = trainer.drawer.draw(n, step=step)
        adv = outcome_advantages(drawn.per_func, drawn.reward, drawn.rollout, algo, trainer.reward_weights)
        trainer.updater.update(_policy_batch(trainer, drawn, adv), trainer.shuffle_generator)
        return time.perf_counter() - t0

    if prompts <= min(MEASURED_GROUPS, available):
        return timed(prompts, 2), "one warm step of that size measured"
    small, large = k, min(4 * k, available)
    t_small = timed(small, 2)
    if large <= small:
        return t_small * prompts / small, f"scaled from {small} groups measured after a first step"
    t_large = timed(large, 3)
    slope = max(0.0, (t_large - t_small) / (large - small))
    return (
        t_large + slope * (prompts - large),
        f"extrapolated from {small} and {large} groups measured after a first step",
    )


def _rewards(rep: Report, trainer: Any, drawn: Any) -> None:
    """Adds each reward function's statistics; one that returns None for every completion blocks."""
    rep.say("rewards")
    for j, name in enumerate(trainer.reward_names):
        col = drawn.per_func[:, j]
        valid = col[~torch.isnan(col)]
        if valid.numel() == 0:
            rep.block(
                f"reward function {name!r} returned None for every completion: check that it applies to this "
                "dataset (its columns, the completion format)"
            )
            continue
        rep.say(
            f"  {name}: mean {valid.mean().item():.3g}, std {valid.std(unbiased=False).item():.3g}, "
            f"{100 * (1 - valid.numel() / col.numel()):.0f}% None"
        )


def _policy_batch(trainer: Any, drawn: Any, adv: torch.Tensor) -> PolicyBatch:
    """Returns the update's batch of the sampled groups, every completion in the loss."""
    return PolicyBatch(
        drawn.rollout.prompt_ids,
        drawn.rollout.completion_ids,
        trainer.cfg.rollout.group_size,
        adv,
        torch.ones_like(adv, dtype=torch.bool),
        drawn.rollout.sampling_logprobs,
        topk_ids=drawn.rollout.topk_ids,
        topk_logprobs=drawn.rollout.topk_logprobs,
    )


def _one_update(trainer: Any, drawn: Any, adv: torch.Tensor) -> list[str]:
    """Returns the per-completion table of one real update on the sampled groups (reward, advantage, ratio after
    the step, clipped or not, KL to the reference)."""
    G = trainer.cfg.rollout.group_size
    a = trainer.cfg.algo
    batch = _policy_batch(trainer, drawn, adv)
    rows = list(range(G))
    before = trainer.updater.frozen_logprobs(trainer.model, batch, rows)
    stats = trainer.updater.update(batch, trainer.shuffle_generator)
    after = trainer.updater.frozen_logprobs(trainer.model, batch, rows)
    ref = None
    if trainer.reference is not None:
        with trainer.reference() as ref_model:
            ref = trainer.updater.frozen_logprobs(ref_model, batch, rows)
    high = a.eps_low if a.eps_high is None else a.eps_high
    reward = drawn.reward  # the weighted sum the advantages were computed from
    texts = trainer.tokenizer.batch_decode(drawn.rollout.completion_ids[:G], skip_special_tokens=True)
    out = [
        f"  prompt: {as_text(drawn.rows[0][trainer.cfg.data.prompt_column])[:80]!r}",
        "    #  reward  advantage  ratio  clipped  KL      completion",
    ]
    for i in rows:
        ratio = torch.exp(after[i] - before[i])
        mean_ratio = ratio.mean().item() if ratio.numel() else 1.0
        clipped = bool(((ratio < 1 - a.eps_low) | (ratio > 1 + high)).any()) if ratio.numel() else False
        kl = "-"
        if ref is not None and ref[i].numel():
            d = ref[i] - after[i]
            kl = f"{(torch.exp(d) - d - 1).mean().item():.4f}"
        out.append(
            f"    {i + 1:<2d} {reward[i].item():6.3f}  {adv[i].item():9.3f}  {mean_ratio:5.3f}  "
            f"{'yes' if clipped else 'no ':7s}  {kl:6s}  {texts[i][:40]!r}"
        )
    out.append(
        f"  the step: loss {stats.loss:.4g}, grad norm {stats.grad_norm:.4g}, lr {stats.lr:.3g}; positive advantages "
        "should raise their completion's ratio above 1, negative ones lower it"
    )
    return out


def _peak_memory(device: torch.device) -> str:
    """Returns the process's peak memory (and the accelerator's, on CUDA) as text."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform != "darwin" else 1024**2)
    text = f"{rss:.0f} MiB resident"
    if device.type == "cuda":
        text += f", {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB on {device}"
    return text


def run_doctor(
    cfg: TrainConfig | Callable[[], TrainConfig], *, groups: int = 4, write: Callable[[str], None] = print
) -> int:
    """Returns the doctor's exit code (1 on a blocking problem) after printing its report; `cfg` may be the function
    that loads the config, whose refusal (a key, a type, a value the loading checks) is then reported as one."""
    try:
        loaded = cfg() if callable(cfg) else cfg
    except ConfigError as e:
        rep = Report()
        rep.say("config")
        rep.block(str(e))
    else:
        rep = rehearse(loaded, groups=groups)
    for line in rep.lines:
        write(line)
    if rep.blocking:
        write(f"{len(rep.blocking)} blocking problem(s): fix them before training")
        return 1
    verdict = f"{len(rep.warnings)} warning(s)" if rep.warnings else "no problem found"
    write(f"ready to train: {verdict}")
    return 0
