"""A user loss and advantage estimator named by path in tests/test_imports.py (validation must not import it)."""


def my_loss(inputs, **kwargs):
    """Returns the per-token clip-free policy-gradient loss -A * ratio."""
    return -inputs.advantages * inputs.ratio


def my_advantages(rewards, group_size, **kwargs):
    """Returns each reward minus its group's mean."""
    grouped = rewards.view(-1, group_size)
    return (grouped - grouped.mean(-1, keepdim=True)).view(-1)
