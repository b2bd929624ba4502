"""`tridist tune`, `tridist calibrate`, `tridist bench tune` run in-process; device profiles save and
load; `import tridist.autotune` stays light (no torch, optuna, pandas, matplotlib)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tridist import autotune
from tridist.autotune import DEVICE_PROFILES, Cluster, DeviceProfile, get_profile, load_profile, save_profile
from tridist.bench import cli

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Keep the default SQLite study and saved profiles out of the real ~/.cache."""
    monkeypatch.setenv("TRIDIST_CACHE_DIR", str(tmp_path / "cache"))


def test_public_names():
    from tridist import autotune

    for name in ("ModelSpec", "Cluster", "Strategy", "search", "SearchResult", "Candidate", "estimate",
                 "DeviceProfile", "DEVICE_PROFILES", "UnrecognisedModel"):
        assert hasattr(autotune, name), name
    assert set(DEVICE_PROFILES) >= {"h100-sxm", "h200", "a100-80gb", "a100-40gb", "cpu"}


def test_tune_writes_report_and_plot(tmp_path, capsys):
    report = tmp_path / "report"
    code = cli.main(["tune", "--model", "paddle-llama", "--size", "tiny", "--nodes", "1", "--devices-per-node", "4",
                     "--device", "a100-40gb", "--global-batch", "16", "--seq-len", "256", "--top-k", "5",
                     "--report", str(report)])
    out = capsys.readouterr()
    assert code == 0
    assert "Best:" in out.out and "rank" in out.out and "[tridist tune]" in out.err
    assert "Predictions: datasheet only (a100-40gb): expect optimistic" in out.out  # the basis of every figure
    text = (report / "report.md").read_text()
    assert "datasheet only" in text
    assert "## Ranked strategies" in text and "Pareto" in text and "llama.layers.*.self_attn.qkv_proj" in text
    assert (report / "pareto.png").read_bytes()[:8] == PNG_MAGIC
    assert len((report / "ranked.csv").read_text().splitlines()) == 6  # header + top 5
    assert (tmp_path / "cache" / "tune.db").exists()  # the default storage: resumable SQLite


def test_tune_preset_in_memory_and_resume(tmp_path, capsys):
    args = ["tune", "--model", "llama2-7b", "--nodes", "2", "--devices-per-node", "8", "--global-batch", "64",
            "--storage", str(tmp_path / "t.db")]
    assert cli.main(args) == 0
    first = capsys.readouterr().out
    assert cli.main(args) == 0
    second = capsys.readouterr().out
    assert "0 new trial(s)" in second and "0 new trial(s)" not in first
    assert cli.main(args[:-2] + ["--storage", "memory"]) == 0


def test_tune_errors(capsys):
    assert cli.main(["tune", "--model", "nope", "--nodes", "1", "--devices-per-node", "8", "--global-batch", "8"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    code = cli.main(["tune", "--model", "llama2-70b", "--nodes", "1", "--devices-per-node", "1", "--device", "a100-40gb",
                     "--global-batch", "8", "--storage", "memory"])
    assert code == 1 and "No strategy fits" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["tune", "--model", "llama2-7b", "--nodes", "0", "--devices-per-node", "8", "--global-batch", "8"])


def test_tune_module_function_model(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        "from tridist.bench.models import build_model\n"
        "def build():\n    return build_model('hf-llama', 'seed', num_key_value_heads=8)\n"
        "def unknown():\n    import torch\n    return torch.nn.Linear(4, 4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["tune", "--model", "my_models:build", "--nodes", "1", "--devices-per-node", "8",
                     "--global-batch", "8", "--storage", "memory"]) == 0
    assert "kv heads 8" in capsys.readouterr().out
    assert cli.main(["tune", "--model", "my_models:unknown", "--nodes", "1", "--devices-per-node", "8",
                     "--global-batch", "8", "--storage", "memory"]) == 2
    assert "not recognised" in capsys.readouterr().err


def test_profiles_save_load_and_lookup(tmp_path):
    profile = DeviceProfile(name="my-gpu", peak_bf16_flops=1e15, peak_fp32_flops=6e13, memory_bytes=8e10,
                            hbm_bandwidth=3e12, intra_node_bandwidth=4e11, inter_node_bandwidth=5e10)
    path = save_profile(profile)
    assert path.parent.name == "device-profiles" and load_profile(path) == profile
    assert get_profile("my-gpu") == profile  # a saved profile is found by name
    assert Cluster(1, 8, "my-gpu").profile == profile
    explicit = save_profile(profile, tmp_path / "p.json")
    assert Cluster(1, 8, str(explicit)).profile == profile
    with pytest.raises(ValueError, match="unknown device 'h900'"):
        Cluster(1, 8, "h900")
    with pytest.raises(ValueError, match="positive number"):
        DeviceProfile("bad", 0, 1, 1, 1, 1, 1)


@pytest.mark.parametrize("gpu_name, memory_gib, expected", [
    ("NVIDIA H100 80GB HBM3", 80, ("h100-sxm", True)),
    ("NVIDIA H200", 141, ("h200", True)),
    ("NVIDIA A100-SXM4-80GB", 80, ("a100-80gb", True)),
    ("NVIDIA A100-SXM4-40GB", 40, ("a100-40gb", True)),
    ("NVIDIA L4", 24, ("h100-sxm", False)),  # no profile: priced as an H100, and said so
])
def test_builtin_profile_for_a_gpu_by_its_name_and_memory(monkeypatch, gpu_name, memory_gib, expected):
    """calibrate's base profile and to_distributed's default device both come from builtin_profile_for."""
    import types

    import torch

    from tridist.autotune.hardware import builtin_profile_for

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu_name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(total_memory=memory_gib * 2**30))
    assert builtin_profile_for(torch.device("cuda", 0)) == expected
    assert builtin_profile_for(torch.device("cpu")) == ("cpu", True)


def test_calibrate_cpu_quick(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    code = cli.main(["calibrate", "--device", "cpu", "--quick", "--sizes", "64,128", "--name", "test-cpu",
                     "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "matmul fp32 128x128" in text and "copy" in text and "decoder layer GEMMs" in text
    profile = load_profile(out)
    assert profile.layer_gemm_flops > 0 and profile.attention_flops > 0  # the layer's real shapes, and SDPA
    assert profile.name == "test-cpu" and profile.peak_fp32_flops > 0 and profile.matmul_efficiency == 1.0
    assert profile.memory_bytes > 1e8
    assert json.loads(out.read_text())["source"].startswith("tridist calibrate")
    assert profile.basis.startswith("calibrated: ") and "torch" in profile.basis  # shown with its predictions
    # the measured profile drives a search
    result = autotune.search(autotune.preset("llama2-7b", num_layers=2, seq_len=512),
                                           Cluster(1, 2, str(out), dtype="fp32"), global_batch_size=4)
    assert result.best is not None


def test_bench_tune_target(monkeypatch, capsys):
    from tridist.bench import tune

    monkeypatch.setattr(tune, "BENCH_CASES", (("1x8 tiny", "llama2-7b", 1, 8, "h100-sxm", 16),))
    frame = tune.run_tune_benchmark(quick=False, storages=("memory",))
    assert list(frame["equals_exhaustive"]) == [True] and frame["seconds"].iloc[0] > 0
    assert "exhaustive match: True" in capsys.readouterr().out


def test_tune_measure_runs_candidates_on_this_jobs_processes(tmp_path):
    """`tridist tune --measure` under torchrun (2 gloo processes, tiny model, random tokens): the report
    lists each measured candidate's predicted and measured time, fastest measured first, with its plot;
    the refitted profile is saved as cpu-measured."""
    report = tmp_path / "report"
    env = {**__import__("os").environ, "TRIDIST_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "tridist.bench", "tune", "--model", "hf-llama", "--size", "tiny", "--nodes", "1", "--devices-per-node",
               "2", "--global-batch", "4", "--seq-len", "16", "--device", "cpu", "--engine", "torch", "--measure",
               "--measure-top-k", "2", "--measure-steps", "1", "--storage", "memory", "--report", str(report),
               "--measure-pick", "layouts"]  # the strategy benchmark's spread: two different dp x tp x pp layouts
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import pandas as pd

    frame = pd.read_csv(report / "measured.csv")
    assert len(frame) == 2 and frame["measured_ms"].is_monotonic_increasing, frame
    layouts = [tuple(part for part in name.split() if part[:2] in ("dp", "tp", "pp")) for name in frame["strategy"]]
    assert len(set(layouts)) == 2, frame["strategy"]
    assert (report / "measured.png").read_bytes().startswith(PNG_MAGIC)
    assert "Rank correlation of predicted and measured step times (Spearman)" in (report / "report.md").read_text()
    saved = load_profile(tmp_path / "cache" / "device-profiles" / "cpu-measured.json")
    assert saved.measured_steps == 2 and saved.step_time_scale > 0


@pytest.mark.parametrize("args, message", [
    (["--model", "llama2-7b"], "--measure runs the model"),
    (["--model", "hf-llama", "--devices-per-node", "8"], "launch with torchrun"),
    (["--model", "hf-llama", "--engine", "megatron"], "cannot be measured"),
])
def test_tune_measure_errors(args, message, capsys):
    base = {"--nodes": "1", "--devices-per-node": "1", "--global-batch": "2", "--size": "tiny"}
    given = dict(zip(args[::2], args[1::2]))
    argv = ["tune", "--measure", *[x for key, value in {**base, **given}.items() for x in (key, value)]]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_fused_kernel_bandwidth_is_measured_at_the_layers_shapes():
    """The GPU calibration's fused-kernel figure, run here on tiny shapes under Triton's interpreter (the
    machinery; a CPU calibration itself skips it): bytes of RMSNorm, rotary and SwiGLU over their time."""
    import torch

    from tridist.bench.tune import measure_fused_kernels

    lines = []
    rate = measure_fused_kernels(torch.device("cpu"), dict(batch=1, seq=8, hidden=64, heads=4, kv_heads=1,
                                                           head_dim=16, ffn=32), progress=lines.append)
    assert rate > 0 and [line.split()[1] for line in lines] == ["rms_norm", "rotary", "swiglu"], lines


@pytest.mark.parametrize("measured, rho", [((1.0, 2.0, 3.0), "1.00"), ((3.0, 2.0, 1.0), "-1.00")])
def test_measured_report_gives_the_rank_correlation(tmp_path, measured, rho):
    """The cost model's order against the clock's: Spearman's rho of predicted vs measured times."""
    from tridist.autotune import Strategy
    from tridist.autotune.measured import Measurement
    from tridist.bench.tune import write_measured_report

    runs = [Measurement(Strategy(dp=4, tp=1, pp=1, sharding_level=level), predicted, seconds)
            for level, predicted, seconds in zip((0, 1, 2), (1.0, 2.0, 3.0), measured)]
    text = (write_measured_report(runs, tmp_path) / "report.md").read_text()
    assert f"(Spearman): {rho} over 3 candidate(s)" in text
