"""Measured re-ranking (autotune/measured.py) in one process, with an injected clock: the measured
fastest wins, a candidate that fails is dropped with its reason, the device's step-time factor is
refitted from the measured / predicted ratios and saved with the profile; the distributed path (every
rank measuring the user's model) is tests/distributed/measured_worker.py."""

from __future__ import annotations

import pytest

from tridist.autotune import Cluster, get_profile, preset, search
from tridist.autotune.measured import rerank

SPEC, CLUSTER, BATCH = preset("llama2-7b"), Cluster(1, 8), 16


@pytest.fixture(scope="module")
def predicted():
    return search(SPEC, CLUSTER, global_batch_size=BATCH, storage=None)


def test_measured_fastest_wins_and_failures_are_dropped(predicted):
    first, second, third = (c.strategy for c in predicted.ranked[:3])
    times = {first: 3.0, third: 1.5}  # the predicted best measures slowest; the third fastest

    def measure(strategy):
        if strategy == second:
            raise MemoryError("CUDA out of memory (planted)")
        return times[strategy]

    result = search(SPEC, CLUSTER, global_batch_size=BATCH, storage=None, measure=measure, measure_top_k=3)
    assert result.best.strategy == third and result.ranked[:2] == [predicted.ranked[2], predicted.ranked[0]]
    assert second not in [c.strategy for c in result.ranked]
    ran, failed = result.measured.measurements[:2], result.measured.measurements[2]
    assert [m.measured_s for m in ran] == [1.5, 3.0]
    assert failed.measured_s is None and "out of memory" in failed.failure
    # The factor: the median of measured / predicted over the candidates that ran.
    ratios = sorted(times[c.strategy] / c.step_time_s for c in (predicted.ranked[0], predicted.ranked[2]))
    assert result.measured.profile.step_time_scale == pytest.approx(sum(ratios) / 2, rel=1e-12)
    assert "as measured over 2 candidate runs" in result.measured.profile.basis


def test_refitted_profile_is_saved_and_predicts_the_measured_time(predicted, tmp_path, monkeypatch):
    """Saved as <name>-measured; a search on it predicts what was measured (the same factor on every term)."""
    monkeypatch.setenv("TRIDIST_CACHE_DIR", str(tmp_path))
    best = predicted.ranked[0]
    rerank(predicted, {best.strategy: 2.5 * best.step_time_s}, save=True)
    assert (tmp_path / "device-profiles" / "h100-sxm-measured.json").is_file()
    profile = get_profile("h100-sxm-measured")
    assert profile.step_time_scale == pytest.approx(2.5) and profile.measured_steps == 1
    again = search(SPEC, Cluster(1, 8, profile), global_batch_size=BATCH, storage=None)
    assert again.best.step_time_s == pytest.approx(2.5 * best.step_time_s, rel=1e-9)
    # A second run on the refitted profile folds in with the weight of the steps behind each factor.
    second = rerank(again, {again.best.strategy: again.best.step_time_s * 2.0})
    assert second.profile.step_time_scale == pytest.approx((2.5 * 5.0) ** 0.5) and second.profile.measured_steps == 2


def test_nothing_ran_and_bad_input(predicted):
    top = predicted.ranked[0].strategy
    ranking = rerank(predicted, {top: "RuntimeError: planted"})
    assert ranking.result.best is None and "planted" in ranking.result.message and ranking.best is None
    with pytest.raises(ValueError, match="positive time"):
        rerank(predicted, {top: 0.0})
    with pytest.raises(TypeError, match="ToDistributedConfig\\(measure=True\\)"):
        search(SPEC, CLUSTER, global_batch_size=BATCH, storage=None, measure=True)


def test_layouts_pick_measures_a_spread_for_the_strategy_benchmark(predicted):
    """measure_pick="layouts": the best predicted strategy of each dp x tp x pp layout, fastest layouts
    first (the top predicted candidates are often one layout's micro-batch variants)."""
    seen = []

    def clock(strategy):
        return 1.0 + (strategy.tp + strategy.pp) / 10  # the clock prefers little tp/pp

    def measure(strategy):
        seen.append(strategy)
        return clock(strategy)

    result = search(SPEC, CLUSTER, global_batch_size=BATCH, storage=None, measure=measure, measure_top_k=4,
                    measure_pick="layouts")
    layouts = [(s.dp, s.tp, s.pp) for s in seen]
    assert len(seen) == 4 and len(set(layouts)) == 4
    bests = sorted((l.best for l in predicted.layouts if l.best), key=lambda c: c.sort_key())[:4]
    assert seen == [c.strategy for c in bests]
    assert result.best.strategy == min(seen, key=clock)
    assert [m.measured_s for m in result.measured.measurements] == sorted(clock(s) for s in seen)
    with pytest.raises(ValueError, match="measure_pick"):
        search(SPEC, CLUSTER, global_batch_size=BATCH, storage=None, measure=measure, measure_pick="all")


def test_to_distributed_config_refuses_an_unknown_pick():
    from tridist.distcore import ToDistributedConfig

    with pytest.raises(ValueError, match="measure_pick must be 'top'"):
        ToDistributedConfig(measure=True, measure_pick="every")
