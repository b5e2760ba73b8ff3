"""The sampler: which of diffusers' schedulers denoises, and over which timesteps from T.

Clients noise to the schedule's first timestep T (paper eq. 3) and the server continues from
exactly there, so both sides build the same :class:`Sampler` from the run config's
``synthesis.scheduler``, ``synthesis.num-inference-steps`` and ``synthesis.timestep-spacing``.
Every scheduler is built by diffusers from the model's own noise schedule (``from_config``) with
the spacing named here, never a scheduler's own default (the multistep solvers default to
"linspace", which SD v1-4's config, predating the key, would silently get).

The spacing decides T, and T decides how much noise hides each private image:
- ``leading`` (SD v1-x's, the paper's): T = 961 of 1000 at 25 steps for PNDM and DDIM, 951 for
  DPM-Solver++ and UniPC (their grid spreads n + 1 intervals); fewer steps lower T (801 at 5
  steps), so z(T) keeps more of the image: fewer steps would cost privacy.
- ``trailing``: T = 999 at every step count, the same grid for all four samplers: steps and
  sampler change speed and fidelity, never the noise level (abar_999 = 0.0047 against 0.0073
  at 961).
The payload records the scheduler and T; the server refuses an upload noised for another.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:  # diffusers loads in seconds; run configs are validated without it
    from diffusers import SchedulerMixin


TimestepSpacing = Literal["leading", "trailing"]


class SchedulerName(StrEnum):
    """Run config ``synthesis.scheduler``: the samplers a run can choose."""

    PNDM = "pndm"
    DDIM = "ddim"
    DPM_SOLVER = "dpm-solver++"
    UNIPC = "unipc"


# diffusers class and the settings that make it the named sampler. PNDM without its
# Runge-Kutta warm-up (skip_prk_steps) is PLMS, what Stable Diffusion ships with. DDIM clips its
# x0 prediction to [-1, 1] by default, a pixel-space setting that would cut latents short.
_SCHEDULERS: dict[SchedulerName, tuple[str, dict[str, Any]]] = {
    SchedulerName.PNDM: ("PNDMScheduler", {"skip_prk_steps": True}),
    SchedulerName.DDIM: ("DDIMScheduler", {"clip_sample": False}),
    SchedulerName.DPM_SOLVER: ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"}),
    SchedulerName.UNIPC: ("UniPCMultistepScheduler", {}),
}


@dataclass(frozen=True)
class Sampler:
    """A configured scheduler and step count. ``scheduler`` is never stepped itself: every
    denoising run gets its own copy from :meth:`start` (multistep solvers keep state)."""

    scheduler: SchedulerMixin
    num_inference_steps: int

    @classmethod
    def create(
        cls,
        name: SchedulerName | str,
        noise_schedule: SchedulerMixin,
        steps: int,
        spacing: TimestepSpacing = "leading",
    ) -> Sampler:
        """The named sampler over ``noise_schedule``'s betas and prediction type."""
        import diffusers

        class_name, settings = _SCHEDULERS[SchedulerName(name)]
        scheduler_class = getattr(diffusers, class_name)
        scheduler = scheduler_class.from_config(
            noise_schedule.config, timestep_spacing=spacing, **settings
        )
        return cls(scheduler, steps)

    @property
    def name(self) -> str:
        """What the payload records and the server compares (the diffusers class name)."""
        return type(self.scheduler).__name__

    def grid(self) -> torch.Tensor:
        """The schedule's distinct timesteps, descending."""
        return _distinct(self._fresh().timesteps)

    def _fresh(self) -> SchedulerMixin:
        """A copy of the scheduler with this step count's timesteps set, ready to step."""
        scheduler = copy.deepcopy(self.scheduler)
        with warnings.catch_warnings():
            # diffusers' UniPC calls np.array() on a torch tensor, which numpy 2 warns about
            # (torch's __array__ takes no copy keyword); the values are the same either way
            warnings.filterwarnings(
                "ignore",
                r"__array__ implementation doesn't accept a copy keyword",
                DeprecationWarning,
            )
            scheduler.set_timesteps(self.num_inference_steps)
        return scheduler

    def first_timestep(self, requested: int = 0) -> int:
        """T: the schedule's first timestep (paper default, ``requested=0``), else the latest
        timestep <= ``requested`` (an earlier T keeps more of the image: a privacy dial)."""
        grid = self.grid()
        if requested == 0:
            return int(grid[0])
        eligible = grid[grid <= requested]
        if len(eligible) == 0:
            raise ValueError(
                f"synthesis.start-timestep {requested} is below the schedule's last timestep "
                f"{int(grid[-1])}"
            )
        return int(eligible[0])

    def start(self, timestep: int) -> tuple[SchedulerMixin, torch.Tensor]:
        """A fresh scheduler positioned at T and the timesteps to step through from there."""
        scheduler = self._fresh()
        grid = _distinct(scheduler.timesteps)
        if timestep not in grid.tolist():
            raise ValueError(
                f"T={timestep} is not a timestep of the {self.num_inference_steps}-step "
                f"{self.name} schedule"
            )
        if self.name == _SCHEDULERS[SchedulerName.PNDM][0]:
            scheduler.timesteps = plms_timesteps(grid, timestep)
            return scheduler, scheduler.timesteps
        begin = int((scheduler.timesteps == timestep).nonzero()[0])
        if hasattr(scheduler, "set_begin_index"):  # multistep solvers index their sigmas
            scheduler.set_begin_index(begin)
        return scheduler, scheduler.timesteps[begin:]


def _distinct(timesteps: torch.Tensor) -> torch.Tensor:
    return torch.unique(timesteps).flip(0)


def plms_timesteps(grid: torch.Tensor, timestep: int) -> torch.Tensor:
    """PNDM's timesteps from T down, with its warm-up repeat of the second one.

    ``set_timesteps`` yields [981, 961, 961, 941, ...]: the repeated 961 is PNDM's second-order
    warm-up step, kept in its step counter. Starting at an earlier T rebuilds that pattern from
    T instead of slicing it off.
    """
    tail = grid[grid <= timestep]
    if len(tail) < 2:
        return tail
    return torch.cat([tail[:2], tail[1:]])
