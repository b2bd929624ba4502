"""The kernel launch-configuration sweep (`tridist autotune kernels`) on CPU: Triton's interpreter runs
every candidate for real (so the accuracy check and the failure pruning are real), and an injected
timer stands in for CUDA events (interpreter times say nothing about a GPU).

What must hold: the heuristic is trial 0 and the gain is measured against it; a candidate that fails,
is wrong, is over the register limit or is clearly slower never wins, even when the clock says it is
fastest; the studies resume from their storage; the winners land in the table and the launches read
them; stale tables are replaced; the CLI says "no GPU" with exit code 3.
"""

from __future__ import annotations

import io
import json

import pytest
import torch

from tridist.autotune import kernel_sweep as ks
from tridist.bench import cli
from tridist.bench.kernel_tune import write_sweep_report
from tridist.kernels import configs
from tridist.kernels._common import use_triton
from tridist.kernels.ops import rms_norm as rms_norm_ops
from tridist.kernels.ops import rotary as rotary_ops
from tridist.kernels.ops import swiglu as swiglu_ops

pytestmark = pytest.mark.skipif(not use_triton(torch.empty(0)), reason="needs TRITON_INTERPRET=1 (set by conftest)")

CPU = torch.device("cpu")
TINY = {
    "rms_norm_fwd": ks.Bucket("rms_norm", "fwd", 6, 40, torch.float32),
    "add_rms_norm_bwd": ks.Bucket("add_rms_norm", "bwd", 6, 40, torch.float32),
    "rotary_fwd": ks.Bucket("rotary", "fwd", 5, 16, torch.float32, heads=4, kv_heads=2),
    "rotary_bwd": ks.Bucket("rotary", "bwd", 5, 16, torch.float32, heads=4, kv_heads=2),
    "swiglu_fwd": ks.Bucket("swiglu", "fwd", 6, 48, torch.float32),
    "swiglu_bwd": ks.Bucket("swiglu", "bwd", 6, 48, torch.bfloat16),
}
SMALL_NORM_SPACE = {"BLOCK_N": [16, 64], "BLOCK_M": [1, 2, 64], "num_warps": [1, 8]}  # + the heuristic's values


class Clock:
    """A deterministic timer: the time of a config is `cost(config)` ms; it runs the launch once and
    counts its calls (quick timings apart)."""

    def __init__(self, cost):
        self.cost, self.calls, self.full = cost, 0, 0

    def __call__(self, fn, *, config, quick):
        fn()
        self.calls += 1
        self.full += not quick
        return float(self.cost(config))


@pytest.fixture
def table(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    monkeypatch.setenv("TRIDIST_KERNEL_CONFIGS", str(path))
    configs.clear_cache()
    yield path
    configs.clear_cache()


def _sweep(buckets, clock, **kwargs):
    kwargs.setdefault("storage", "memory")
    kwargs.setdefault("trials", 8)
    return ks.run_sweep(buckets, device=CPU, timer=clock, progress=False, **kwargs)


def test_every_kernel_is_swept_checked_and_written_to_the_table(table):
    """All six kinds of kernel: each candidate launched and checked, the heuristic is trial 0, the
    fastest by the clock wins, and the table the launches read holds it."""
    # Fewer warps and rows per tile are "faster": the heuristic (8 warps or more rows) is beaten.
    clock = Clock(lambda c: 1 + c["num_warps"] + c.get("BLOCK_M", 1) / 64 + c.get("TOKENS_PER_PROGRAM", 1) / 32)
    result = _sweep(list(TINY.values()), clock, trials=6, table_path=table)
    assert [r.bucket.tunable.name for r in result.results] == list(TINY)
    for r in result.results:
        assert r.heuristic == r.bucket.heuristic() and r.heuristic_ms == clock.cost(r.heuristic)
        assert r.best_ms == min(clock.cost(r.best), r.heuristic_ms) and r.gain >= 1.0
        assert r.trials == 6 and r.heuristic_problem is None
    written = json.loads(table.read_text())
    assert written["format"] == configs.TABLE_FORMAT and written["device"] == "cpu"
    assert {k: written[k] for k in ("torch", "triton")} == configs.software_versions()
    for r in result.results:
        section = written["kernels"][r.bucket.tunable.name]
        assert section["version"] == r.bucket.tunable.version
        assert section["entries"][r.bucket.key]["config"] == r.best
        assert section["entries"][r.bucket.key]["gain"] == pytest.approx(r.gain)
    # The launches read it: launch_config answers the tuned entry for each bucket.
    norm, rot, glu = (result.results[i] for i in (0, 2, 4))
    assert rms_norm_ops.launch_config("fwd", 6, 40, torch.float32, CPU) == norm.best
    assert rotary_ops.launch_config("fwd", 5, 16, 8, 4, 2, torch.float32, CPU) == rot.best
    assert swiglu_ops.launch_config("fwd", 6, 48, torch.float32, CPU) == glu.best


def test_failing_wrong_oversized_and_slow_candidates_never_win(table, monkeypatch):
    """The clock calls the broken configurations fastest; each is pruned with its reason instead."""
    monkeypatch.setattr(rms_norm_ops, "search_space", lambda kind, n_cols: SMALL_NORM_SPACE)
    monkeypatch.setattr(rms_norm_ops, "MAX_TILE_ELEMENTS", 64 * 64 - 1)  # the heuristic's 64 x 64 too
    real_forward = rms_norm_ops._forward

    def planted(x, residual, weight, eps, offset, cast_to_input, config=None):
        if config and config["BLOCK_M"] == 2 and config["BLOCK_N"] == 16:
            raise RuntimeError("out of resource: shared memory (planted)")
        y, h, rstd = real_forward(x, residual, weight, eps, offset, cast_to_input, config=config)
        if config and config["BLOCK_M"] == 1 and config["BLOCK_N"] == 16:
            y = y * 1.001  # a wrong kernel: off by 0.1%, far beyond fp32 rounding
        return y, h, rstd

    monkeypatch.setattr(rms_norm_ops, "_forward", planted)

    def cost(c):
        if c["BLOCK_N"] == 16 and c["BLOCK_M"] in (1, 2):
            return 0.1  # the broken ones "look" fastest
        return {1: 1.0, 8: 50.0}[c["num_warps"]] + c["BLOCK_M"]

    import optuna

    bucket = TINY["rms_norm_fwd"]
    grid = len(SMALL_NORM_SPACE["BLOCK_N"]) * len(SMALL_NORM_SPACE["BLOCK_M"]) * len(SMALL_NORM_SPACE["num_warps"])
    storage = optuna.storages.InMemoryStorage()
    result = _sweep([bucket], Clock(cost), trials=grid, storage=storage, table_path=table).results[0]  # exhaustive
    assert result.trials == grid
    assert result.best == {"BLOCK_N": 64, "BLOCK_M": 1, "num_warps": 1}
    assert result.pruned["failed"] == 2 and result.pruned["wrong"] == 2  # num_warps 1 and 8 of each
    assert result.pruned["infeasible"] == 2  # 64 x 64 with either warp count
    assert result.pruned["slower"] >= 1  # 8 warps: 50x the best
    assert result.heuristic_problem and "tile of 64 x 64" in result.heuristic_problem
    reasons = [t.user_attrs["reason"] for t in optuna.load_study(study_name=result.study_name, storage=storage).trials
               if "reason" in t.user_attrs]
    assert any("RuntimeError: out of resource" in r for r in reasons)
    assert any(r.startswith("y: max error vs fp64") for r in reasons)
    assert json.loads(table.read_text())["kernels"]["rms_norm_fwd"]["entries"][bucket.key]["config"] == result.best

def test_planted_wrong_candidate_is_caught_by_the_check(monkeypatch):
    """Without the accuracy check the wrong configuration would be timed and win: the check is what stops it."""
    monkeypatch.setattr(swiglu_ops, "search_space", lambda n_cols: {"BLOCK_N": [16, 64], "BLOCK_M": [1],
                                                                     "num_warps": [1]})
    real = swiglu_ops._forward

    def planted(gate, up, config=None):
        out = real(gate, up, config=config)
        return out + 1e-3 if config and config["BLOCK_N"] == 16 else out

    monkeypatch.setattr(swiglu_ops, "_forward", planted)
    clock = Clock(lambda c: c["BLOCK_N"] / 16)
    # 2 x 2 x 2 configurations with the heuristic's (64 columns, 64 rows, 4 warps): swept exhaustively.
    result = _sweep([TINY["swiglu_fwd"]], clock, trials=8, write_table=False).results[0]
    assert result.best["BLOCK_N"] == 64 and result.pruned["wrong"] == 4
    launch = ks.prepare(TINY["swiglu_fwd"], CPU)
    assert "max error vs fp64" in launch.check(launch.run({"BLOCK_N": 16, "BLOCK_M": 1, "num_warps": 1}))
    assert launch.check(launch.run({"BLOCK_N": 64, "BLOCK_M": 1, "num_warps": 1})) is None


def test_studies_resume_from_their_storage(tmp_path):
    storage = tmp_path / "sweep.db"
    bucket = TINY["rotary_fwd"]
    first = Clock(lambda c: c["num_warps"])
    r1 = _sweep([bucket], first, trials=3, storage=storage, write_table=False).results[0]
    assert r1.trials == 3
    second = Clock(lambda c: c["num_warps"])
    r2 = _sweep([bucket], second, trials=5, storage=storage, write_table=False).results[0]
    assert r2.trials == 5 and r2.study_name == r1.study_name
    assert second.full <= 2  # only the two new trials were timed (a repeated config is not timed again)
    third = Clock(lambda c: c["num_warps"])
    assert _sweep([bucket], third, trials=5, storage=storage, write_table=False).results[0].trials == 5
    assert third.calls == 0  # nothing left to do
    # A changed kernel is another study: its version is in the name.
    assert bucket.tunable.version in r1.study_name


def test_time_budget_skips_what_it_cannot_reach(table):
    result = _sweep([TINY["swiglu_fwd"], TINY["swiglu_bwd"]], Clock(lambda c: 1.0), minutes=1e-9, table_path=table)
    assert result.results == [] and len(result.skipped) == 2 and result.table_path is None


def test_progress_shows_trials_and_eta():
    stream = io.StringIO()
    ks.run_sweep([TINY["swiglu_bwd"]], device=CPU, timer=Clock(lambda c: 1.0), storage="memory", trials=2,
                 write_table=False, progress=True, stream=stream)
    line = stream.getvalue().strip().splitlines()[-1]
    assert line.startswith("[2/2 trials] swiglu_bwd 6 x 48 bfloat16") and "ETA 0m00s" in line


def test_table_merge_keeps_other_buckets_and_drops_stale_tables(table):
    clock = Clock(lambda c: c["num_warps"])
    _sweep([TINY["swiglu_fwd"]], clock, trials=2, table_path=table)
    other = ks.Bucket("swiglu", "fwd", 1100, 48, torch.float32)  # another rows bucket (4096, not 1024)
    _sweep([other], clock, trials=2, table_path=table)
    entries = json.loads(table.read_text())["kernels"]["swiglu_fwd"]["entries"]
    assert set(entries) == {TINY["swiglu_fwd"].key, other.key}
    stale = json.loads(table.read_text())
    stale["triton"] = "0.0.1"
    table.write_text(json.dumps(stale))
    _sweep([other], clock, trials=2, table_path=table)
    fresh = json.loads(table.read_text())
    assert fresh["triton"] == configs.software_versions()["triton"]
    assert set(fresh["kernels"]["swiglu_fwd"]["entries"]) == {other.key}


def test_resweep_after_a_kernel_change_replaces_its_stale_section_and_launches_use_it(table):
    """A table tuned for an older version of a kernel's source (shared/reviews/test-strength.md): its
    section goes stale when the kernel changes; the next sweep of that kernel replaces the section (not
    only adds to it), and the launch then uses what the sweep found. Other kernels' sections stay."""
    bucket, other = TINY["swiglu_fwd"], TINY["rms_norm_fwd"]
    _sweep([bucket, other], Clock(lambda c: c["num_warps"]), trials=3, table_path=table)
    stale = json.loads(table.read_text())
    section = stale["kernels"][bucket.tunable.name]
    section["version"] = "0" * 16  # as tuned for the kernel's previous source
    section["entries"]["rows=old"] = section["entries"][bucket.key]
    table.write_text(json.dumps(stale))
    configs.clear_cache()
    assert configs.tuned_config(bucket.tunable, CPU, bucket.key) is None  # stale: the heuristic runs meanwhile
    result = _sweep([bucket], Clock(lambda c: 1 / c["num_warps"]), trials=3, table_path=table)  # another best
    fresh = json.loads(table.read_text())["kernels"]
    assert fresh[bucket.tunable.name]["version"] == bucket.tunable.version
    assert set(fresh[bucket.tunable.name]["entries"]) == {bucket.key}  # nothing of the stale section survives
    assert configs.tuned_config(bucket.tunable, CPU, bucket.key) == result.results[0].best
    assert configs.tuned_config(other.tunable, CPU, other.key) is not None


def test_report_files(tmp_path):
    result = _sweep([TINY["swiglu_fwd"], TINY["rms_norm_fwd"]], Clock(lambda c: 1 + c["num_warps"]), trials=3,
                    write_table=False)
    out = write_sweep_report(result, tmp_path, budget="3 trials per bucket")
    report = (out / "report.md").read_text()
    assert "swiglu_fwd" in report and "Geometric-mean gain" in report and "gain.png" in report
    assert (out / "gain.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import pandas as pd

    frame = pd.read_csv(out / "sweep.csv")
    assert list(frame["kernel"]) == ["swiglu_fwd", "rms_norm_fwd"] and (frame["gain"] >= 1).all()
    assert set(frame["torch"]) == {torch.__version__}


def test_refuses_what_it_cannot_time(monkeypatch):
    with pytest.raises(ValueError, match="pass a timer"):
        ks.run_sweep([TINY["swiglu_fwd"]], device=CPU, storage="memory")
    monkeypatch.setattr(ks, "use_triton", lambda tensor: False)
    with pytest.raises(ks.SweepUnavailable, match="no CUDA GPU"):
        ks.run_sweep([TINY["swiglu_fwd"]], device=CPU, storage="memory", timer=Clock(lambda c: 1.0))
    with pytest.raises(ValueError, match="divisible"):
        ks.Bucket("rotary", "fwd", 8, 16, heads=3, kv_heads=2)


def test_cli_without_a_gpu_exits_3(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["autotune", "kernels", "--quick"]) == ks.NO_GPU_EXIT == 3
    assert "no CUDA GPU" in capsys.readouterr().err
    assert cli.main(["autotune", "kernels", "--dtype", "fp8"]) == 2


def test_default_buckets_cover_every_kernel():
    buckets = ks.default_buckets(quick=True)
    assert {b.tunable.name for b in buckets} == {f"{op}_{kind}" for op in ks.OPS for kind in ks.KINDS}
    full = ks.default_buckets()
    assert len({(b.tunable.name, b.key) for b in full}) == len(full)  # one shape per bucket
    for b in full:  # the heuristic is in every space (it is trial 0)
        assert all(b.heuristic()[k] in v for k, v in b.space().items())


def test_a_failing_bucket_leaves_the_others_swept_and_written(table):
    """Out of memory preparing one bucket (planted in its timer): reported, the others still swept, and the
    table written bucket by bucket."""
    failing = TINY["rotary_fwd"]

    def timer(fn, *, config, quick):
        if "TOKENS_PER_PROGRAM" in config:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (planted)")
        fn()
        return 1.0 + config["num_warps"]

    result = _sweep([TINY["swiglu_fwd"], failing, TINY["rms_norm_fwd"]], timer, trials=3, table_path=table)
    assert [r.bucket for r in result.results] == [TINY["swiglu_fwd"], TINY["rms_norm_fwd"]]
    assert result.failed == [(failing, "OutOfMemoryError: CUDA out of memory (planted)")]
    assert set(json.loads(table.read_text())["kernels"]) == {"swiglu_fwd", "rms_norm_fwd"}


def test_a_changed_search_space_is_another_study(monkeypatch):
    """Optuna cannot resume a study whose choices changed: the space is part of the study's name."""
    bucket = TINY["swiglu_fwd"]
    before = _sweep([bucket], Clock(lambda c: 1.0), trials=2, write_table=False).results[0].study_name
    monkeypatch.setattr(swiglu_ops, "search_space", lambda n_cols: {"BLOCK_N": [64], "BLOCK_M": [1], "num_warps": [1]})
    after = _sweep([bucket], Clock(lambda c: 1.0), trials=2, write_table=False).results[0].study_name
    assert before != after and before.split("|space-")[0] == after.split("|space-")[0]
