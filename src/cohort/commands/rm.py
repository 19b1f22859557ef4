"""Training reward models: pointwise (completion + 0/1 label) and pairwise (chosen / rejected, Bradley-Terry).

`cohort rm` trains an `AutoModelForSequenceClassification` with one output (a new head on any causal LM, or
an existing reward model trained further) and writes a folder that `rewards: [that folder]` scores with.
The data format is read from the columns:
- pointwise: `prompt`, `completion`, `label` (0 / 1, or a probability in [0, 1], e.g. a verifier's verdict);
  the loss is the binary cross-entropy of sigmoid(score) against the label, accuracy is (score > 0) == label;
- pairwise: `prompt`, `chosen`, `rejected`; the loss is -log sigmoid(score(chosen) - score(rejected))
  (Bradley-Terry, as InstructGPT and TRL's RewardTrainer), accuracy is score(chosen) > score(rejected).
Texts are built as a reward model scores them (`cohort.rewards.RewardModel.texts`): prompt + completion, or
the chat template for conversational rows. A run directory holds metrics.jsonl, evals.jsonl (held-out loss and
accuracy), checkpoints (model, optimizer, scheduler: resumed exactly) and report.html, like a GRPO run.

`RewardModelTrainer.fit` is the loop without a run directory; iterative GRPO calls it to retrain the reward
model on the policy's own samples.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cohort.config.schema import OptimConfig, optim_aliases
from cohort.config.validation import check_optim
from cohort.data import load_rows
from cohort.errors import ConfigError, disk_full_named
from cohort.models import check_model_source, model_not_found
from cohort.report import MetricsLogger, write_report, write_summary
from cohort.rewards.reward_models import RewardModel, load_score_model, share_pad_token
from cohort.runtime import seeds
from cohort.runtime.checkpoint_files import readable_checkpoints, save_checkpoint
from cohort.runtime.optim import make_adamw, make_scheduler
from cohort.runtime.rundir import RunLock, config_changes, trim_logs

RM_FORMATS = ("pointwise", "pairwise")

RM_NEED = (
    "a reward model needs at least one example to train on: rows with prompt/chosen/rejected (pairs) or "
    "prompt/completion/label"
)
"""What the error for reward-model data with no rows says it was for."""


@dataclass
class RMExample:
    """One training example: a prompt with a completion and its label, or a chosen and a rejected completion."""

    prompt: Any
    completion: Any = None
    label: float | None = None
    chosen: Any = None
    rejected: Any = None


def rm_examples(rows: Sequence[dict], prompt_column: str = "prompt") -> tuple[str, list[RMExample]]:
    """Returns (format, examples) read from dataset rows; the format comes from the columns (see the module)."""
    if not rows:
        raise ValueError(
            "the reward-model data is empty; give JSONL rows with prompt/chosen/rejected or prompt/completion/label"
        )
    keys = set(rows[0])
    if prompt_column not in keys:
        raise ValueError(f"the reward-model data has no {prompt_column!r} column (it has {sorted(keys)})")
    if {"chosen", "rejected"} <= keys:
        kind = "pairwise"
    elif {"completion", "label"} <= keys:
        kind = "pointwise"
    else:
        raise ValueError(
            f"cannot tell the reward-model data's format from its columns {sorted(keys)}: give 'chosen' and "
            "'rejected' (pairwise) or 'completion' and 'label' (pointwise, label 0/1)"
        )
    out = []
    for i, row in enumerate(rows):
        texts = (prompt_column, "chosen", "rejected") if kind == "pairwise" else (prompt_column, "completion")
        for key in texts:
            value = row.get(key)
            if not isinstance(value, (str, list)) or (
                isinstance(value, str) and not value.strip() and key != prompt_column
            ):
                what = "missing" if key not in row else f"{value!r}"
                raise ValueError(
                    f"reward-model data row {i}: {key!r} is {what}; every row needs a text (or a list of chat "
                    "messages) there: fix or drop that row"
                )
        if kind == "pairwise":
            out.append(RMExample(row[prompt_column], chosen=row["chosen"], rejected=row["rejected"]))
            continue
        label = row["label"]
        if isinstance(label, bool):
            label = float(label)
        if not isinstance(label, (int, float)) or not 0 <= float(label) <= 1:
            raise ValueError(f"row {i}: label {label!r} must be 0 or 1 (or a probability in [0, 1])")
        out.append(RMExample(row[prompt_column], completion=row["completion"], label=float(label)))
    return kind, out


def reward_model_loss(
    scores: torch.Tensor, kind: str, labels: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (mean loss, accuracy) of a batch: pointwise scores [B] against labels [B], or pairwise scores
    [2B] holding the chosen completions' scores then the rejected ones'."""
    if kind == "pointwise":
        if labels is None or labels.shape != scores.shape:
            raise ValueError("pointwise reward-model loss needs one label per score")
        loss = torch.nn.functional.binary_cross_entropy_with_logits(scores, labels.to(scores.dtype))
        acc = ((scores.detach() > 0).float() == (labels > 0.5).float()).float().mean()
        return loss, acc
    if kind != "pairwise":
        raise ValueError(f"unknown reward-model format {kind!r}; valid: {', '.join(RM_FORMATS)}")
    if scores.shape[0] % 2:
        raise ValueError("pairwise scores must hold the chosen half then the rejected half")
    chosen, rejected = scores.chunk(2)
    margin = chosen - rejected
    return -torch.nn.functional.logsigmoid(margin).mean(), (margin.detach() > 0).float().mean()


def load_reward_model_for_training(
    source: str | os.PathLike, *, trust_remote_code: bool = False
) -> tuple[Any, Any]:
    """Returns (model, tokenizer): a sequence-classification model with one output, from a causal LM (a new
    head) or a reward model folder, with a pad token the model knows."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except OSError as exc:  # a Hub name that is not there, or no network
        raise model_not_found(source, exc) from exc
    model = load_score_model(source, new_head=True, trust_remote_code=trust_remote_code)
    share_pad_token(model, tokenizer, os.fspath(source))
    return model, tokenizer


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Returns the example indices of optimizer step `step` (0-based): consecutive slices of a seeded
    permutation per epoch, so a resumed run draws exactly what the uninterrupted one would."""
    out: list[int] = []
    start = step * batch_size
    while len(out) < batch_size:
        epoch, pos = divmod(start + len(out), n)
        order = torch.randperm(n, generator=seeds.generator(seeds.pairs_epoch(seed, epoch))).tolist()
        take = min(batch_size - len(out), n - pos)
        out += order[pos : pos + take]
    return out


class RewardModelTrainer:
    """Fits a one-output sequence classifier to RMExamples (pointwise or pairwise) with AdamW.

    `optim`: AdamW's settings (lr, weight decay, betas, epsilon) and the gradient-norm clip; the learning-rate
    schedule, when there is one, is the caller's (it knows how many steps the run has)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        optim: OptimConfig,
        max_length: int = 1024,
        batch_size: int = 16,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.scorer = RewardModel(model, tokenizer)  # its texts() builds what the model sees when it scores
        self.optimizer = make_adamw(
            [p for p in model.parameters() if p.requires_grad],
            lr=optim.lr,
            betas=(optim.adam_beta1, optim.adam_beta2),
            eps=optim.adam_eps,
            weight_decay=optim.weight_decay,
        )
        self.max_grad_norm = optim.max_grad_norm
        self.max_length = max_length
        self.batch_size = batch_size

    def scores(self, prompts: Sequence[Any], completions: Sequence[Any]) -> torch.Tensor:
        """Returns the model's score of each prompt + completion, [B], with gradients."""
        texts = self.scorer.texts(prompts, completions)
        enc = self.tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            padding_side="right",
            truncation=True,
            max_length=self.max_length,
            add_special_tokens=False,
        )
        device = next(self.model.parameters()).device
        out = self.model(
            input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device)
        )
        return out.logits[:, 0].float()

    def _batch_loss(self, kind: str, batch: Sequence[RMExample]) -> tuple[torch.Tensor, torch.Tensor]:
        if kind == "pairwise":
            prompts = [e.prompt for e in batch] * 2
            completions = [e.chosen for e in batch] + [e.rejected for e in batch]
            return reward_model_loss(self.scores(prompts, completions), "pairwise")
        labels = torch.tensor([e.label for e in batch], dtype=torch.float32)
        s = self.scores([e.prompt for e in batch], [e.completion for e in batch])
        return reward_model_loss(s, "pointwise", labels.to(s.device))

    def train_step(self, kind: str, batch: Sequence[RMExample]) -> dict[str, float]:
        """Returns the loss, accuracy and gradient norm of one optimizer step on `batch`."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss, acc = self._batch_loss(kind, batch)
        loss.backward()
        params = [p for p in self.model.parameters() if p.requires_grad]
        gn = torch.nn.utils.clip_grad_norm_(
            params, self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        )
        if not (torch.isfinite(loss) and torch.isfinite(gn)):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"non-finite reward-model loss ({float(loss)}) or gradient; lower the lr"
            )
        self.optimizer.step()
        self.model.eval()
        return {"loss": float(loss.detach()), "accuracy": float(acc), "grad_norm": float(gn)}

    @torch.no_grad()
    def evaluate(self, kind: str, examples: Sequence[RMExample]) -> dict[str, float]:
        """Returns the mean loss and accuracy over `examples` (no gradients)."""
        self.model.eval()
        total_loss = total_acc = 0.0
        for start in range(0, len(examples), self.batch_size):
            batch = examples[start : start + self.batch_size]
            loss, acc = self._batch_loss(kind, batch)
            total_loss += float(loss) * len(batch)
            total_acc += float(acc) * len(batch)
        n = max(len(examples), 1)
        return {"loss": total_loss / n, "accuracy": total_acc / n}

    def fit(
        self,
        kind: str,
        examples: Sequence[RMExample],
        steps: int,
        *,
        seed: int = 0,
        first_step: int = 0,
        on_step: Callable[[int, dict[str, float]], None] | None = None,
    ) -> list[dict[str, float]]:
        """Returns the per-step stats of `steps` optimizer steps on batches drawn from `examples`."""
        history = []
        for step in range(first_step, first_step + steps):
            idx = batch_indices(len(examples), min(self.batch_size, len(examples)), step, seed)
            t0 = time.perf_counter()
            stats = self.train_step(kind, [examples[i] for i in idx])
            stats["step_time"] = time.perf_counter() - t0
            history.append(stats)
            if on_step is not None:
                on_step(step + 1, stats)
        return history


@optim_aliases("lr", "warmup_steps", "weight_decay", "max_grad_norm")
@dataclass
class RMConfig:
    """A reward-model training run (`cohort rm`).

    The optimizer settings are the `optim` section (an OptimConfig, as GRPO's); the older flat keywords and
    attributes `lr`, `warmup_steps`, `weight_decay` and `max_grad_norm` are aliases of its fields, and are the
    names the `cohort rm` flags, the messages and the resume check use."""

    model: str = ""
    """Causal LM (a new score head is added) or reward model folder / hub id to start from."""
    data: str = ""
    """JSONL (or `datasets` name) of pointwise or pairwise examples."""
    eval_data: str | None = None
    """Held-out examples; None holds out eval_fraction of `data`."""
    eval_fraction: float = 0.1
    """Share of `data` held out when eval_data is None."""
    out_dir: str = "runs/rm"
    """Run directory; the trained model is written to out_dir/model."""
    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 16
    """Examples (pairs) per step."""
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=10, schedule="constant", adam_beta2=0.999)
    )
    """AdamW and the schedule: lr 1e-4, 10 linear warm-up steps then constant, betas 0.9 / 0.999, no weight
    decay, the gradient norm clipped at 1."""
    max_length: int = 1024
    """Longest text in tokens (longer ones are truncated)."""
    seed: int = 0
    """Seed of the split and the example order."""
    eval_every: int = 50
    """Held-out evaluation every this many steps (and at the end)."""
    save_every: int = 100
    """Checkpoint every this many steps (and at the end); a rerun with the same out_dir resumes."""
    prompt_column: str = "prompt"
    """Column holding the prompt."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form notes saved with the run."""

    def validate(self) -> RMConfig:
        """Returns self after checking every value (raises ConfigError naming the fix)."""

        if not self.model:
            raise ConfigError("cohort rm needs --model: a causal LM or reward model folder / hub id")
        if not self.data:
            raise ConfigError(
                "cohort rm needs --data: JSONL rows with prompt/chosen/rejected or prompt/completion/label"
            )
        for name in ("steps", "batch_size", "max_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        lr = self.optim.lr
        if not (lr > 0 and math.isfinite(lr)):
            raise ConfigError(f"lr={lr} must be a positive number")  # the --lr flag's own words
        if self.eval_data is None and not 0 < self.eval_fraction < 1:
            raise ConfigError(f"eval_fraction={self.eval_fraction} must be in (0, 1) (or give eval_data)")
        check_optim(self.optim, prefix="")  # named as the flags and the aliases name them
        return self


RM_RESUMABLE = ("steps", "eval_every", "save_every", "out_dir", "extra.")
"""RMConfig fields that may change between a run and its resumption (how long, how often, not what)."""


def _flat_optim(config: dict[str, Any]) -> dict[str, Any]:
    """Returns an RM config mapping with its optimizer settings at the top level, as the flags name them.

    Older checkpoints recorded them there, and only lr, warmup_steps, weight_decay and max_grad_norm: the
    others ran at the values the current defaults hold, which fill them in."""
    rest = {k: v for k, v in config.items() if k != "optim"}
    return {**dataclasses.asdict(RMConfig().optim), **(config.get("optim") or {}), **rest}


def _check_same_run(cfg: RMConfig, saved: dict[str, Any] | None, ckpt: Path) -> None:
    """Raises ConfigError when `cfg` differs from the config checkpoint `ckpt` was trained with (beyond RM_RESUMABLE)."""
    if saved is None:  # a checkpoint from before the config was recorded: nothing to compare
        return
    changed = config_changes(_flat_optim(saved), _flat_optim(dataclasses.asdict(cfg)), resumable=RM_RESUMABLE)
    if changed:
        listing = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed)
        raise ConfigError(
            f"{cfg.out_dir} holds a reward-model run (checkpoint {ckpt}) trained with other settings ({listing}); "
            "rerunning there resumes it, so restore those values to continue it, or pass another --out to train "
            "with the new ones"
        )


def train_reward_model(cfg: RMConfig, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Returns the run's summary after training (or resuming) a reward model into cfg.out_dir."""
    cfg.validate()
    # the check `cohort eval` / `sft` / `generate` get from cohort's loaders, before any data or model loads
    # (transformers' own errors for a run or data folder talk of sentencepiece and huggingface.co)
    check_model_source(cfg.model, files=("tokenizer_config.json", "config.json"))
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out).acquire()
    try:
        rows = load_rows(cfg.data, prompt_column=cfg.prompt_column, need=RM_NEED)
        kind, examples = rm_examples(rows, cfg.prompt_column)
        if cfg.eval_data:
            need = "the reward model's held-out evaluation (--eval-data) needs at least one example to score"
            eval_rows = load_rows(cfg.eval_data, prompt_column=cfg.prompt_column, need=need)
            eval_kind, held = rm_examples(eval_rows, cfg.prompt_column)
            if eval_kind != kind:
                raise ValueError(f"the training data is {kind} but eval_data is {eval_kind}; use one format")
            train = examples
        else:
            order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
            n_held = max(1, round(cfg.eval_fraction * len(examples)))
            held = [examples[i] for i in order[:n_held]]
            train = [examples[i] for i in order[n_held:]]
        if not train:
            raise ValueError(
                f"no training examples left after holding out {len(held)}; add data or lower eval_fraction"
            )
        start, ckpt = 0, None
        found = readable_checkpoints(out)
        if found:
            ckpt, state = found[0]
            _check_same_run(cfg, state.get("extra", {}).get("config"), ckpt)
            start = int(state["step"])
            trim_logs(out, start)
        torch.manual_seed(cfg.seed)  # the new score head's initial weights
        model, tokenizer = load_reward_model_for_training(ckpt or cfg.model)
        trainer = RewardModelTrainer(
            model, tokenizer, optim=cfg.optim, max_length=cfg.max_length, batch_size=cfg.batch_size
        )
        scheduler = make_scheduler(trainer.optimizer, cfg.optim.schedule, cfg.optim.warmup_steps, cfg.steps)
        if ckpt is not None:
            trainer.optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            log(f"resuming the reward model from {ckpt} (step {start})")
        logger = MetricsLogger(out)
        log(
            f"reward model ({kind}): {len(train)} training and {len(held)} held-out examples, {cfg.steps} steps"
        )
        if start == 0:
            before = trainer.evaluate(kind, held)
            logger.log_eval(0, before)
            log(f"step 0: held-out accuracy {before['accuracy']:.3f}, loss {before['loss']:.4f}")
        t0 = time.perf_counter()

        def on_step(step: int, stats: dict[str, float]) -> None:
            scheduler.step()
            logger.log({"step": step, **stats, "lr": trainer.optimizer.param_groups[0]["lr"]})
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                ev = trainer.evaluate(kind, held)
                logger.log_eval(step, ev)
                log(f"step {step}: held-out accuracy {ev['accuracy']:.3f}, loss {ev['loss']:.4f}")
            if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
                save_checkpoint(
                    out,
                    step,
                    model=model,
                    tokenizer=tokenizer,
                    optimizer=trainer.optimizer,
                    scheduler=scheduler,
                    extra={"kind": kind, "config": dataclasses.asdict(cfg)},
                )

        trainer.fit(kind, train, cfg.steps - start, seed=cfg.seed, first_step=start, on_step=on_step)
        logger.close()
        final = out / "model"
        fix = "free some space there and run again with resume=auto: the last checkpoint is intact"
        with disk_full_named(final, "the reward model", fix):
            model.save_pretrained(final)
            tokenizer.save_pretrained(final)
        last = trainer.evaluate(kind, held)
        summary = {
            "format": kind,
            "steps": cfg.steps,
            "train_examples": len(train),
            "held_out_examples": len(held),
            "accuracy_after": last["accuracy"],
            "loss_after": last["loss"],
            "seconds_train": round(time.perf_counter() - t0, 1),
            "model": str(final),
        }
        write_summary(out, summary)
        write_report(out, title=f"cohort reward model: {out.name}")
        log(
            f"saved the reward model to {final} (held-out accuracy {last['accuracy']:.3f}); report: {out / 'report.html'}"
        )
        return summary
    finally:
        lock.release()
