"""The kernel benchmark's pipeline on tiny CPU shapes: rows, report files, bytes formulas, CLI.

Timing numbers are not checked (CPU, shared machine); what is checked is that every row is filled,
that a wrong or broken variant is flagged rather than timed silently, and that the formulas match
hand-computed values.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tridist.bench import cli
from tridist.bench import kernels as kb
from tridist.kernels import _common
from tridist.kernels.reference import swiglu_reference

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST_TIMING = {"warmup_ms": 1, "rep_ms": 5}  # a handful of runs per row: pipeline, not numbers

TINY_CASES = [
    kb.Case("rms_norm", tokens=32, width=64, dtype="fp32"),
    kb.Case("add_rms_norm", tokens=32, width=64, dtype="fp32"),
    kb.Case("rotary", tokens=32, width=64, dtype="fp32", head_dim=16, seq_len=16),  # B=2, Hq=4, Hk=1
    kb.Case("swiglu", tokens=32, width=48, dtype="fp32"),
    kb.Case("geglu", tokens=32, width=48, dtype="fp32"),
    kb.Case("linear_cross_entropy", tokens=32, width=16, dtype="fp32", vocab=100),  # fwd and fwd+bwd only
]


def _tridist_exports_all() -> bool:
    from tridist import kernels

    return all(hasattr(kernels, name) for name in ("rms_norm", "apply_rotary_pos_emb", "swiglu", "geglu"))


# ------------------------------------------------------------------------------------------- full runs


def test_eager_run_writes_results_report_and_plot(tmp_path):
    df = kb.run_kernel_benchmark(cases=TINY_CASES, variants=["eager"], out_dir=tmp_path, progress=False,
                                 **FAST_TIMING)  # measures the copy bandwidth too

    results = tmp_path / "results.csv"
    assert results.exists()
    import pandas as pd

    saved = pd.read_csv(results)
    from tridist.bench.report import ROW_PROVENANCE

    # Each row also says where it was taken: device, driver, CUDA, torch, triton, tridist, date, commit.
    assert list(saved.columns) == [*kb.RESULT_COLUMNS, *(c for c in ROW_PROVENANCE if c not in kb.RESULT_COLUMNS)]
    stamps = saved[list(ROW_PROVENANCE)].astype(object).fillna("").astype(str)
    assert (stamps["torch"] == torch.__version__).all() and (stamps["date"].str.len() > 0).all()
    assert (stamps["commit"].str.len() == 40).all() and (stamps["tridist"].str.len() > 0).all()
    assert len(saved) == (len(TINY_CASES) - 1) * len(kb.MODES) + len(kb.LOSS_MODES)
    assert set(saved["op"]) == set(kb.OPS) and set(saved["mode"]) == set(kb.MODES)
    assert saved["time_ms"].notna().all() and (saved["time_ms"] > 0).all()
    assert (saved["gbps"] > 0).all() and (saved["pct_copy_bw"] > 0).all()
    assert saved["error"].isna().all()  # "" is read back as NaN
    assert df.attrs["meta"]["copy_bw_gbps"] > 0

    report = (tmp_path / "report.md").read_text()
    assert "- Device: CPU" in report and "Measured copy bandwidth" in report
    assert f"torch {torch.__version__}" in report
    for op in kb.OPS:
        assert f"## {op}" in report
    assert "| shape" in report and "eager ms" in report and "eager GB/s" in report
    assert (tmp_path / "plot.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.skipif(not _tridist_exports_all(), reason="kernels does not export every fused op yet")
def test_tridist_variant_runs_and_matches_eager():
    # fwd+bwd only: the check before timing already runs forward and backward once; the Triton
    # interpreter (TRITON_INTERPRET=1 in conftest) is slow.
    df = kb.run_kernel_benchmark(cases=TINY_CASES, variants=["eager", "tridist"], modes=["fwd+bwd"],
                                 copy_bw_gbps=10.0, progress=False, write_report=False, **FAST_TIMING)
    ours = df[df["variant"] == "tridist"]
    assert len(ours) == len(TINY_CASES)
    assert (ours["error"] == "").all(), ours.loc[ours["error"] != "", ["op", "mode", "error"]].to_string()
    assert ours["time_ms"].notna().all()
    eager = df[df["variant"] == "eager"]
    assert eager["tridist_speedup"].notna().all() and (ours["tridist_speedup"] == 1.0).all()


@pytest.mark.parametrize("mode", ["bwd", "fwd+bwd"])
def test_timed_backward_returns_gradients_instead_of_accumulating_them(mode):
    # add_rms_norm hands one tensor to x and residual; accumulated into two leaves' .grad, autograd copies it
    # for the second, a copy the op never makes inside a model. The timed backward must not accumulate.
    case = TINY_CASES[1]
    inputs = kb.make_inputs(case, torch.device("cpu"), requires_grad=True)
    timed = kb.make_timed_fn(kb.build_variant(case.op, "eager", device="cpu"), inputs, mode)
    grads = timed()
    assert len(inputs.grad_inputs) == 3 and all(t.grad is None for t in inputs.grad_inputs)
    assert len(grads) == 3 and all(g is not None and g.shape == t.shape for g, t in zip(grads, inputs.grad_inputs))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or _common.TRITON_INTERPRET, reason="CUDA events need a GPU"))])
def test_a_slow_call_is_timed_more_than_once(device):
    """do_bench sizes its runs to fill `rep` ms, so it times a 60 ms call once: time_ms keeps a floor of
    timed runs (CPU_MIN_REPS, CUDA_MIN_REPS) on top of the untimed first call, estimate and warm-up."""
    import time

    calls = []

    def slow():  # ~60 ms: the GPU spins for 1e8 cycles (~1.7 GHz), the CPU sleeps
        calls.append(1)
        torch.cuda._sleep(100_000_000) if device == "cuda" else time.sleep(0.06)

    assert kb.time_ms(slow, device=torch.device(device), warmup_ms=25, rep_ms=100) > 0
    untimed = 1 + 5 + 1 if device == "cuda" else 1 + 1  # first call, estimate, one warm-up
    assert len(calls) >= untimed + (kb.CUDA_MIN_REPS if device == "cuda" else kb.CPU_MIN_REPS)


def test_wrong_or_broken_variant_is_flagged(monkeypatch):
    """A variant that computes the wrong thing is timed but flagged; one that raises is not timed."""
    def wrong(x, y=None):
        return swiglu_reference(x, y) * 1.5

    def raises(x, y=None):
        raise RuntimeError("no kernel")

    broken = {"wrong": wrong, "raises": raises}
    monkeypatch.setattr(kb, "_tridist", lambda op: broken[which])
    case = [kb.Case("swiglu", tokens=8, width=16, dtype="fp32")]

    which = "wrong"
    df = kb.run_kernel_benchmark(cases=case, variants=["tridist"], modes=["fwd"], copy_bw_gbps=10.0,
                                 progress=False, write_report=False, **FAST_TIMING)
    assert df["error"].iloc[0].startswith("mismatch: output[0]")
    assert df["time_ms"].notna().all()

    which = "raises"
    df = kb.run_kernel_benchmark(cases=case, variants=["tridist"], modes=["fwd"], copy_bw_gbps=10.0,
                                 progress=False, write_report=False, **FAST_TIMING)
    assert "RuntimeError: no kernel" in df["error"].iloc[0]
    assert math.isnan(df["time_ms"].iloc[0])


def test_report_marks_errors_and_skips(tmp_path):
    from tridist.bench.report import render_kernel_markdown

    df = kb.run_kernel_benchmark(cases=TINY_CASES[3:4], variants=["eager", "liger"], modes=["fwd"],
                                 copy_bw_gbps=10.0, progress=False, write_report=False, **FAST_TIMING)
    df.loc[0, "error"] = "mismatch: output[0] relative error 0.5 > 0.001"
    text = render_kernel_markdown(df, df.attrs["meta"])
    assert "(!)" in text and "## Errors" in text
    assert "## Skipped variants" in text and "liger / swiglu" in text  # Liger needs a GPU


# ---------------------------------------------------------------------------------------------- bytes


def test_bytes_formulas_match_hand_counts():
    # rms_norm, T=4, H=8, bf16 (2 bytes): fwd reads x (32 elements), w (8), writes y (32)
    assert kb.rms_norm_bytes(tokens=4, hidden=8, elem_size=2, mode="fwd") == (32 + 8 + 32) * 2
    # bwd: read x, dy (32 each), w (8), rstd (4 rows x 4 bytes); write dx (32), dw (8)
    assert kb.rms_norm_bytes(tokens=4, hidden=8, elem_size=2, mode="bwd") == (32 + 32 + 8 + 32 + 8) * 2 + 16
    assert kb.rms_norm_bytes(tokens=4, hidden=8, elem_size=2, mode="fwd+bwd") == 144 + 240
    # add_rms_norm: fwd reads x, r, w, writes y, h; bwd reads dy, dh, h, w, rstd, writes dx, dw
    assert kb.add_rms_norm_bytes(tokens=4, hidden=8, elem_size=2, mode="fwd") == (32 * 4 + 8) * 2
    assert kb.add_rms_norm_bytes(tokens=4, hidden=8, elem_size=2, mode="bwd") == (32 * 3 + 8 + 32 + 8) * 2 + 16
    # rotary: B=2, S=3, Hq=4, Hk=1, D=8, bf16: q (192) + k (48) read and written, cos + sin (24 each) read
    one_pass = (2 * (192 + 48) + 2 * 24) * 2
    assert kb.rotary_bytes(batch=2, seq_len=3, q_heads=4, kv_heads=1, head_dim=8, elem_size=2, mode="fwd") == one_pass
    assert kb.rotary_bytes(batch=2, seq_len=3, q_heads=4, kv_heads=1, head_dim=8, elem_size=2, mode="bwd") == one_pass
    assert kb.bytes_moved(kb.Case("rotary", tokens=6, width=32, dtype="bf16", head_dim=8, seq_len=3),
                          "fwd+bwd") == 2 * one_pass
    # swiglu: T=4, I=6, fp32: fwd gate+up+out = 3*24*4; bwd dout+gate+up+dgate+dup = 5*24*4
    assert kb.swiglu_bytes(tokens=4, intermediate=6, elem_size=4, mode="fwd") == 288
    assert kb.swiglu_bytes(tokens=4, intermediate=6, elem_size=4, mode="bwd") == 480
    assert kb.bytes_moved(kb.Case("swiglu", tokens=4, width=6, dtype="fp32"), "fwd+bwd") == 768
    # linear_cross_entropy: T=4, H=8, V=10, bf16: reads hidden (32) + weight (80) elements and 4 int64 labels,
    # writes an fp32 loss; the backward writes their two gradients (112 elements)
    case = kb.Case("linear_cross_entropy", tokens=4, width=8, dtype="bf16", vocab=10)
    assert kb.bytes_moved(case, "fwd") == 112 * 2 + 32 + 4
    assert kb.bytes_moved(case, "fwd+bwd") == 2 * 112 * 2 + 32 + 4
    assert kb.linear_cross_entropy_flops(case, "fwd") == 2 * 4 * 8 * 10
    assert kb.linear_cross_entropy_flops(case, "fwd+bwd") == 3 * 2 * 4 * 8 * 10
    with pytest.raises(ValueError, match="needs a vocab"):
        kb.Case("linear_cross_entropy", tokens=4, width=8)


def test_default_grids():
    cuda = kb.default_cases(device_type="cuda")
    assert len(cuda) == (len(kb.OPS) - 1) * 9 + len(kb.CUDA_LOSS_SHAPES) and {c.dtype for c in cuda} == {"bf16"}
    assert [c.shape for c in cuda if c.op == "linear_cross_entropy"] == [
        "T=4096 H=2048 V=32000", "T=8192 H=4096 V=128256", "T=16384 H=4096 V=128256"]
    assert [c.shape for c in kb.default_cases(device_type="cuda", quick=True, ops=["linear_cross_entropy"])] == [
        "T=8192 H=4096 V=128256"]  # the headline shape
    rotary = [c for c in cuda if c.op == "rotary" and c.tokens == 65536 and c.width == 8192][0]
    assert rotary.shape == "B=16 S=4096 Hq=64 Hk=16 D=128"
    assert {c.width for c in cuda if c.op == "swiglu"} == {5632, 11008, 22016}
    cpu_quick = kb.default_cases(device_type="cpu", quick=True, ops=["swiglu"])
    assert len(cpu_quick) == 1 and cpu_quick[0].dtype == "fp32"
    with pytest.raises(ValueError, match="valid ops: rms_norm, add_rms_norm, rotary, swiglu"):
        kb.default_cases(device_type="cpu", ops=["layer_norm"])


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_parses_bench_kernels_arguments(capsys):
    args = cli.build_parser().parse_args(
        ["bench", "kernels", "--ops", "rms_norm,swiglu", "--dtype", "fp32", "--device", "cpu", "--quick",
         "--no-compile", "--out", "somewhere"])
    assert args.ops == ["rms_norm", "swiglu"] and args.dtype == "fp32" and args.device == "cpu"
    assert args.quick and not args.compile and args.out == "somewhere"
    defaults = cli.build_parser().parse_args(["bench", "kernels"])
    assert defaults.ops is None and defaults.compile and defaults.device == "auto"
    assert cli.KERNEL_OPS == kb.OPS and set(cli.KERNEL_DTYPES) == set(kb.DTYPES)
    from tridist.autotune import kernel_sweep

    assert cli.SWEPT_OPS == kernel_sweep.OPS
    for ops, message in (("geglu", "sweep swiglu"), ("linear_cross_entropy", "valid ops: rms_norm")):
        with pytest.raises(SystemExit):
            cli.main(["autotune", "kernels", "--ops", ops])
        assert message in capsys.readouterr().err


def test_cli_rejects_unknown_op_naming_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "kernels", "--ops", "rms_norm,layer_norm"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown op(s): layer_norm" in err
    assert "valid ops: rms_norm, add_rms_norm, rotary, swiglu" in err


def test_cli_runs_and_prints_the_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kb, "default_cases", lambda **kwargs: TINY_CASES[:1])
    monkeypatch.setattr(kb, "measure_copy_bandwidth", lambda device: 10.0)
    status = cli.main(["bench", "kernels", "--device", "cpu", "--quick", "--no-compile", "--out", str(tmp_path)])
    assert status == 0
    out = capsys.readouterr().out
    assert "# Kernel benchmark" in out and "## rms_norm" in out
    assert f"report: {tmp_path}" in out
    assert (tmp_path / "results.csv").exists()


# -------------------------------------------------------------------------------------------- compile


@pytest.mark.slow
def test_compile_variant_on_the_smallest_case():
    """torch.compile on one tiny case (~5-15 s of CPU compilation): "bwd" (retain_graph=True) works on
    the compiled backward; "fwd" (one more compilation, of the inference graph) is left to the main job."""
    df = kb.run_kernel_benchmark(cases=[kb.Case("swiglu", tokens=8, width=16, dtype="fp32")],
                                 variants=["compile"], modes=["bwd", "fwd+bwd"], copy_bw_gbps=10.0,
                                 progress=False, write_report=False, **FAST_TIMING)
    assert (df["error"] == "").all(), df["error"].tolist()
    assert df["time_ms"].notna().all()


def test_launch_benchmark_times_every_op_against_torch_mul_and_restores_the_launcher(tmp_path):
    """`tridist bench launch`: host time per op with the Triton launch stubbed out, ratios to torch.mul in the
    same run, report and plot; afterwards launches and the CPU path are as they were."""
    from triton.runtime.jit import KernelInterface

    from tridist.bench.launch import run_launch_benchmark
    from tridist.kernels import _common

    saved = KernelInterface.__getitem__, _common.TRITON_INTERPRET, _common._current_device, _common._current_stream
    frame = run_launch_benchmark(calls=20, repeats=1, out_dir=tmp_path)
    ops = ["rms_norm", "add_rms_norm", "rotary", "swiglu"]
    assert list(frame.index) == ["torch.mul", "minimal autograd.Function", "torch F.layer_norm", "torch F.rms_norm", *ops]
    assert (frame[["fwd_us", "fwd_bwd_us"]] > 0).all().all() and frame.loc["torch.mul", "fwd_x_mul"] == 1.0
    # Each op beside its torch part (what its autograd.Function costs torch), which launches nothing.
    floors = frame.loc[ops, ["floor_fwd_x_mul", "floor_fwd_bwd_x_mul", "ours_fwd_us", "ours_fwd_bwd_us"]]
    assert floors.notna().all().all() and (floors[["floor_fwd_x_mul", "floor_fwd_bwd_x_mul"]] > 0).all().all()
    assert {p.name for p in tmp_path.iterdir()} == {"results.csv", "report.md", "plot.png"}
    assert "| rotary |" in (tmp_path / "report.md").read_text()
    assert (KernelInterface.__getitem__, _common.TRITON_INTERPRET, _common._current_device,
            _common._current_stream) == saved


def test_stubbed_launches_run_the_direct_launch_as_on_a_gpu():
    """Inside `stubbed_launches` a compiled (JIT) kernel's launches reach Triton's launcher, stubbed, as on a GPU:
    the first through the JIT (`kernel[grid]`, stubbed), the next ones by the direct launch
    (Launch.launch's `_CompiledLaunch`), so the benchmark times the launch path a GPU runs."""
    import types

    from triton.runtime.jit import KernelInterface

    from tridist.bench import launch as bench_launch
    from tridist.kernels._common import Launch

    names = ["x_ptr", "n_rows", "BLOCK"]
    kernel = type("JITFunction", (KernelInterface,), {  # what `triton.jit` makes outside the interpreter
        "arg_names": names, "pre_run_hooks": [],
        "params": [types.SimpleNamespace(name=n, default=None, is_constexpr=n == "BLOCK") for n in names]})()
    runs = []
    with bench_launch.stubbed_launches(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_launch._NoLaunch, "run", staticmethod(lambda *args: runs.append(args)))
        plan, x = Launch((3,), dict(n_rows=4, BLOCK=64)), torch.zeros(8)
        for _ in range(3):
            plan.launch(kernel, x)
    assert len(runs) == 2 and runs[0][:3] == (3, 1, 1) and runs[0][-3:] == (x, 4, 64), runs


def test_linear_cross_entropy_rows_carry_peak_memory_and_the_matmul_share(tmp_path, monkeypatch):
    """The fused loss against eager linear + F.cross_entropy: checked, timed in fwd and fwd+bwd only, each row
    with its peak memory (MemTracker) and its share of torch.mm's rate. 1024 tokens x vocabulary 2000 (fp32):
    eager holds the [1024, 2000] logits and their log-softmax (8 MB each), the fused op one chunk of 128
    tokens (1 MB) and, with gradients, the gradients themselves (32 KB + 64 KB): below a third of eager's
    peak on any machine. The op takes its CPU path (what a CPU user's benchmark runs: the same chunk loop,
    PyTorch math in place of the kernels, which tests/test_linear_cross_entropy.py checks in the interpreter);
    interpreted, its timed calls cost two CPU-minutes of the suite."""
    monkeypatch.setattr(_common, "TRITON_INTERPRET", False)
    case = kb.Case("linear_cross_entropy", tokens=1024, width=8, dtype="fp32", vocab=2000)
    df = kb.run_kernel_benchmark(cases=[case], variants=["eager", "tridist"], out_dir=tmp_path, progress=False,
                                 copy_bw_gbps=10.0, **FAST_TIMING)
    assert sorted(zip(df["variant"], df["mode"])) == [
        ("eager", "fwd"), ("eager", "fwd+bwd"), ("tridist", "fwd"), ("tridist", "fwd+bwd")]
    assert (df["error"].fillna("") == "").all(), df["error"].tolist()
    assert (df["pct_matmul"] > 0).all() and (df["tflops"] > 0).all() and (df["vocab"] == 2000).all()
    peak = df.set_index(["variant", "mode"])["peak_mib"]
    for mode in ("fwd", "fwd+bwd"):
        assert 0 < peak["tridist", mode] < peak["eager", mode] / 3, peak.to_dict()
    report = (tmp_path / "report.md").read_text()
    assert "tridist % matmul" in report and "eager peak MiB" in report
    assert (tmp_path / "plot.png").read_bytes().startswith(PNG_MAGIC)
