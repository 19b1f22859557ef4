"""`TrainConfig`: a run's settings (the fields of :class:`cohort.config.schema.TrainFields`) with the one call that
derives and checks them for the environment the run starts in.

The schema, the derivation and the checks each import only the schema; this module alone ties them together, so
the config's modules form no import cycle (type-only imports counted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cohort.config.derive import RunEnvironment, derive
from cohort.config.schema import TrainFields
from cohort.config.validation import validate_config

__all__ = ["TrainConfig"]


@dataclass
class TrainConfig(TrainFields):
    """A whole GRPO run: every section of the config tree and the run-wide fields (TrainFields), and `validate`."""

    def validate(
        self,
        *,
        need_model: bool = True,
        need_data: bool = True,
        reward_funcs: Sequence[str | Callable] | None = None,
        environment: RunEnvironment | None = None,
        environment_rewards: bool = False,
    ) -> TrainConfig:
        """Return self, derived for the run's environment and then checked: every value that can be checked
        before a model is loaded.

        Three explicit steps: the environment (`environment`, else this process's:
        :meth:`RunEnvironment.detect` reads torchrun's WORLD_SIZE and whether CUDA is visible), then
        :func:`cohort.config.derive.derive` sets the fields that follow from others (in place), then
        :func:`cohort.config.validation.validate_config` checks the result and changes nothing.
        `reward_funcs`: the reward functions the run uses instead of `rewards` (GRPOTrainer's argument of
        that name); `reward_weights` must then give one weight per one of them. `environment_rewards`: an
        environment factory given outside the config may own the reward (`rewards` may be empty).
        Nothing is imported or registered: a loss or estimator given as user code is checked for its form
        here and imported by :func:`cohort.runtime.plugins.check_user_objective`.
        """
        env = RunEnvironment.detect() if environment is None else environment
        validate_config(
            derive(self, world_size=env.world_size),
            world_size=env.world_size,
            cuda_available=env.cuda_available,
            need_model=need_model,
            need_data=need_data,
            reward_funcs=reward_funcs,
            stacklevel=3,
            environment_rewards=environment_rewards,
        )
        return self
