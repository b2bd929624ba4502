"""`tridist autotune kernels`: the kernel launch-configuration sweep from the command line, and its report.

    tridist autotune kernels [--ops rms_norm,swiglu] [--dtype bf16] [--trials 32] [--minutes 20] [--quick]
                             [--storage URL] [--table PATH] [--no-write] [--out DIR]

The sweep itself (studies, pruning, table) is `autotune.kernel_sweep`; this module turns its result
into report.md, sweep.csv and gain.png (pandas and matplotlib imported here, when it runs).
Exit codes: 0 done, 1 a heuristic configuration failed its check (a kernel bug: see the report) or a
bucket failed (its error in the report; the others were swept and written),
2 bad arguments, 3 no GPU here (nothing tuned; the message says so).
"""

from __future__ import annotations

import datetime
import statistics
import sys
from pathlib import Path

from .report import device_slug, format_value, markdown_table


def sweep_frame(result):
    import pandas as pd

    frame = pd.DataFrame([r.row() for r in result.results])
    if not frame.empty:
        frame.insert(0, "device", result.device)
        for name, version in result.versions.items():
            frame[name] = version
    return frame


def plot_gains(frame, path: str | Path, *, title: str) -> Path:
    """Horizontal bars: tuned speed-up over the heuristic per bucket (1.0 = the heuristic was best)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = frame.dropna(subset=["gain"])
    labels = [f"{k} {s}" for k, s in zip(rows["kernel"], rows["shape"])]
    fig, ax = plt.subplots(figsize=(9, 0.32 * max(len(rows), 3) + 1.2))
    ax.barh(range(len(rows)), rows["gain"], color=["tab:green" if g > 1.02 else "tab:gray" for g in rows["gain"]])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("heuristic time / tuned time")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def write_sweep_report(result, out_dir: str | Path, *, budget: str = "") -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frame = sweep_frame(result)
    frame.to_csv(out / "sweep.csv", index=False)
    versions = ", ".join(f"{k} {v}" for k, v in result.versions.items())
    lines = [
        f"# Kernel launch-configuration sweep: {result.device}",
        "",
        f"{versions}; {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {result.seconds / 60:.1f} min"
        + (f"; budget {budget}" if budget else ""),
        f"Trials: Optuna storage `{result.storage}` (resumable). Table: "
        + (f"`{result.table_path}` (read by the kernels at launch)" if result.table_path else "not written (--no-write)"),
        "",
        "Gain = heuristic time / tuned time at the bucket's shape (CUDA events, median, L2 flushed); every "
        "timed configuration passed the test suite's accuracy check first. Pruned: over the register limit / "
        "failed to compile or launch / wrong output / clearly slower in a quick timing.",
        "",
    ]
    rows = []
    for r in result.results:
        rows.append([r.bucket.tunable.name, r.bucket.shape, r.bucket.key, format_value(r.heuristic_ms, ".4g"), format_value(r.best_ms, ".4g"),
                     f"{r.gain:.2f}x" if r.gain else "-", r.trials,
                     "/".join(str(r.pruned.get(k, 0)) for k in ("infeasible", "failed", "wrong", "slower")),
                     ", ".join(f"{k}={v}" for k, v in sorted((r.best or {}).items()))])
    lines.append(markdown_table(["kernel", "shape", "bucket", "heuristic ms", "tuned ms", "gain", "trials",
                                 "pruned i/f/w/s", "tuned config"], rows,
                                align=["l", "l", "l", "r", "r", "r", "r", "r", "l"]))
    gains = [r.gain for r in result.results if r.gain]
    if gains:
        geo = statistics.geometric_mean(gains)
        lines += ["", f"Geometric-mean gain over the heuristic: {geo:.3f}x over {len(gains)} buckets "
                      f"(max {max(gains):.2f}x)."]
    problems = [f"- {r.bucket.tunable.name} {r.bucket.shape}: {r.heuristic_problem}" for r in result.results
                if r.heuristic_problem]
    if problems:
        lines += ["", "## Heuristic configurations that failed (kernel bugs)", "", *problems]
    if result.failed:
        lines += ["", f"## Buckets that failed ({len(result.failed)})", "",
                  *(f"- {b.tunable.name} {b.shape}: {why}" for b, why in result.failed)]
    if result.skipped:
        lines += ["", f"## Not reached within the time budget ({len(result.skipped)})", "",
                  *(f"- {b.tunable.name} {b.shape}" for b in result.skipped)]
    if not frame.empty:
        plot_gains(frame, out / "gain.png", title=f"{result.device}: tuned vs heuristic launch configurations")
        lines += ["", "![gain per bucket](gain.png)"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out


def run_kernel_autotune(args) -> int:
    import torch

    from tridist.autotune import kernel_sweep
    from tridist.bench.kernels import DTYPES

    names = [n.strip() for n in (args.dtype or "bf16").split(",") if n.strip()]
    unknown = [n for n in names if n not in DTYPES]
    if unknown or not names:
        print(f"tridist autotune kernels: error: unknown dtype(s) {unknown}; valid: {', '.join(DTYPES)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("tridist autotune kernels: no CUDA GPU here; launch configurations are tuned by timing real launches on "
              "the GPU that will run them, so nothing was tuned (exit code 3). Kernels keep using their heuristic "
              "configurations; run this on the GPU machine.", file=sys.stderr)
        return kernel_sweep.NO_GPU_EXIT
    dtypes = [DTYPES[n] for n in names]
    buckets = kernel_sweep.default_buckets(dtypes, ops=args.ops or kernel_sweep.OPS, quick=args.quick)
    result = kernel_sweep.run_sweep(buckets, device="cuda", trials=args.trials, minutes=args.minutes,
                                    storage=args.storage, table_path=args.table, write_table=args.write)
    out = args.out or f"reports/kernel-sweep-{device_slug(result.device)}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    budget = f"{args.trials} trials per bucket" + (f", {args.minutes:g} min" if args.minutes else "")
    report = write_sweep_report(result, out, budget=budget)
    print((report / "report.md").read_text())
    print(f"report: {report}")
    return 1 if result.failed or any(r.heuristic_problem for r in result.results) else 0
