"""Reports for the kernel benchmark: results.csv, report.md and plot.png in one directory.

report.md opens with where the numbers come from (device, versions, date, the measured copy
bandwidth that the percentages refer to), then one table per op: time per variant, tridist's
achieved bandwidth, and tridist's speedup over each baseline measured in the same run.

pandas' `to_markdown` needs `tabulate`, which is not a dependency: `markdown_table` is our own.
matplotlib is imported inside `plot_kernel_results` and draws through its Agg renderer (no display).
"""

from __future__ import annotations

import datetime
import math
import re
from pathlib import Path
from typing import Sequence

VARIANT_ORDER = ("eager", "compile", "liger", "tridist")
MODE_ORDER = ("fwd", "bwd", "fwd+bwd")
BASELINES = ("compile", "eager", "liger")  # speedup columns, the strongest baseline first
PLOT_MODE_PREFERENCE = ("fwd+bwd", "fwd", "bwd")  # a training step runs both passes
ERROR_MARK = " (!)"


# ----------------------------------------------------------------------------------------- formatting


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence], *, align: Sequence[str] | None = None) -> str:
    """A GitHub-flavoured markdown table; `align` holds "l" or "r" per column (default: left)."""
    align = list(align or ["l"] * len(headers))
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(str(h))] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values):
        padded = [v.rjust(w) if a == "r" else v.ljust(w) for v, w, a in zip(values, widths, align)]
        return "| " + " | ".join(padded) + " |"

    rule = ["-" * (w - 1) + ":" if a == "r" else "-" * w for w, a in zip(widths, align)]
    return "\n".join([line([str(h) for h in headers]), "| " + " | ".join(rule) + " |"] + [line(r) for r in cells])


def format_value(value: float, spec: str, suffix: str = "") -> str:
    """`value` formatted with `spec` and `suffix`; "-" for None or NaN (a variant that did not run)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (for directory names)."""
    name = re.sub(r"^CPU:\s*", "cpu-", name)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:60] or "device"


def default_report_dir(device_name: str, *, now: datetime.datetime | None = None, root: str | Path = "reports") -> Path:
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return Path(root) / f"kernels-{device_slug(device_name)}-{stamp}"


# ---------------------------------------------------------------------------------------------- tables


def _ordered(values, order) -> list:
    present = list(dict.fromkeys(values))
    return [v for v in order if v in present] + [v for v in present if v not in order]


def focus_variant(variants: Sequence[str]) -> str | None:
    """Whose bandwidth the tables show: tridist, or the best stand-in while it is missing."""
    for name in ("tridist", "compile", "eager", "liger"):
        if name in variants:
            return name
    return variants[0] if variants else None


def _gemm_bound(sub) -> bool:
    """An op measured against the matmul rate (linear_cross_entropy), not the copy bandwidth."""
    return "pct_matmul" in sub and sub["pct_matmul"].notna().any()


def op_table(df, op: str) -> str:
    """The markdown pivot for one op: rows (shape, dtype, mode), time per variant, bandwidth (or, for a
    GEMM-bound op, TFLOP/s and each variant's peak memory), speedups."""
    sub = df[df["op"] == op]
    variants = _ordered(sub["variant"], VARIANT_ORDER)
    focus = focus_variant(variants)
    baselines = [b for b in BASELINES if b in variants and b != focus]
    gemm = _gemm_bound(sub)
    headers = ["shape", "dtype", "mode"] + [f"{v} ms" for v in variants]
    headers += [f"{focus} TFLOP/s", f"{focus} % matmul"] if gemm else [f"{focus} GB/s", f"{focus} % copy BW"]
    headers += [f"{focus} vs {b}" for b in baselines] + ([f"{v} peak MiB" for v in variants] if gemm else [])
    rows = []
    for (shape, dtype), case_rows in sub.groupby(["shape", "dtype"], sort=False):
        for mode in _ordered(case_rows["mode"], MODE_ORDER):
            by_variant = {r["variant"]: r for _, r in case_rows[case_rows["mode"] == mode].iterrows()}
            cells = _table_cells(by_variant, variants=variants, focus=focus, baselines=baselines, gemm=gemm)
            if gemm:
                cells += ["-" if v not in by_variant else format_value(by_variant[v]["peak_mib"], ".0f") for v in variants]
            rows.append([shape, dtype, mode] + cells)
    return markdown_table(headers, rows, align=["l"] * 3 + ["r"] * (len(headers) - 3))


def _table_cells(by_variant: dict, *, variants: Sequence[str], focus: str, baselines: Sequence[str],
                 gemm: bool = False) -> list[str]:
    """Times per variant (flagged when the variant failed its check), then focus's GB/s and % (TFLOP/s and
    % of the matmul rate for a GEMM-bound op) and speedups."""
    cells = []
    for variant in variants:
        row = by_variant.get(variant)
        cells.append("-" if row is None else format_value(row["time_ms"], ".4f") + (ERROR_MARK if _has_error(row) else ""))
    ours = by_variant.get(focus)
    if ours is None:
        return cells + ["-"] * (2 + len(baselines))
    if gemm:
        cells += [format_value(ours["tflops"], ".2f"), format_value(ours["pct_matmul"], ".1f", "%")]
    else:
        cells += [format_value(ours["gbps"], ".1f"), format_value(ours["pct_copy_bw"], ".1f", "%")]
    for baseline in baselines:
        base = by_variant.get(baseline)
        cells.append("-" if base is None else format_value(base["time_ms"] / ours["time_ms"], ".2f", "x"))
    return cells


def _has_error(row) -> bool:
    return isinstance(row["error"], str) and bool(row["error"])  # read back from CSV, "" becomes NaN


def _error_rows(df) -> list[list[str]]:
    has_error = df["error"].astype(object).fillna("").astype(str) != ""
    errors = df[has_error].drop_duplicates(["op", "shape", "dtype", "variant", "error"])
    return [[r["op"], r["shape"], r["dtype"], r["variant"], str(r["error"]).replace("|", "/")]
            for _, r in errors.iterrows()]


def render_kernel_markdown(df, meta: dict) -> str:
    """report.md: environment header, method, one table per op, skipped variants and errors."""
    copy_bw = meta.get("copy_bw_gbps", math.nan)
    lines = [
        "# Kernel benchmark",
        "",
        f"- Device: {meta.get('device', '?')}",
        f"- torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}, python {meta.get('python', '?')}"
        + (f", CUDA {meta['cuda']}" if meta.get("cuda") else ""),
        f"- Date: {meta.get('date', '?')}"
        + (f"; CPU threads: {meta['threads']}" if meta.get("threads") else ""),
        f"- Measured copy bandwidth: {format_value(copy_bw, '.1f')} GB/s (device-to-device `copy_`, "
        "bytes read + written)",
        "",
        "- Time: median ms; CUDA: events around each run, L2 flushed before it (`triton.testing.do_bench`'s "
        "method, at least 10 runs); CPU: wall clock.",
        "- GB/s: minimum bytes moved (each input read once, each output written once) / time; "
        "% copy BW: that against the copy bandwidth above.",
        "- linear_cross_entropy (GEMM-bound): TFLOP/s of its GEMMs (2·T·H·V for the logits; 3x with the "
        "gradients) / time; % matmul: that against `torch.mm` at the head's shape, timed in this run; peak MiB: "
        "the memory one call adds above its inputs at its peak (CUDA allocator peak; MemTracker on the CPU). "
        "Modes fwd and fwd+bwd only: a fused loss computes its gradients in the forward.",
        "- `A vs B`: B's time / A's time, both measured in this run (> 1: A is faster).",
        "- Modes: `fwd`; `bwd` = backward only (forward done once, `retain_graph=True`); `fwd+bwd`.",
        f"- `{ERROR_MARK.strip()}`: the variant failed its check against the eager reference (see Errors).",
    ]
    if meta.get("device_type") == "cpu":
        lines += ["", "On the CPU, tridist runs whatever `kernels` runs for CPU tensors (a PyTorch fallback, or "
                      "the Triton interpreter under TRITON_INTERPRET=1): these numbers check the pipeline, "
                      "not the kernels."]
    variants = _ordered(df["variant"], VARIANT_ORDER)
    focus = focus_variant(variants)
    if focus and focus != "tridist":
        lines += ["", f"tridist did not run: bandwidth columns show {focus} instead."]
    for op in dict.fromkeys(df["op"]):
        lines += ["", f"## {op}", "", op_table(df, op)]
    skipped = meta.get("skipped") or {}
    if skipped:
        lines += ["", "## Skipped variants", ""] + [f"- {key}: {why}" for key, why in skipped.items()]
    errors = _error_rows(df)
    if errors:
        lines += ["", "## Errors", "", markdown_table(["op", "shape", "dtype", "variant", "error"], errors)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ plot


def plot_kernel_results(df, path: str | Path, *, copy_bw_gbps: float | None = None) -> Path:
    """Grouped bars per op: % of copy bandwidth per variant across shapes, for fwd+bwd (else fwd, bwd)."""
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state is touched

    ops = list(dict.fromkeys(df["op"]))
    ncols = min(2, max(1, len(ops)))
    nrows = math.ceil(len(ops) / ncols) if ops else 1
    most_shapes = max((len(set(zip(g["shape"], g["dtype"]))) for _, g in df.groupby("op")), default=1)
    panel_width = max(7.0, 1.0 * most_shapes + 2.5)  # inches: ~1 inch per group of bars
    fig = Figure(figsize=(panel_width * ncols, 4.2 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    variants = _ordered(df["variant"], VARIANT_ORDER)
    palette = matplotlib.colormaps["tab10"]
    colors = {v: palette(i) for i, v in enumerate(_ordered(VARIANT_ORDER + tuple(variants), ()))}

    for ax, op in zip(axes.flat, ops):
        sub = df[df["op"] == op]
        mode = next((m for m in PLOT_MODE_PREFERENCE if (sub["mode"] == m).any()), sub["mode"].iloc[0])
        sub = sub[sub["mode"] == mode]
        groups = list(dict.fromkeys(zip(sub["shape"], sub["dtype"])))
        several_dtypes = len({d for _, d in groups}) > 1
        op_variants = [v for v in variants if (sub["variant"] == v).any()]
        width = 0.8 / max(1, len(op_variants))
        gemm = _gemm_bound(sub)  # its panel: peak memory, the fused loss's point
        column = "peak_mib" if gemm else "pct_copy_bw"
        for j, variant in enumerate(op_variants):
            values = []
            for shape, dtype in groups:
                hit = sub[(sub["shape"] == shape) & (sub["dtype"] == dtype) & (sub["variant"] == variant)]
                values.append(float(hit[column].iloc[0]) if len(hit) else math.nan)
            xs = [i + (j - (len(op_variants) - 1) / 2) * width for i in range(len(groups))]
            ax.bar(xs, [0 if math.isnan(v) else v for v in values], width, label=variant, color=colors[variant])
        if not gemm:
            ax.axhline(100, color="gray", linestyle="--", linewidth=0.8)
        ax.set_xticks(range(len(groups)))
        labels = [f"{s}\n{d}" if several_dtypes else s for s, d in groups]
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=7)
        ax.set_ylabel("peak MiB above the inputs" if gemm else "% of copy bandwidth")
        ax.set_title(f"{op} ({mode})")
        ax.legend(fontsize=8, loc="best")
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    title = "Achieved bandwidth vs device copy"
    if copy_bw_gbps:
        title += f" ({copy_bw_gbps:.0f} GB/s = 100%)"
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)  # PNG through matplotlib's Agg renderer
    return path


# ---------------------------------------------------------------------------------------------- writer


# Columns every results.csv row carries besides the measurement (`tridist bench report` compares by them).
ROW_PROVENANCE = ("device", "driver", "cuda", "torch", "triton", "tridist", "date", "commit")


def stamp_provenance(df, meta: dict):
    """`df` with every ROW_PROVENANCE column filled from `meta` (bench.kernels.environment)."""
    return df.assign(**{key: meta.get(key, "") for key in ROW_PROVENANCE})


def write_kernel_report(df, *, out_dir: str | Path | None = None, meta: dict) -> Path:
    """Write results.csv, report.md and plot.png; returns the directory."""
    out = Path(out_dir) if out_dir else default_report_dir(meta.get("device", "device"))
    out.mkdir(parents=True, exist_ok=True)
    stamped = stamp_provenance(df, meta)  # each row says where it was taken
    stamped.to_csv(out / "results.csv", index=False)
    (out / "report.md").write_text(render_kernel_markdown(df, meta))
    if len(df):
        plot_kernel_results(df, out / "plot.png", copy_bw_gbps=meta.get("copy_bw_gbps"))
    return out
