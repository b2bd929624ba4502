"""Measured re-ranking: run the best predicted strategies for a few real steps and let the clock decide.

The cost model ranks thousands of strategies in milliseconds but is only a model; a few real steps of
the top candidates, on the user's model and data, settle what it cannot see (allocator stalls, DTensor
dispatch, a slow link). `rerank(result, measurements)` takes what was measured (seconds per step, or
the reason a candidate could not run: out of memory, an error) and returns:

- the search result re-ordered: the measured candidates first, fastest measured first (a candidate
  that failed is dropped, with its reason), then the unmeasured rest in predicted order;
- the device profile with its `step_time_scale` refitted: the median measured / predicted ratio of the
  candidates that ran, folded into the old factor (weighted by the steps behind each), so the next
  prediction on this device starts from what it measured. The profile is saved when asked.

Who measures is the caller's business (autotune imports no model code): `search(..., measure=fn)`
calls `fn(strategy) -> seconds` on the top candidates in this process; distcore's
`to_distributed(config=ToDistributedConfig(measure=True))` measures on every rank of the job.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from dataclasses import dataclass
from typing import Callable, Mapping

from .hardware import DeviceProfile, save_profile
from .strategy import Strategy

__all__ = ["Measurement", "MeasuredRanking", "rerank", "measure_top", "candidates_to_measure", "MEASURE_PICKS"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Measurement:
    """One candidate: predicted and measured seconds per step (None when it could not run: `failure`)."""

    strategy: Strategy
    predicted_s: float
    measured_s: float | None
    failure: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.measured_s is None else self.measured_s / self.predicted_s


@dataclass(frozen=True)
class MeasuredRanking:
    """`result`: the search result re-ranked (its `best` is the measured fastest); `measurements` in
    measured order (failures last); `profile`: the device profile with the refitted factor."""

    result: object  # SearchResult
    measurements: tuple[Measurement, ...]
    profile: DeviceProfile

    @property
    def best(self) -> Measurement | None:
        return next((m for m in self.measurements if m.measured_s is not None), None)


MEASURE_PICKS = ("top", "layouts")


def candidates_to_measure(result, top_k: int, pick: str = "top") -> list:
    """Which candidates of `result` (a SearchResult) a measured search runs.

    "top": the `top_k` best predicted (to choose the fastest: the usual case). "layouts": the best
    predicted strategy of each (dp, tp, pp) layout, fastest layouts first, `top_k` of them: a spread of
    strategies, to judge the cost model's ordering (the strategy benchmark's rank correlation) rather
    than the near-ties at the top.
    """
    if pick not in MEASURE_PICKS:
        raise ValueError(f"measure pick {pick!r} is not one of {', '.join(MEASURE_PICKS)}")
    if pick == "top":
        return list(result.ranked[:top_k])
    bests = sorted((layout.best for layout in result.layouts if layout.best), key=lambda c: c.sort_key())
    return bests[:top_k]


def measure_top(result, measure: Callable[[Strategy], float], *, top_k: int = 3,
                pick: str = "top") -> dict[Strategy, float | str]:
    """Call `measure(strategy)` on the candidates `candidates_to_measure` picks; an exception is that
    candidate's failure (its message), not the search's."""
    measured: dict[Strategy, float | str] = {}
    for candidate in candidates_to_measure(result, top_k, pick):
        try:
            measured[candidate.strategy] = float(measure(candidate.strategy))
        except Exception as error:  # noqa: BLE001 - out of memory, a shape error: the candidate is dropped
            measured[candidate.strategy] = f"{type(error).__name__}: {error}"
    return measured


def rerank(result, measured: Mapping[Strategy, float | str], *, save: bool = False) -> MeasuredRanking:
    """Re-rank `result` (a SearchResult) by `measured` (seconds per step, or a failure's reason per
    strategy) and refit its device's step-time factor (saved as `<name>-measured` when `save`)."""
    by_strategy = {c.strategy: c for c in [*(layout.best for layout in result.layouts if layout.best), *result.ranked]}
    unknown = [s.describe() for s in measured if s not in by_strategy]
    if unknown:
        raise ValueError(f"rerank: measured strategies {unknown} are not among the search's ranked candidates")
    measurements = []
    for strategy, value in measured.items():
        predicted = by_strategy[strategy].step_time_s
        if isinstance(value, str):
            log.warning("measured search: %s dropped: %s", strategy.describe(), value)
            measurements.append(Measurement(strategy, predicted, None, value))
        elif not value > 0:
            raise ValueError(f"rerank: {strategy.describe()} measured {value!r} s per step; expected a positive time")
        else:
            measurements.append(Measurement(strategy, predicted, float(value)))
    ran = sorted((m for m in measurements if m.measured_s is not None), key=lambda m: m.measured_s)
    failed = [m for m in measurements if m.measured_s is None]
    profile = _refit(result.cluster.profile, ran)
    if save and ran:
        path = save_profile(profile)
        log.info("measured search: step-time factor %.3g saved with %s (%s)", profile.step_time_scale, profile.name, path)
    order = [by_strategy[m.strategy] for m in ran]
    rest = [c for c in result.ranked if c.strategy not in measured]
    ranked = order + rest
    best = ranked[0] if order else None
    message = result.message if order else (
        "no measured candidate ran: " + "; ".join(f"{m.strategy.describe()}: {m.failure}" for m in failed))
    reranked = dataclasses.replace(result, best=best, ranked=ranked, message=message)
    return MeasuredRanking(reranked, tuple(ran + failed), profile)


def _refit(profile: DeviceProfile, ran: list[Measurement]) -> DeviceProfile:
    """The profile with `step_time_scale` refitted: the predictions already include the old factor, so
    the median ratio of this run corrects it; earlier runs keep their weight (steps counted)."""
    if not ran:
        return profile
    correction = statistics.median(m.ratio for m in ran)
    old, count = profile.step_time_scale, profile.measured_steps
    new_scale = old * correction
    if count:  # a weighted geometric blend of the factor before and after this run
        new_scale = (old**count * new_scale ** len(ran)) ** (1.0 / (count + len(ran)))
    name = profile.name if profile.name.endswith("-measured") else f"{profile.name}-measured"
    return dataclasses.replace(profile, name=name, step_time_scale=new_scale, measured_steps=count + len(ran))
