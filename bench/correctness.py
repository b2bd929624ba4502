"""`tridist check kernels`: the fused ops' forward and backward against the references, at real sizes.

The test suite checks the kernels in Triton's CPU interpreter on small shapes. On a GPU this sweep
checks the *compiled* kernels, in bf16/fp16/fp32, on the shapes training uses (hidden 4096-65536,
GQA rotary with positions, SwiGLU at Llama widths, strided views), with the tests' criterion
(kernels.testing): at most twice the eager reference's own error against an fp64 gold, plus one ulp.
Writes results.csv and report.md; exits non-zero when any comparison fails.
"""

from __future__ import annotations

import datetime
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tridist.kernels.reference import geglu_reference, rms_norm_reference, rotary_reference, swiglu_reference
from tridist.kernels.testing import compare_with_reference, upcast

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Case:
    """One comparison: `make(dtype, device)` returns (inputs, kwargs) for `op` and its reference."""

    op: str
    label: str
    make: Callable
    ours: Callable
    reference: Callable
    requires_grad: tuple[int, ...] = field(default=(0,))


def _rand(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _rope_tables(length: int, dim: int, device):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def cases(*, quick: bool, device_type: str) -> list[Case]:
    """Realistic shapes on a GPU; small ones (Triton interpreter) elsewhere. Odd sizes on purpose."""
    from tridist import kernels

    big = device_type == "cuda" and not quick
    norm_shapes = [(4096, 4096), (2048, 8192), (7, 65536), (333, 5120)] if big else [(64, 256), (3, 4100)]
    mlp_shapes = [(8192, 11008), (4096, 14336), (999, 1376)] if big else [(64, 176)]
    rope_shapes = [(2, 2048, 32, 8, 128), (1, 4096, 64, 8, 128)] if big else [(2, 16, 4, 2, 32)]  # B, S, Hq, Hk, D
    found = []
    for tokens, hidden in norm_shapes:
        for residual in (False, True):
            def make(dtype, device, tokens=tokens, hidden=hidden, residual=residual):
                args = [_rand(tokens, hidden, dtype=dtype, device=device), (torch.rand(hidden, device=device) + 0.5).to(dtype)]
                kwargs = {"residual": _rand(tokens, hidden, dtype=dtype, device=device)} if residual else {}
                return args, kwargs

            found.append(Case("rms_norm", f"T={tokens} H={hidden}{' +residual' if residual else ''}", make,
                              kernels.rms_norm, rms_norm_reference, requires_grad=(0, 1)))
    for tokens, width in mlp_shapes:
        def make(dtype, device, tokens=tokens, width=width):
            return [_rand(tokens, width, dtype=dtype, device=device, scale=3.0), _rand(tokens, width, dtype=dtype, device=device)], {}

        def make_packed(dtype, device, tokens=tokens, width=width):
            # The packed input is a strided slice of a wider buffer: no copy is allowed to hide there.
            wide = _rand(tokens, 2 * width + 8, dtype=dtype, device=device, scale=3.0)
            return [wide[:, 4 : 4 + 2 * width]], {}

        found.append(Case("swiglu", f"T={tokens} I={width}", make, kernels.swiglu, swiglu_reference, requires_grad=(0, 1)))
        found.append(Case("swiglu", f"T={tokens} packed strided 2I={2 * width}", make_packed, kernels.swiglu, swiglu_reference))
        found.append(Case("geglu", f"T={tokens} I={width}", make, kernels.geglu, geglu_reference, requires_grad=(0, 1)))
        found.append(Case("geglu", f"T={tokens} packed strided 2I={2 * width}", make_packed, kernels.geglu, geglu_reference))
    for batch, seq, q_heads, kv_heads, head_dim in rope_shapes:
        for layout, with_positions in (("bshd", True), ("bhsd", False)):
            def make(dtype, device, b=batch, s=seq, hq=q_heads, hk=kv_heads, d=head_dim, layout=layout, with_positions=with_positions):
                shape = (lambda h: (b, s, h, d)) if layout == "bshd" else (lambda h: (b, h, s, d))
                cos, sin = _rope_tables(s + 64, d, device)
                kwargs = {"layout": layout}
                if with_positions:
                    kwargs["position_ids"] = torch.randint(0, s + 64, (b, s), device=device)
                return [_rand(*shape(hq), dtype=dtype, device=device), _rand(*shape(hk), dtype=dtype, device=device), cos, sin], kwargs

            found.append(Case("rotary", f"B={batch} S={seq} Hq={q_heads} Hk={kv_heads} D={head_dim} {layout}"
                              f"{' positions' if with_positions else ''}", make, kernels.apply_rotary_pos_emb, rotary_reference,
                              requires_grad=(0, 1)))
    return found


def _forward_backward(fn, args, kwargs, requires_grad, grads):
    args = [a.detach().requires_grad_(i in requires_grad) if torch.is_tensor(a) and a.is_floating_point() else a
            for i, a in enumerate(args)]
    kwargs = {k: v.detach().requires_grad_(True) if k == "residual" else v for k, v in kwargs.items()}
    outs = fn(*args, **kwargs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    leaves = [args[i] for i in requires_grad] + ([kwargs["residual"]] if "residual" in kwargs else [])
    if grads is None:
        grads = [torch.randn_like(o) for o in outs]
    in_grads = torch.autograd.grad(outs, leaves, grads[: len(outs)])
    named = [(f"out{i}", o) for i, o in enumerate(outs)] + [(f"grad{i}", g) for i, g in enumerate(in_grads)]
    return named, grads


def check_case(case: Case, dtype: torch.dtype, device: torch.device, seed: int = 0) -> list[dict]:
    torch.manual_seed(seed)
    args, kwargs = case.make(dtype, device)
    reference, grads = _forward_backward(case.reference, args, kwargs, case.requires_grad, None)
    ours, _ = _forward_backward(case.ours, args, kwargs, case.requires_grad, grads)
    gold_args = [upcast(a) for a in args]
    gold_kwargs = {k: upcast(v) if k == "residual" else v for k, v in kwargs.items()}
    gold, _ = _forward_backward(case.reference, gold_args, gold_kwargs, case.requires_grad, [g.double() for g in grads])
    rows = []
    for (name, o), (_, r), (_, g) in zip(ours, reference, gold):
        result = compare_with_reference(o, r, g)
        rows.append({"op": case.op, "case": case.label, "dtype": str(dtype).removeprefix("torch."), "tensor": name, **result})
    return rows


def run_correctness_check(*, device: torch.device, dtypes: list[torch.dtype], quick: bool = False,
                          out_dir: str | None = None, progress: bool = True):
    """Run every case in every dtype; returns a DataFrame and writes results.csv + report.md."""
    import pandas as pd

    from tridist.bench.report import markdown_table

    all_cases = cases(quick=quick, device_type=device.type)
    rows = []
    for number, case in enumerate(all_cases, 1):
        for dtype in dtypes:
            if progress:
                print(f"[{number}/{len(all_cases)}] {case.op} {case.label} {dtype}", file=sys.stderr, flush=True)
            try:
                rows += check_case(case, dtype, device)
            except Exception as error:  # noqa: BLE001 - a crash is a failed check, reported in the table
                rows.append({"op": case.op, "case": case.label, "dtype": str(dtype).removeprefix("torch."), "tensor": "-", "error": float("nan"),
                             "reference_error": float("nan"), "allowed": float("nan"), "ok": False,
                             "exception": f"{type(error).__name__}: {error}"[:300]})
    frame = pd.DataFrame(rows)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    out = Path(out_dir or f"reports/correctness-{device.type}-{stamp:%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "results.csv", index=False)
    frame["error_over_allowed"] = frame["error"] / frame["allowed"]
    summary = frame.groupby(["op", "case", "dtype"], sort=False).agg(
        ok=("ok", "all"), worst=("error_over_allowed", "max")).reset_index()
    import triton

    header = [
        "# Kernel correctness",
        "",
        f"- Device: {name}; torch {torch.__version__}, triton {triton.__version__}; {stamp:%Y-%m-%dT%H:%M:%SZ}",
        "- Criterion: max |ours - fp64 gold| <= 2 x max |eager reference - gold| + one ulp = allowed, for every output",
        "  and gradient; `worst` is the largest error / allowed over them (<= 1 passes). Details in results.csv.",
        f"- Result: {int(summary['ok'].sum())}/{len(summary)} cases pass.",
        "",
    ]
    table = markdown_table(
        ["op", "case", "dtype", "result", "worst"],
        [[r.op, r.case, r.dtype, "pass" if r.ok else "FAIL", f"{r.worst:.2f}"] for r in summary.itertuples()],
        align=["l", "l", "l", "l", "r"],
    )
    (out / "report.md").write_text("\n".join(header) + table + "\n")
    frame.attrs["report_dir"] = str(out)
    return frame
