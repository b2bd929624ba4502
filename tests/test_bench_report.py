"""`tridist bench report`: one run re-rendered; several compared case by case against the first, with
regressions beyond noise flagged on one device only (exit code 1). (Each CSV row's provenance:
test_bench.py.)"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from tridist.bench import cli
from tridist.bench.compare import compare, load_run
from tridist.bench.report import ROW_PROVENANCE

REPO = Path(__file__).resolve().parents[1]
H100 = REPO / "bench" / "results" / "h100-2026-11-24"  # a real run, committed (its rows predate provenance)


def _run(tmp_path, name: str, *, scale: dict, device: str = "NVIDIA H100 80GB HBM3") -> Path:
    """A copy of the committed H100 run with some cases' times scaled, stamped as a newer run."""
    frame = pd.read_csv(H100 / "bench" / "results.csv")
    for (op, mode), factor in scale.items():
        rows = (frame["op"] == op) & (frame["mode"] == mode) & (frame["variant"] == "tridist")
        frame.loc[rows, "time_ms"] *= factor
    frame = frame.assign(**{key: "" for key in ROW_PROVENANCE}).assign(device=device, commit=name)
    path = tmp_path / name
    path.mkdir()
    frame.to_csv(path / "results.csv", index=False)
    return path


def test_one_run_renders(tmp_path):
    assert cli.main(["bench", "report", str(H100), "--out", str(tmp_path / "out")]) == 0
    assert "## rms_norm" in (tmp_path / "out" / "report.md").read_text()


def test_regression_beyond_noise_is_flagged(tmp_path, capsys):
    before = _run(tmp_path, "before", scale={})
    after = _run(tmp_path, "after", scale={("swiglu", "bwd"): 1.2, ("rms_norm", "fwd"): 1.03, ("rotary", "fwd"): 0.8})
    table = compare([load_run(before), load_run(after)])
    verdicts = table.groupby(["op", "mode", "variant"])["verdict after"].agg(set)
    assert verdicts[("swiglu", "bwd", "tridist")] == {"regression"}
    assert verdicts[("rms_norm", "fwd", "tridist")] == {"same"}  # 3%: within the noise
    assert verdicts[("rotary", "fwd", "tridist")] == {"improvement"}
    assert verdicts[("swiglu", "bwd", "eager")] == {"same"}
    code = cli.main(["bench", "report", str(before), str(after), "--out", str(tmp_path / "out")])
    assert code == 1 and "regression(s)" in capsys.readouterr().out
    assert (tmp_path / "out" / "comparison.png").read_bytes().startswith(b"\x89PNG")


def test_other_device_is_compared_not_judged(tmp_path):
    h100 = _run(tmp_path, "h100", scale={})
    h200 = _run(tmp_path, "h200", scale={("swiglu", "bwd"): 1.5}, device="NVIDIA H200")
    assert cli.main(["bench", "report", str(h100), str(h200), "--out", str(tmp_path / "out")]) == 0
    assert set(compare([load_run(h100), load_run(h200)])["verdict h200"]) == {"other device"}


def test_bad_input(tmp_path, capsys):
    assert cli.main(["bench", "report", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "no results.csv" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "report"])
