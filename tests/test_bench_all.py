"""`tridist bench all`: the steps' order, the tuned table handed to the later steps, failures kept apart,
the summary's headlines (built from the committed H100 run's CSVs), and the no-GPU exit.

The steps themselves are tested where they live; here a stand-in runner plays them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tridist.bench import all as bench_all
from tridist.bench import cli

H100 = Path(__file__).resolve().parents[1] / "bench" / "results" / "h100-2026-11-24"


class FakeSteps:
    """Writes what each real step would write (the committed H100 CSVs for check and kernels)."""

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)

    def __call__(self, argv, *, env, log_path, echo):
        out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else None
        name = {"autotune": "sweep", "check": "check", "calibrate": "calibrate"}.get(argv[0]) or argv[1]
        name = "kernels" if name == "kernels" else name
        self.calls.append((name, env.get("TRIDIST_KERNEL_CONFIGS")))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(f"{name} output\n")
        if name in self.fail:
            return 1
        if name == "sweep":
            Path(argv[argv.index("--table") + 1]).write_text("{}")
            out.mkdir(parents=True)
            out.joinpath("sweep.csv").write_text(
                "kernel,shape,gain\nrms_norm_fwd,16384 x 4096 bfloat16,1.25\nswiglu_bwd,16384 x 14336 bfloat16,1.0\n")
        elif name in ("check", "kernels"):
            shutil.copytree(H100 / ("check" if name == "check" else "bench"), out)
        elif name == "overlap":
            out.mkdir(parents=True)
            out.joinpath("results.csv").write_text(
                "hidden,tokens,tp,link,link_gbps,chunking_overhead,hidden_fraction\n"
                "4096,8192,8,nvlink-450,450,0.031,0.86\n4096,16384,8,nvlink-450,450,0.012,0.93\n"
                "4096,8192,8,link-25,25,0.031,0.12\n")
        elif name == "model":
            out.mkdir(parents=True)
            out.joinpath("results.csv").write_text(
                "target,variant,status,shape,time_ms,tokens_per_s,peak_mem_gib,torch,triton\n"
                "model,eager,ok,8 layers,100.0,40000,10.0,2.11.0+cu130,3.6.0\n"
                "model,fused,ok,8 layers,80.0,50000,9.0,2.11.0+cu130,3.6.0\n"
                "model,liger,unavailable,8 layers,,,,2.11.0+cu130,3.6.0\n")
        else:
            out.write_text(json.dumps({"peak_bf16_flops": 7.5e14, "matmul_efficiency": 1.0, "hbm_bandwidth": 3.0e12}))
        return 0


def test_steps_run_in_order_with_the_tuned_table_and_summarise(tmp_path):
    steps = FakeSteps()
    code = bench_all.run_all(tmp_path, runner=steps, echo=lambda line: None)
    assert code == 0
    table = str(tmp_path / bench_all.TABLE_NAME)
    assert steps.calls == [("sweep", None), ("check", table), ("kernels", table), ("model", table),
                           ("overlap", None), ("calibrate", None)]
    summary = (tmp_path / "README.md").read_text()
    assert "# GPU evidence: NVIDIA H100 80GB HBM3" in summary and "torch 2.11.0+cu130" in summary
    assert "at tp 8 over nvlink-450, 86%-93% of the communication hidden; chunking overhead up to +3.1%" in summary
    # Headlines from the real H100 CSVs: every check passed; SwiGLU's fwd+bwd at its largest shape
    # (T=65536 I=22016) took 7.992 ms against compile's 7.576 (0.95x) and eager's 13.186 (1.65x).
    assert "Correctness: 189/189 tensors within the criterion over 54 cases" in summary and "worst error/allowed 0.51" in summary
    swiglu = next(line for line in summary.splitlines() if line.startswith("| swiglu"))
    assert "T=65536 I=22016" in swiglu and "7.992" in swiglu and "0.95x" in swiglu and "1.65x" in swiglu
    assert "| model  | 8 layers | fused " in summary and "1.25x" in summary  # model speed-up vs eager
    assert "liger" not in summary.split("small model")[1].split("Launch")[0]  # unavailable rows are not timings
    assert "geometric-mean gain 1.118x" in summary and "bf16 matmul 750 TFLOP/s" in summary
    status = json.loads((tmp_path / "steps.json").read_text())
    assert all(s["exit"] == 0 for s in status.values()) and (tmp_path / "logs" / "model.log").exists()


def test_a_failing_step_does_not_stop_the_others(tmp_path):
    steps = FakeSteps(fail={"sweep", "check"})
    assert bench_all.run_all(tmp_path, runner=steps, echo=lambda line: None) == 1
    assert [name for name, _ in steps.calls] == list(bench_all.STEP_NAMES)
    assert all(table is None for _, table in steps.calls)  # no table was written: the heuristics run
    summary = (tmp_path / "README.md").read_text()
    assert "| sweep     | " in summary and "exit 1" in summary


def test_a_subset_adds_to_the_same_folder(tmp_path):
    bench_all.run_all(tmp_path, steps=["sweep", "check"], runner=FakeSteps(), echo=lambda line: None)
    steps = FakeSteps()
    assert bench_all.run_all(tmp_path, steps=["calibrate", "model"], runner=steps, echo=lambda line: None) == 0
    assert [name for name, _ in steps.calls] == ["model", "calibrate"]  # the fixed order
    status = json.loads((tmp_path / "steps.json").read_text())
    assert set(status) == {"sweep", "check", "model", "calibrate"}
    assert "| kernels   | " in (tmp_path / "README.md").read_text() and "not run" in (tmp_path / "README.md").read_text()


def test_cli_without_a_gpu_exits_3(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "all", "--out", "unused"]) == bench_all.NO_GPU_EXIT == 3
    assert "no CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "all", "--steps", "check,speed"])
