"""The cost model's pipeline bubble against a simulation of the order torch's schedules run their stages in.

`_simulate` runs each pipeline rank's forwards and backwards in its schedule's order, each as soon as its rank is
free and its input is there (a stage's forward after the previous stage's forward of that micro-batch, its backward
after the next stage's backward), with no communication time: the step is the last one's end. The orders are
torch's: Schedule1F1B's (`_step_microbatches`: min(m, p - r) warm-up forwards on rank r, then a backward and a
forward in turn), GPipe's and ScheduleInterleaved1F1B's (their own `pipeline_order` code, called here on a stand-in
object: a change in torch's order shows here). Stage times are whole numbers, so every sum below is exact.
"""

from __future__ import annotations

import random
import types
from dataclasses import replace

import pytest
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from tridist.autotune import Cluster, Strategy, balanced_stage_layers, estimate, preset, stage_layers
from tridist.autotune import cost

FORWARD, BACKWARD = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD


def _order(schedule: str, pp: int, virtual_pp: int, m: int) -> dict[int, list[_Action]]:
    """Each rank's forwards and backwards in the order `schedule` runs them (stage s on rank s % pp)."""
    if schedule == "1F1B":
        order = {}
        for rank in range(pp):
            warm_up = min(m, pp - rank)
            actions, forwards = [_Action(rank, FORWARD, j) for j in range(warm_up)], warm_up
            for j in range(m):
                actions.append(_Action(rank, BACKWARD, j))
                if forwards < m:
                    actions.append(_Action(rank, FORWARD, forwards))
                    forwards += 1
            order[rank] = actions
        return order
    if schedule == "GPipe":
        order = schedules.ScheduleGPipe._get_pipeline_order(types.SimpleNamespace(_num_stages=pp, _n_microbatches=m))
    else:
        rounds = max(1, m // pp)
        this = types.SimpleNamespace(n_local_stages=virtual_pp, pp_group_size=pp, _n_microbatches=m,
                                     number_of_rounds=rounds, microbatches_per_round=m // rounds)
        order = {r: schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(this, r) for r in range(pp)}
    return {rank: [a for a in actions if a is not None and a.computation_type in (FORWARD, BACKWARD)]
            for rank, actions in order.items()}


def _simulate(schedule: str, forward: list[int], backward: list[int], pp: int, virtual_pp: int, m: int) -> int:
    """The step's time: `forward[s]`, `backward[s]` stage s's time for one micro-batch."""
    order, stages = _order(schedule, pp, virtual_pp, m), pp * virtual_pp
    done: dict[tuple, int] = {}
    free, next_action = [0] * pp, [0] * pp
    moved = True
    while moved:
        moved = False
        for rank in range(pp):
            while next_action[rank] < len(order[rank]):
                action = order[rank][next_action[rank]]
                s, j = action.stage_index, action.microbatch_index
                if action.computation_type == FORWARD:
                    key, after, time = ("F", s, j), [("F", s - 1, j)] if s else [], forward[s]
                else:
                    key, after, time = ("B", s, j), [("B", s + 1, j) if s < stages - 1 else ("F", s, j)], backward[s]
                if any(a not in done for a in after):
                    break
                done[key] = free[rank] = max([free[rank], *(done[a] for a in after)]) + time
                next_action[rank] += 1
                moved = True
    assert next_action == [len(order[rank]) for rank in range(pp)], "the schedule deadlocked"
    assert len(done) == 2 * stages * m
    return max(done.values())


def _priced(forward, backward, pp, virtual_pp, m) -> float:
    """The cost model's step: m micro-batches at the slowest rank's pace plus its bubble."""
    ranks = [sum(forward[c * pp + r] + backward[c * pp + r] for c in range(virtual_pp)) for r in range(pp)]
    return m * max(ranks) + cost._bubble(pp, virtual_pp, max(ranks), sum(ranks))


def _layouts():
    """Stage times of the layouts the search offers (stage_layers' even one, balanced_layout's), a layer's forward
    3 and backward 6, the LM head + loss weighing `head` layers on the last stage: Llama 3 8B (~2), Llama 3 70B
    (~0.5), Gemma 2 2B (~7)."""
    for layers, head in ((32, 2), (80, 1), (26, 7), (48, 3)):
        for pp in (2, 4, 8):
            for v in (1, 2, 4):
                if pp * v > layers:
                    continue
                for layout in {stage_layers(layers, pp * v), balanced_stage_layers([1.0] * layers, pp * v, last=head)}:
                    forward = [3 * n for n in layout]
                    forward[-1] += head
                    yield layout, pp, v, forward, [2 * f for f in forward]


def test_the_orders_simulated_are_torchs():
    """Spot checks of the orders: rank 0 of 1F1B over 2 stages warms up with 2 forwards; interleaved rank 0 runs
    its first chunk's p forwards, then its second's."""
    assert [(a.computation_type, a.microbatch_index) for a in _order("1F1B", 2, 1, 3)[0]] == [
        (FORWARD, 0), (FORWARD, 1), (BACKWARD, 0), (FORWARD, 2), (BACKWARD, 1), (BACKWARD, 2)]
    assert [a.stage_index for a in _order("interleaved", 2, 2, 4)[0]][:4] == [0, 0, 2, 2]


@pytest.mark.parametrize("pp, m", [(2, 2), (4, 4), (4, 9), (8, 16)])
def test_equal_stages_bubble_is_p_minus_1_stages(pp, m):
    """Equal stages: 1F1B and GPipe take (m + p - 1) stage times, what the cost model prices; interleaved with v
    chunks (m a multiple of p) m + (p - 1) / v rank times."""
    for v in (1, 2, 3):
        forward, backward = [1] * pp * v, [2] * pp * v
        for schedule in (("1F1B", "GPipe") if v == 1 else ("interleaved",)):
            if schedule == "interleaved" and m % pp:
                continue
            assert _simulate(schedule, forward, backward, pp, v, m) == _priced(forward, backward, pp, v, m), schedule


def test_unequal_stages_bubble_is_the_other_stages_time():
    """Stages of unequal time (random, each backward twice its forward; 1F1B and GPipe): GPipe's order takes exactly every stage's time once plus
    m - 1 times the slowest's (a flow shop of identical jobs), the cost model's price; 1F1B's never more. The
    bubble priced as p - 1 times the slowest stage (cost model 20) overpriced such steps by up to 1.3x."""
    rng = random.Random(0)
    for _ in range(200):
        pp = rng.choice([2, 3, 4, 8])
        m = rng.choice([pp, pp + 1, 2 * pp, 4 * pp])
        forward = [rng.randint(1, 9) for _ in range(pp)]
        backward = [2 * f for f in forward]  # the cost model's backward: twice the forward (BWD_TO_FWD)
        priced = _priced(forward, backward, pp, 1, m)
        assert _simulate("GPipe", forward, backward, pp, 1, m) == priced
        assert _simulate("1F1B", forward, backward, pp, 1, m) <= priced


def test_priced_steps_of_the_searched_layouts_against_the_simulated_schedules():
    """The layouts the search offers, at m = p to 8p micro-batches: without interleaving the price is within 1.5%
    above the simulated 1F1B step on even layouts, 10% on balanced ones (their rounded stages); the old bubble priced
    Gemma 2's even layout on pp 8 at m = 8 1.20x its step. Interleaved, the rank-level price is 0.96x-1.19x the
    simulated step (unequal chunks pace its rounds unevenly: cost._bubble's known limit); a change in torch's
    order or in the formula moves these bounds."""
    worst = {1: [1.0, 1.0], "interleaved": [1.0, 1.0]}
    for layout, pp, v, forward, backward in _layouts():
        for m in (pp, 2 * pp, 4 * pp, 8 * pp):
            ratio = _priced(forward, backward, pp, v, m) / _simulate("1F1B" if v == 1 else "interleaved", forward,
                                                                    backward, pp, v, m)
            key = 1 if v == 1 else "interleaved"
            worst[key] = [min(worst[key][0], ratio), max(worst[key][1], ratio)]
            if v == 1:
                assert 1.0 <= ratio <= (1.015 if layout == stage_layers(sum(layout), pp) else 1.10), (layout, m, ratio)
    assert 0.95 <= worst["interleaved"][0] and worst["interleaved"][1] <= 1.19, worst
    forward = [3 * n for n in stage_layers(26, 8)]
    forward[-1] += 7
    ranks = [3 * f for f in forward]
    old = 8 * max(ranks) + 7 * max(ranks)
    assert old / _simulate("1F1B", forward, [2 * f for f in forward], 8, 1, 8) >= 1.2


@pytest.mark.parametrize("v", [1, 2])
def test_estimate_prices_the_bubble_from_every_ranks_time(v):
    """`estimate`'s bubble is `_bubble` of its ranks' times (`_pace`): on Llama 2 7B over 4 stages the last
    (the LM head's) is the slowest; without interleaving the bubble is the other three ranks' time, below
    (p - 1) / m of the ideal step."""
    spec = preset("llama2-7b")
    s = Strategy(dp=2, tp=1, pp=4, micro_batch_size=1, num_micro_batches=8, virtual_pp=v)
    cluster = Cluster(1, 8)
    est = estimate(spec, cluster, s, global_batch_size=16)
    *slowest, rank, every = cost._pace(spec, cluster, 1, 1, False, "none", False, 1, 4, v, None)
    assert rank == 3
    assert est.time.bubble_s == pytest.approx(cost._bubble(4, v, sum(slowest), every), rel=1e-12)
    ideal = est.time.compute_s + est.time.tp_comm_s
    if v == 1:
        assert est.time.bubble_s == pytest.approx(every - sum(slowest), rel=1e-12)
        assert est.time.bubble_s < ideal * 3 / 8
    else:
        assert est.time.bubble_s == pytest.approx(ideal * 3 / (v * 8), rel=1e-12)
    equal = replace(s, virtual_pp=1)  # one stage alone: no bubble
    assert estimate(spec, Cluster(1, 2), replace(equal, pp=1, num_micro_batches=8), global_batch_size=16).time.bubble_s == 0
