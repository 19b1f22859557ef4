"""cohort.train.state: the registry of stateful parts, alone and as the trainer fills it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cohort.config import load_config
from cohort.train import StateRegistry
from cohort.trainer import GRPOTrainer

DIGITS = str(Path(__file__).parent.parent / "digit_reward.py") + ":digit_fraction"


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_parts_split_into_shared_per_process_and_files():
    shared, mine, big = Counter(), Counter(), Counter()
    reg = StateRegistry()
    reg.register("shared", shared)
    reg.register("mine", mine, per_process=True, rewinds=True)
    reg.register("big", big, file="big.pt")
    shared.n, mine.n, big.n = 1, 2, 3
    assert reg.state_dict() == {"shared": {"n": 1}, "mine": {"n": 2}}
    assert reg.state_dict(per_process=False) == {"shared": {"n": 1}}
    assert reg.state_dict(per_process=True) == {"mine": {"n": 2}}
    assert reg.files() == {"big.pt": {"n": 3}} and reg.file_names() == ["big.pt"]
    saved, files = reg.state_dict(), reg.files()
    shared.n = mine.n = big.n = 0
    assert reg.load_state_dict(saved) == []
    reg.load_files(files.get)
    assert (shared.n, mine.n, big.n) == (1, 2, 3)


def test_a_part_the_checkpoint_lacks_keeps_its_fresh_state():
    a, b = Counter(), Counter()
    reg = StateRegistry()
    reg.register("a", a)
    reg.register("b", b)
    b.n = 5
    assert reg.load_state_dict({"a": {"n": 4}}) == ["b"]
    assert (a.n, b.n) == (4, 5)
    reg.load_files(lambda name: None)  # no file parts: nothing asked


def test_snapshot_and_rewind_touch_only_parts_that_rewind():
    kept, rewound = Counter(), Counter()
    reg = StateRegistry()
    reg.register("kept", kept)
    reg.register("rewound", read=lambda: rewound.n, restore=lambda n: setattr(rewound, "n", n), rewinds=True)
    snap = reg.snapshot()
    kept.n = rewound.n = 9
    reg.rewind(snap)
    assert (kept.n, rewound.n) == (9, 0)


def test_a_costly_part_rewinds_through_its_marks():
    # read() of such a part waits for work in flight (a checkpoint needs it); snapshots must not call it
    reads, queue = [], [1, 2]
    reg = StateRegistry()
    reg.register(
        "queue",
        read=lambda: reads.append(1) or list(queue),
        restore=lambda s: queue.__init__(s),
        rewinds=True,
        mark=lambda: ("mark", list(queue)),
        back=lambda m: queue.__init__(m[1]),
    )
    snap = reg.snapshot()
    queue.append(3)
    reg.rewind(snap)
    assert queue == [1, 2] and not reads
    assert reg.state_dict() == {"queue": [1, 2]} and reads
    with pytest.raises(ValueError, match="mark and back come together"):
        reg.register("half", Counter(), rewinds=True, mark=lambda: None)
    with pytest.raises(ValueError, match="mark and back come together"):
        reg.register("still", Counter(), mark=lambda: None, back=lambda m: None)


def test_bad_registrations_are_refused():
    reg = StateRegistry()
    reg.register("x", Counter())
    with pytest.raises(ValueError, match="already registered"):
        reg.register("x", Counter())
    with pytest.raises(ValueError, match="state_dict/load_state_dict, or read and restore"):
        reg.register("y", read=lambda: 1)
    with pytest.raises(ValueError, match="its own file"):
        reg.register("z", Counter(), file="z.pt", per_process=True)


def _trainer(model_dir, out, **over) -> GRPOTrainer:
    base: dict = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"task": "addition", "n_train": 16, "n_eval": 4},
        "rollout": {"group_size": 2, "batch_size": 4, "max_completion_length": 3},
        "rewards": [DIGITS],
        "steps": 2,
        "out_dir": str(out),
        "progress": False,
        "eval_at_ends": False,
        "save_every": 0,
        **over,
    }
    return GRPOTrainer(load_config(None, base))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_every_part_of_a_trainer_round_trips(tiny_model_dir, tmp_path):
    """A trained run's parts restored into a fresh trainer read back the same; the optional parts register
    only when their feature is on."""
    over = {"curriculum": {"enabled": True}, "algo": {"entropy_coef": 0.01, "adaptive_entropy": True}}
    trained = _trainer(tiny_model_dir, tmp_path / "a", **over)
    trained.step()
    trained.step()
    assert trained.parts.names() == [
        "rng", "sampler", "curriculum", "shuffle_rng", "num_tokens", "health", "trainer_state", "entropy",
    ]  # fmt: skip
    saved = trained.parts.state_dict()
    fresh = _trainer(tiny_model_dir, tmp_path / "b", **over)
    assert not _same(fresh.parts.state_dict()["sampler"], saved["sampler"])
    assert fresh.parts.load_state_dict(saved) == []
    assert _same(fresh.parts.state_dict(), saved)
    plain = _trainer(tiny_model_dir, tmp_path / "c")
    assert "curriculum" not in plain.parts.names() and "entropy" not in plain.parts.names()
