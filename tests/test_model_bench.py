"""`tridist bench model` on tiny CPU sizes: rows, report files, the correctness gate and the CLI.

Timing numbers are not checked (CPU, shared machine). What is checked: every row is filled and
stamped with its provenance, an unavailable variant is a row with its reason, a variant that
computes something else is an error row and is not timed, and the CLI writes its files and exit
status. Most tests run the fused kernels' PyTorch path (conftest sets TRITON_INTERPRET=1, whose
interpreter takes ~0.5 s per tiny step); one runs them in Triton's interpreter.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tridist import kernels
from tridist.bench import cli
from tridist.bench import model_bench as mb
from tridist.bench.models import hf_llama
from tridist.bench.report import ROW_PROVENANCE
from tridist.kernels import _common

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST_TIMING = {"warmup_ms": 1, "rep_ms": 1}  # the minimum of 5 timed steps per row
TINY = mb.ModelSize(hidden=32, heads=2, kv_heads=1, intermediate=64, layers=1, vocab=64, batch=1, seq=8)
SIZES = {"layer": TINY, "model": mb.dataclasses.replace(TINY, layers=2), "hf-model": mb.dataclasses.replace(TINY, layers=2),
         "hf-moe": mb.dataclasses.replace(TINY, layers=2, experts=4, top_k=2)}


@pytest.fixture
def torch_path(monkeypatch):
    """The fused ops' PyTorch implementation for CPU tensors instead of the (slow) Triton interpreter."""
    monkeypatch.setattr(_common, "TRITON_INTERPRET", False)


def _run(**kwargs):
    kwargs = {"device": "cpu", "sizes": SIZES, "targets": ("layer", "model"), "progress": False, **FAST_TIMING, **kwargs}
    kwargs.setdefault("write_report", "out_dir" in kwargs)
    return mb.run_model_benchmark(**kwargs)


def _row(df, target, variant):
    rows = df[(df["target"] == target) & (df["variant"] == variant)]
    assert len(rows) == 1, rows
    return rows.iloc[0]


def _perturbing(factor, *, gradient_only=False):
    """A variant builder for eager's module whose output (loss, or the layer's output) is off by
    `factor`; with gradient_only, the output is right and every gradient is off by `factor`."""

    def perturb(t):
        return t.detach() + (t - t.detach()) * factor if gradient_only else t * factor

    def build(module, *, device):
        def fn(*args, **kwargs):
            out = module(*args, **kwargs)
            return (perturb(out[0]), out[1]) if isinstance(out, tuple) else perturb(out)

        return mb.Built(fn, module, "planted")

    return build


# ------------------------------------------------------------------------------------------- full runs


def test_cli_writes_rows_report_and_plot_of_every_target(tmp_path, monkeypatch, torch_path, capsys):
    """`tridist bench model` with its defaults (every target), at the tests' sizes and shortest timing."""
    monkeypatch.setattr(mb, "CPU_QUICK_SIZES", SIZES)
    monkeypatch.setattr(mb, "CPU_WARMUP_MS", FAST_TIMING["warmup_ms"])
    monkeypatch.setattr(mb, "CPU_REP_MS", FAST_TIMING["rep_ms"])
    status = cli.main(["bench", "model", "--device", "cpu", "--quick", "--no-compile",
                       "--variants", "eager,compile,liger,fused", "--out", str(tmp_path)])
    assert status == 0
    captured = capsys.readouterr()
    assert "# Model benchmark" in captured.out and f"report: {tmp_path}" in captured.out

    import pandas as pd

    saved = pd.read_csv(tmp_path / "results.csv")
    assert list(saved.columns) == [*mb.RESULT_COLUMNS, *(c for c in ROW_PROVENANCE if c not in mb.RESULT_COLUMNS)]
    assert list(saved["variant"]) == ["eager", "liger", "fused"] * 4  # --no-compile dropped compile
    assert list(saved.groupby("target", sort=False)["shape"].first()) == [SIZES[t].label(t) for t in mb.TARGETS]
    assert list(saved["target"]) == ["layer"] * 3 + ["model"] * 3 + ["hf-model"] * 3 + ["hf-moe"] * 3
    stamps = saved[list(ROW_PROVENANCE)].astype(object).fillna("").astype(str)
    assert (stamps["torch"] == torch.__version__).all() and (stamps["date"].str.len() > 0).all()
    assert (stamps["commit"].str.len() == 40).all() and (stamps["tridist"].str.len() > 0).all()
    assert (stamps["device"].str.startswith("CPU")).all()

    ran = saved[saved["variant"] != "liger"]
    assert (ran["status"] == "ok").all(), ran[["target", "variant", "error"]]
    assert (ran["time_ms"] > 0).all() and (ran["tokens_per_s"] > 0).all() and (ran["tflops"] > 0).all()
    assert (ran["tokens"] == 8).all() and (ran["params"] > 0).all()
    # MemTracker's on a CPU, the module's and the optimizer's tensors included: at the peak every fp32 weight
    # has its gradient (the layer's step), and in a model's AdamW step also its two states.
    states = ran["target"].map({"layer": 2, "model": 4, "hf-model": 4, "hf-moe": 4})
    assert (ran["peak_mem_gib"] * 2**30 >= states * ran["params"] * 4).all(), ran[["target", "variant", "peak_mem_gib"]]
    assert ran["mfu_pct"].isna().all()  # a CPU has no datasheet peak: not faked
    assert (ran["grad_err"] <= ran["grad_tol"]).all() and (ran["out_err"] <= ran["out_tol"]).all()
    assert (saved.loc[saved["variant"] == "eager", "speedup_vs_eager"] == 1.0).all()
    assert saved["speedup_vs_compile"].isna().all()  # compile did not run
    fused = _row(saved, "model", "fused")
    assert "rms_norm" in fused["detail"] and "swiglu" in fused["detail"] and "rotary" in fused["detail"]
    model_eager = _row(saved, "model", "eager")
    assert math.isclose(fused["loss"], model_eager["loss"], rel_tol=1e-5) and model_eager["loss"] > 0
    assert math.isnan(_row(saved, "layer", "eager")["loss"])
    hf_fused, hf_eager = _row(saved, "hf-model", "fused"), _row(saved, "hf-model", "eager")
    assert "linear_cross_entropy" in hf_fused["detail"] and "linear_cross_entropy" not in fused["detail"]
    assert math.isclose(hf_fused["loss"], hf_eager["loss"], rel_tol=1e-5) and hf_eager["loss"] > 0
    moe_fused = _row(saved, "hf-moe", "fused")
    assert "2 swiglu experts" in moe_fused["detail"] and "linear_cross_entropy" in moe_fused["detail"]
    assert "E=4 k=2" in moe_fused["shape"]

    liger = saved[saved["variant"] == "liger"]  # unavailable here: a row with the reason, not timed
    assert (liger["status"] == "unavailable").all() and liger["time_ms"].isna().all()
    assert liger["error"].str.contains("GPUs only").all()

    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# Model benchmark") and "- Device: CPU" in report
    assert f"torch {torch.__version__}" in report and "## layer" in report and "## model" in report
    assert "## hf-model" in report and "## hf-moe" in report
    assert "| variant" in report and "tokens/s" in report and "unavailable: Liger-Kernel runs on GPUs only" in report
    assert (tmp_path / "plot.png").read_bytes()[:8] == PNG_MAGIC
    assert "[layer] fused:" in captured.err and "[model] liger: unavailable" in captured.err  # progress


def test_hf_model_gives_the_peak_memory_with_and_without_the_fused_loss(torch_path):
    """transformers' Llama, fused with and without its LM head + loss: 2 x 256 tokens x vocabulary 4096 (fp32),
    so the logits L are 8 MiB. Without the fused loss the step holds the logits and their gradient (2 L) on
    top of what every variant holds (weights, gradients, AdamW states: 4 x ~1.1 MiB, plus small activations);
    the fused loss holds one chunk of 128 tokens (L / 4) and its gradient, so its peak is at least L below.
    Where fuse fuses no loss (the replica's `model`), fused-no-lce is a row that says so."""
    size = mb.ModelSize(hidden=32, heads=2, kv_heads=1, intermediate=64, layers=1, vocab=4096, batch=2, seq=256)
    df = _run(targets=["hf-model", "model"], variants=["eager", "fused-no-lce", "fused"],
              sizes={**SIZES, "hf-model": size})
    hf = df[df["target"] == "hf-model"].set_index("variant")
    assert (hf["status"] == "ok").all(), hf["error"]
    assert "linear_cross_entropy" not in hf.loc["fused-no-lce", "detail"] and "rms_norm" in hf.loc["fused-no-lce", "detail"]
    assert "linear_cross_entropy" in hf.loc["fused", "detail"]
    logits_gib = size.tokens * size.vocab * 4 / 2**30
    assert hf.loc["fused", "peak_mem_gib"] < hf.loc["fused-no-lce", "peak_mem_gib"] - logits_gib, hf["peak_mem_gib"]
    assert hf.loc["fused-no-lce", "peak_mem_gib"] > hf.loc["eager", "peak_mem_gib"] - logits_gib / 2
    replica = _row(df, "model", "fused-no-lce")
    assert replica["status"] == "unavailable" and "fuses no loss in model" in replica["error"]


def test_cpu_peak_memory_counts_the_module_and_the_optimizer_state():
    """An AdamW step on a 256 x 256 linear layer whose gradient is set: at its peak the weight, its gradient and
    both AdamW states (4 x 256 KiB) exist, while the step itself allocates about one more weight-sized
    temporary (foreach AdamW's square root; its other updates are in place). MemTracker counts the four only
    when told of the module and the optimizer."""

    class OptimizerStep(mb.Target):
        name = "optimizer-step"

        def make_step(self, fn, module, batch):
            module.weight.grad = torch.ones_like(module.weight)
            optimizer = torch.optim.AdamW(module.parameters(), foreach=True)
            return optimizer.step, [], [module, optimizer]

    module = torch.nn.Linear(256, 256, bias=False)
    _, peak_gib = mb._time_variant(OptimizerStep(), mb.Built(module, module), {}, device=torch.device("cpu"),
                                   **FAST_TIMING)
    assert peak_gib * 2**30 >= 4 * module.weight.numel() * 4, peak_gib * 2**20


def test_experts_loop_variant_runs_the_experts_as_a_loop_and_equals_eager(torch_path):
    """fused-experts-loop on transformers' Mixtral in bf16: fuse, then every fused experts module loops where fused
    runs grouped GEMMs (here torch's CPU kernel: bf16 rows of 32 and 64 are 16-byte multiples); it computes
    eager's loss and gradients within the bf16 tolerance. Where it would equal fused (fp32; bf16 rows of 12 x 2
    bytes; no experts) it says so."""
    cpu = torch.device("cpu")
    target = mb.make_target("hf-moe", SIZES["hf-moe"])
    torch.manual_seed(0)
    base = target.build("cpu", torch.bfloat16)
    batch = target.batch("cpu", torch.bfloat16)
    reference = mb._reference(target, base, batch, device=cpu, dtype=torch.bfloat16)
    built = mb.VARIANT_BUILDERS["fused-experts-loop"](copy.deepcopy(base), device=cpu)
    experts = [m for m in built.module.modules() if isinstance(m, kernels.FusedSwiGLUExperts)]
    assert len(experts) == 2 and all(m.grouped_mm is False for m in experts) and "experts as a loop" in built.detail
    out_err, grad_err, worst = mb.compare(target.check_run(built.fn, built.module, batch), reference.run)
    assert out_err <= reference.out_tol and grad_err <= reference.grad_tol, (out_err, grad_err, worst)

    unaligned = mb.make_target("hf-moe", mb.dataclasses.replace(SIZES["hf-moe"], intermediate=12)).build("cpu", torch.bfloat16)
    for model in (unaligned, target.build("cpu", torch.float32)):
        with pytest.raises(mb.VariantUnavailable, match="the same as fused here: fused loops over the experts too"):
            mb.VARIANT_BUILDERS["fused-experts-loop"](model, device=cpu)
    assert "layer has no experts" in mb._same_as_fused("fused-experts-loop", mb.make_target("layer", TINY))
    with pytest.raises(mb.VariantUnavailable, match="no stacked experts"):
        mb.VARIANT_BUILDERS["fused-experts-loop"](mb.make_target("hf-model", SIZES["hf-model"]).build("cpu", torch.float32),
                                                  device=cpu)


def test_hf_model_without_transformers_is_a_row_with_the_reason(monkeypatch, torch_path):
    monkeypatch.setattr(mb.HFModelTarget, "unavailable", staticmethod(lambda: "transformers is not installed"))
    df = _run(targets=["hf-model"], variants=["eager", "fused"])
    assert (df["status"] == "unavailable").all() and (df["error"] == "transformers is not installed").all()
    assert mb.exit_status(df) == 1  # nothing ran


def test_a_wrong_variant_is_an_error_row_and_not_timed(monkeypatch, torch_path):
    monkeypatch.setitem(mb.VARIANT_BUILDERS, "fused", _perturbing(1.01))
    df = _run(variants=["eager", "fused"])
    for target in ("layer", "model"):
        wrong = _row(df, target, "fused")
        assert wrong["status"] == "mismatch" and wrong["error"].startswith("mismatch:")
        assert wrong["out_err"] > wrong["out_tol"]
        assert math.isnan(wrong["time_ms"]) and math.isnan(wrong["tokens_per_s"])
        assert math.isnan(wrong["speedup_vs_eager"])
        assert _row(df, target, "eager")["status"] == "ok"
    assert mb.exit_status(df) == 1


def test_wrong_gradients_alone_are_flagged(monkeypatch, torch_path):
    monkeypatch.setitem(mb.VARIANT_BUILDERS, "fused", _perturbing(1.05, gradient_only=True))
    df = _run(variants=["fused"])  # eager's reference runs whether or not eager is a row
    assert list(df["variant"]) == ["fused", "fused"]
    for target in ("layer", "model"):
        wrong = _row(df, target, "fused")
        assert wrong["out_err"] == 0 and wrong["grad_err"] > wrong["grad_tol"]
        assert wrong["status"] == "mismatch" and "gradient error" in wrong["error"]
        assert math.isnan(wrong["time_ms"])


def test_a_broken_variant_is_a_failed_row_and_the_others_run(monkeypatch, torch_path):
    def broken(module, *, device):
        raise RuntimeError("no kernel for you")

    monkeypatch.setitem(mb.VARIANT_BUILDERS, "fused", broken)
    df = _run(targets=["layer"], variants=["eager", "fused", "liger"])
    row = _row(df, "layer", "fused")
    assert row["status"] == "failed" and "RuntimeError: no kernel for you" in row["error"]
    assert math.isnan(row["time_ms"])
    assert _row(df, "layer", "eager")["status"] == "ok"
    assert mb.exit_status(df) == 0  # failed and unavailable rows alone do not fail the run
    assert mb.exit_status(df[df["variant"] != "eager"]) == 1  # nothing ran cleanly


def test_fused_variant_in_the_triton_interpreter():
    assert _common.TRITON_INTERPRET  # conftest: the real Triton kernels, interpreted
    df = _run(targets=["layer"], variants=["eager", "fused"])
    fused = _row(df, "layer", "fused")
    assert fused["status"] == "ok", fused["error"]
    assert fused["grad_err"] <= mb.TOLERANCE_FLOOR[torch.float32]["grad"]


def test_compile_variant_runs_and_gives_the_compile_speedups(torch_path):
    df = _run(targets=["layer"], variants=["eager", "compile"])  # the file's one compilation (~10 s)
    assert set(df["status"]) == {"ok"}, df[["variant", "error"]]
    compiled = _row(df, "layer", "compile")
    assert compiled["speedup_vs_compile"] == 1.0 and compiled["setup_s"] > 0
    assert _row(df, "layer", "eager")["speedup_vs_compile"] > 0


def test_bf16_tolerance_is_calibrated_against_fp32(torch_path):
    df = _run(targets=["model"], variants=["eager", "fused"], dtype="bf16")
    assert set(df["status"]) == {"ok"}, df[["variant", "error"]]
    assert (df["dtype"] == "bf16").all()
    eager = _row(df, "model", "eager")
    floor = mb.TOLERANCE_FLOOR[torch.bfloat16]
    assert eager["grad_tol"] >= floor["grad"] and eager["grad_tol"] > 0.01  # bf16 rounding noise x 4
    assert _row(df, "model", "fused")["grad_err"] > 0  # a different rounding order, within tolerance


def test_tolerances():
    floor = mb.TOLERANCE_FLOOR[torch.bfloat16]
    assert mb.tolerances(torch.bfloat16, (1e-3, 5e-3)) == (4e-3, 2e-2)
    assert mb.tolerances(torch.bfloat16, (1e-7, 1e-4)) == (floor["out"], floor["grad"])
    assert mb.tolerances(torch.float32, None) == (1e-5, 1e-4)
    assert mb.tolerances(torch.bfloat16, (math.nan, math.inf)) == (floor["out"], floor["grad"])


def test_flops_count():
    size = mb.ModelSize(hidden=8, heads=2, kv_heads=1, intermediate=16, layers=3, vocab=10, batch=2, seq=5)
    # 6 x 100 weights x 10 tokens + 12 x layers x S x Hq x D x tokens
    assert mb.step_flops("model", size, 100) == 6 * 100 * 10 + 12 * 3 * 5 * 2 * 4 * 10
    assert mb.step_flops("layer", size, 100) == 6 * 100 * 10 + 12 * 1 * 5 * 2 * 4 * 10


# ----------------------------------------------------------------------------------------------- Liger


def test_liger_swap_keeps_parameters_and_catches_a_wrong_rope():
    """The module swap, with our own classes standing in for Liger's (Liger needs a GPU): parameters
    stay the same objects, only the instances' rotary call changes, and the check catches a rope
    that does nothing (through the gradients: the first-step loss barely moves at initialisation)."""
    target = mb.make_target("model", SIZES["model"])
    torch.manual_seed(0)
    base = target.build("cpu", torch.float32)
    batch = target.batch("cpu", torch.float32)
    reference = mb._reference(target, base, batch, device=torch.device("cpu"), dtype=torch.float32)

    same = copy.deepcopy(base)
    params = {name: id(p) for name, p in same.named_parameters()}
    counts = mb.swap_liger_modules(same, rms_norm_cls=hf_llama.LlamaRMSNorm, swiglu_mlp_cls=hf_llama.LlamaMLP,
                                   rotary_fn=hf_llama.apply_rotary_pos_emb)
    assert counts == {"rms_norm": 5, "swiglu": 2, "rotary": 2}
    assert {name: id(p) for name, p in same.named_parameters()} == params
    out_err, grad_err, _ = mb.compare(target.check_run(same, same, batch), reference.run)
    assert out_err == 0 and grad_err == 0

    no_rope = copy.deepcopy(base)
    mb.swap_liger_modules(no_rope, rms_norm_cls=hf_llama.LlamaRMSNorm, swiglu_mlp_cls=hf_llama.LlamaMLP,
                          rotary_fn=lambda q, k, cos, sin, *args, **kwargs: (q, k))
    assert hf_llama.LlamaAttention.forward.__globals__["apply_rotary_pos_emb"] is hf_llama.apply_rotary_pos_emb
    out_err, grad_err, worst = mb.compare(target.check_run(no_rope, no_rope, batch), reference.run)
    assert grad_err > 100 * reference.grad_tol and "self_attn" in worst
    assert out_err < 1e-2  # the loss alone would not tell at bf16's tolerance


def test_liger_variant_is_unavailable_on_cpu():
    with pytest.raises(mb.VariantUnavailable, match="GPUs only"):
        mb.VARIANT_BUILDERS["liger"](torch.nn.Linear(2, 2), device=torch.device("cpu"))


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_exits_1_when_a_variant_disagrees(tmp_path, monkeypatch, torch_path):
    monkeypatch.setitem(mb.VARIANT_BUILDERS, "fused", _perturbing(0.9))
    monkeypatch.setattr(mb, "CPU_QUICK_SIZES", {"layer": TINY, "model": TINY})
    status = cli.main(["bench", "model", "--device", "cpu", "--quick", "--targets", "layer",
                       "--variants", "eager,fused", "--out", str(tmp_path)])
    assert status == 1
    assert "mismatch:" in (tmp_path / "report.md").read_text()


def test_cli_names_agree_with_the_module():
    args = cli.build_parser().parse_args(["bench", "model", "--targets", ",".join(mb.TARGETS),
                                          "--variants", ",".join(mb.VARIANTS)])
    assert args.targets == list(mb.TARGETS) and args.variants == list(mb.VARIANTS)
    assert args.compile and args.device == "auto" and args.dtype is None


@pytest.mark.parametrize("argv, message", [
    (["--variants", "eager,triton"], "valid variants: eager, compile, liger, fused-no-lce, fused-experts-loop, fused, "
                                     "fused+compile"),
    (["--targets", "block"], "valid targets: layer, model, hf-model, hf-moe"),
])
def test_cli_rejects_unknown_names(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "model", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


