"""What may change between a run and its resumption (cohort.runtime.rundir.config_changes)."""

from cohort.runtime.rundir import config_changes


def _cfg(batch, total=None, lr=1e-6):
    return {
        "rollout": {"batch_size": batch},
        "distributed": {"global_batch_size": total},
        "optim": {"lr": lr},
    }


def test_a_global_batch_resumed_on_another_process_count_is_the_same_run():
    # 2 processes x 8 = 16, resumed on 1 process: the derived per-process batch is 16.
    assert config_changes(_cfg(8, 16), _cfg(16, 16)) == []
    # Without a global batch the per-process batch is the user's choice, and a change is one.
    assert config_changes(_cfg(8), _cfg(16)) == [("rollout.batch_size", 8, 16)]
    # A different global batch is a different run; other keys still count.
    assert ("distributed.global_batch_size", 16, 32) in config_changes(_cfg(8, 16), _cfg(16, 32))
    assert config_changes(_cfg(8, 16), _cfg(16, 16, lr=1e-5)) == [("optim.lr", 1e-6, 1e-5)]
