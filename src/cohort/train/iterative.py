"""Iterative GRPO (DeepSeekMath section 4.2, seed 000): keep a learned reward model from going stale.

Every `iterative.every` steps:
1. the reference is reset to the current policy (when the run has one, beta > 0);
2. `iterative.prompts` training prompts are sampled afresh from the current policy (G completions each, on a
   stream of their own so the training trajectory does not depend on it) and labelled by a verifier reward
   (`iterative.labeler`, e.g. `accuracy`: a completion is correct when it scores >= `label_threshold`);
3. every (correct, incorrect) pair of completions of one prompt becomes a Bradley-Terry example (at most
   `max_pairs_per_prompt` per prompt), the reward model's pairwise accuracy on them is measured, it is trained
   `rm_steps` steps on them mixed with a replay share (`replay`, 10 % by default) of the pairs of earlier
   iterations and of `initial_data` (its original training pairs), and its accuracy is measured again.
The reward model is the run's reward function that is a `RewardModel` (named by `iterative.reward` when
there are several); it is trained in place, so the next step already scores with it. Its weights, its
optimizer, the replay buffer and the reference all go into checkpoints: a resumed run continues exactly.
"""

from __future__ import annotations

import random
from typing import Any

from cohort.commands.rm import RewardModelTrainer, RMExample, rm_examples
from cohort.data import load_rows


class IterativeRM:
    """The reward model being retrained, its optimizer and its replay buffer."""

    def __init__(self, reward_model: Any, cfg: Any, initial: list[RMExample] | None = None):
        self.reward_model = reward_model
        self.cfg = cfg
        self.trainer = RewardModelTrainer(
            reward_model.model, reward_model.tokenizer, optim=cfg.optim, batch_size=cfg.rm_batch_size
        )
        self.buffer: list[RMExample] = list(initial or [])
        self.iterations = 0

    def pairs(
        self, prompts: list[Any], completions: list[Any], labels: list[bool], group_size: int
    ) -> list[RMExample]:
        """Returns the (correct, incorrect) pairs of each group, at most max_pairs_per_prompt per prompt."""
        out = []
        for g in range(0, len(completions), group_size):
            good = [completions[i] for i in range(g, g + group_size) if labels[i]]
            bad = [completions[i] for i in range(g, g + group_size) if not labels[i]]
            made = [RMExample(prompts[g], chosen=c, rejected=r) for c in good for r in bad]
            out += made[: self.cfg.max_pairs_per_prompt]
        return out

    def retrain(self, fresh: list[RMExample], seed: int) -> dict[str, float]:
        """Returns the iteration's metrics after training on `fresh` pairs plus a replay share of earlier ones."""
        out = {"iterative/fresh_pairs": float(len(fresh))}
        if not fresh:  # no group had both a right and a wrong completion: nothing new to learn, no retraining
            out["iterative/retrainings"] = float(self.iterations)
            return out
        before = self.trainer.evaluate("pairwise", fresh)["accuracy"]
        share = self.cfg.replay
        n_replay = min(len(self.buffer), round(share / (1 - share) * len(fresh))) if share > 0 else 0
        replay = random.Random(seed).sample(self.buffer, n_replay) if n_replay else []
        self.trainer.fit("pairwise", fresh + replay, self.cfg.rm_steps, seed=seed)
        after = self.trainer.evaluate("pairwise", fresh)["accuracy"]
        self.buffer += fresh
        self.iterations += 1
        out.update(
            {
                "iterative/rm_accuracy_before": before,
                "iterative/rm_accuracy_after": after,
                "iterative/replay_pairs": float(n_replay),
                "iterative/retrainings": float(self.iterations),
            }
        )
        return out

    def state_dict(self) -> dict[str, Any]:
        """Returns what a checkpoint needs: the reward model's weights and optimizer, the buffer, the count."""
        return {
            "weights": {k: v.detach().cpu().clone() for k, v in self.trainer.model.state_dict().items()},
            "optimizer": self.trainer.optimizer.state_dict(),
            "buffer": [vars(e) for e in self.buffer],
            "iterations": self.iterations,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a state_dict."""
        self.trainer.model.load_state_dict(state["weights"])
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.buffer = [RMExample(**e) for e in state["buffer"]]
        self.iterations = int(state["iterations"])


def load_initial_pairs(path: str | None) -> list[RMExample]:
    """Returns the reward model's earlier training pairs from a pairwise JSONL / dataset (none without a path)."""
    if not path:
        return []
    kind, examples = rm_examples(load_rows(path))
    if kind != "pairwise":
        raise ValueError(
            f"iterative.initial_data {path!r} is {kind}; it must hold prompt/chosen/rejected pairs"
        )
    return examples
