"""`tridist check kernels`: the correctness sweep runs (here on the interpreted kernels) and can fail."""

import torch

from tridist.bench import correctness
from tridist.bench.cli import main


def test_sweep_passes_and_writes_its_report(tmp_path):
    frame = correctness.run_correctness_check(device=torch.device("cpu"), dtypes=[torch.float32], quick=True,
                                              out_dir=str(tmp_path), progress=False)
    assert set(frame["op"]) == {"rms_norm", "swiglu", "geglu", "rotary"}
    assert frame["ok"].all(), frame[~frame["ok"]]
    assert (frame["tensor"].str.startswith("grad")).any()  # backward is checked, not only forward
    report = (tmp_path / "report.md").read_text()
    assert "cases pass" in report and "FAIL" not in report and (tmp_path / "results.csv").exists()


def test_sweep_reports_a_wrong_kernel(tmp_path, monkeypatch):
    case = correctness.cases(quick=True, device_type="cpu")[0]
    broken = correctness.Case(case.op, case.label, case.make, lambda *a, **k: case.ours(*a, **k) * 1.01,
                              case.reference, case.requires_grad)
    monkeypatch.setattr(correctness, "cases", lambda **_: [broken])
    frame = correctness.run_correctness_check(device=torch.device("cpu"), dtypes=[torch.float32], out_dir=str(tmp_path),
                                              progress=False)
    assert not frame["ok"].all() and "FAIL" in (tmp_path / "report.md").read_text()


def test_cli_rejects_unknown_dtypes(capsys):
    assert main(["check", "kernels", "--dtype", "fp8", "--device", "cpu"]) == 2
    assert "unknown dtype" in capsys.readouterr().err
