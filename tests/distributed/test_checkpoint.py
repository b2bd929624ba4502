"""save_state under one layout, load_state under another: ZeRO-3 on 4 processes, or dp2 x mp2 tensor
parallel on 4 processes; resumed under sharding level 1 on 2 processes and on a single process: every
parameter and optimizer state resumes bit for bit, and the next step equals the saving run's within
rounding (tests/distributed/equivalence.py). Packed projections (split per part) and a
vocabulary-parallel LM head saved under dp2 x mp2 resume under mp4 and on a single process as an
uninterrupted single-process run. The saves run in the session's merged 4-process launch, the loads in
the launches of each world size after it (conftest.py), through the session's scratch directory."""

import pytest

from tests.distributed.checkpoint_worker import LAYOUTS, LOADED_UNDER, load_check, save_check
from tests.distributed.harness import assert_check, module_results

SAVED_UNDER = 4


MERGED = {"checkpoint_worker": {
    nproc: [*(save_check(layout) for layout in LAYOUTS if nproc == SAVED_UNDER),
            *(load_check(layout) for layout in LAYOUTS if nproc in LOADED_UNDER[layout]),
            "check_missing_checkpoint_is_a_clear_error",
            *(["check_a_checkpoint_on_rank_0_alone_is_a_clear_error"] if nproc == 2 else [])]
    for nproc in (4, 2, 1)
}}


def _results(merged_launches, nproc: int) -> dict:
    return module_results(merged_launches[nproc], "checkpoint_worker")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_then_continue(merged_launches, layout):
    assert_check(_results(merged_launches, SAVED_UNDER), save_check(layout), nproc=SAVED_UNDER)


@pytest.mark.parametrize("layout, nproc", [(layout, nproc) for layout in LAYOUTS for nproc in LOADED_UNDER[layout]],
                         ids=[f"{layout}-{nproc}-processes" for layout in LAYOUTS for nproc in LOADED_UNDER[layout]])
def test_load_under_another_layout(merged_launches, layout, nproc):
    assert_check(_results(merged_launches, nproc), load_check(layout), nproc=nproc)


@pytest.mark.parametrize("nproc", (4, 2, 1))
def test_missing_checkpoint_is_a_clear_error(merged_launches, nproc):
    assert_check(_results(merged_launches, nproc), "check_missing_checkpoint_is_a_clear_error", nproc=nproc)


def test_a_checkpoint_on_rank_0_alone_is_a_clear_error(merged_launches):
    assert_check(_results(merged_launches, 2), "check_a_checkpoint_on_rank_0_alone_is_a_clear_error", nproc=2)
