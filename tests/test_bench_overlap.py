"""`tridist bench overlap` on the CPU: the emulated ring runs and reports every column (no speed is
judged: a CPU runs the matmuls and copies one after the other), and the cost model takes the two
overlap terms a GPU calibration stores in the device profile."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tridist.autotune import Cluster, DeviceProfile, Strategy, estimate, get_profile, preset
from tridist.bench import cli
from tridist.bench import overlap as bo

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_ring_schedule_computes_the_gathered_matmul():
    """The emulated ring's output is the whole matmul (the chunks land in their rows)."""
    ring = bo._Ring.make(32, 16, 4, torch.float32, torch.device("cpu"))
    bo._ring_schedule(ring, bo._Link(ring, None, 0.0), None)
    whole = ring.chunks.reshape(-1, 32) @ ring.weight_t
    torch.testing.assert_close(ring.out, whole)


def test_cpu_run_reports_every_case(tmp_path):
    frame = bo.run_overlap_benchmark(device="cpu", shapes=dict(hidden=(32,), tokens=(16,), tp=(2, 4)),
                                     links={"link-100": 100.0}, repeats=1, progress=lambda m: None)
    assert list(frame["tp"]) == [2, 4] and set(frame["link"]) == {"link-100"}
    for column in ("full_ms", "chunked_ms", "comm_ms", "overlapped_ms", "copies_only_ms"):
        assert (frame[column] > 0).all(), column
    assert frame["hidden_fraction"].between(0, 1).all() and (frame["torch"] == torch.__version__).all()
    out = bo.write_overlap_report(frame, tmp_path)
    assert "CPU run" in (out / "report.md").read_text() and (out / "plot.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_runs_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bo, "CPU_CASE", dict(hidden=(32,), tokens=(16,), tp=(2,)))
    assert cli.main(["bench", "overlap", "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.csv").exists() and "report:" in capsys.readouterr().out


def test_calibrated_overlap_terms_price_the_overlapped_strategy():
    """A profile's measured chunking overhead adds to the layer's GEMM time and its interference replaces
    the 0.15 constant; without them the estimate is what it was (both None)."""
    spec = preset("llama2-7b")
    s = Strategy(dp=1, tp=8, pp=1, sequence_parallel=True, overlap_tp_comm=True, micro_batch_size=1, num_micro_batches=16)
    base = get_profile("h100-sxm")

    def step(**fields):
        return estimate(spec, Cluster(1, 8, dataclasses.replace(base, **fields)), s, global_batch_size=16).time

    plain, chunked = step(), step(overlap_chunking_overhead=0.05)
    assert chunked.compute_s > plain.compute_s and chunked.tp_comm_s == plain.tp_comm_s
    quiet, noisy = step(overlap_interference=0.0), step(overlap_interference=0.5)
    assert quiet.tp_comm_s < plain.tp_comm_s < noisy.tp_comm_s
    assert step(overlap_interference=0.15).tp_comm_s == pytest.approx(plain.tp_comm_s)
    with pytest.raises(ValueError, match="must be >= 0"):
        dataclasses.replace(base, overlap_chunking_overhead=-0.1)
    assert DeviceProfile.from_dict(dataclasses.replace(base, overlap_interference=0.0).to_dict()).overlap_interference == 0.0
