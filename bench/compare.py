"""`tridist bench report DIR...`: render one kernel-benchmark run, or compare several (before/after on one
device, or two devices) case by case.

A run is a directory holding `results.csv` (or `bench/results.csv`, as a `bench/results/<device>-<date>/`
folder keeps it), as `tridist bench kernels` writes it. Cases are matched on op, shape, dtype, variant
and mode; each later run's time is divided by the first run's. On the same device a ratio above
1 + noise is a regression and below 1 - noise an improvement; between different devices the ratios
are shown, not judged. Exit code: 0, or 1 when a regression is flagged (for CI), 2 for bad input.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from .report import ROW_PROVENANCE, markdown_table, plot_kernel_results, render_kernel_markdown

CASE = ["op", "shape", "dtype", "variant", "mode"]
# Medians of one case from triton's do_bench (CUDA events, L2 flushed, ~100 repeats) differ by a few
# percent between runs on an idle GPU; a change beyond 5% is more than a re-run explains (--noise).
DEFAULT_NOISE = 0.05


class RunError(ValueError):
    """A directory that holds no benchmark run."""


def load_run(path: str | Path):
    """(label, results, provenance) of the run in `path`."""
    import pandas as pd

    path = Path(path)
    for candidate in (path / "results.csv", path / "bench" / "results.csv"):
        if candidate.is_file():
            frame = pd.read_csv(candidate)
            break
    else:
        raise RunError(f"{path}: no results.csv here or under bench/ (a directory written by `tridist bench kernels`)")
    missing = [c for c in [*CASE, "time_ms"] if c not in frame.columns]
    if missing:
        raise RunError(f"{path}: results.csv lacks the columns {missing}")
    provenance = {key: str(frame[key].iloc[0]) for key in ROW_PROVENANCE if key in frame.columns and len(frame)}
    return path.name, frame, provenance


def compare(runs, *, noise: float = DEFAULT_NOISE):
    """One row per case of the first run: each run's time and its ratio to the first, and a verdict."""
    base_label, base, base_info = runs[0]
    table = base[CASE + ["time_ms"]].rename(columns={"time_ms": f"ms {base_label}"})
    for label, frame, info in runs[1:]:
        times = frame[CASE + ["time_ms"]].rename(columns={"time_ms": f"ms {label}"})
        table = table.merge(times, on=CASE, how="outer")
        ratio = table[f"ms {label}"] / table[f"ms {base_label}"]
        table[f"x {label}"] = ratio
        same_device = info.get("device") == base_info.get("device")
        table[f"verdict {label}"] = [
            "" if ratio_ != ratio_ else  # NaN: the case ran in one of the two only
            ("regression" if ratio_ > 1 + noise else "improvement" if ratio_ < 1 - noise else "same") if same_device
            else "other device"
            for ratio_ in ratio
        ]
    return table


def write_report(paths, out_dir: str | Path, *, noise: float = DEFAULT_NOISE) -> tuple[Path, int]:
    """report.md (+ plots, CSV) for one run or a comparison; returns (out_dir, regressions flagged)."""
    runs = [load_run(p) for p in paths]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if len(runs) == 1:
        label, frame, info = runs[0]
        (out / "report.md").write_text(render_kernel_markdown(frame, {**info, "device_type": ""}))
        plot_kernel_results(frame, out / "plot.png")
        return out, 0
    table = compare(runs, noise=noise)
    table.to_csv(out / "comparison.csv", index=False)
    _plot_ratios(table, [label for label, _, _ in runs], out / "comparison.png")
    flagged = table[[c for c in table.columns if c.startswith("verdict ")]].eq("regression").to_numpy()
    lines = [f"# Benchmark comparison against `{runs[0][0]}`", "",
             f"Generated {datetime.datetime.now():%Y-%m-%d %H:%M:%S} by `tridist bench report`. Ratio: the run's "
             f"time / the first run's (> 1: slower). On one device a change beyond {noise:.0%} is flagged "
             "(regression / improvement); across devices the ratio is shown only.", "",
             markdown_table(["run", *ROW_PROVENANCE],
                            [[label, *(info.get(key, "") for key in ROW_PROVENANCE)] for label, _, info in runs]), "",
             f"**{int(flagged.sum())} regression(s)**", "", "![ratios](comparison.png)", ""]
    rows = [[_cell(v) for v in row] for row in table.itertuples(index=False)]
    lines.append(markdown_table(list(table.columns), rows))
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out, int(flagged.sum())


def _cell(value) -> str:
    if isinstance(value, float):
        return "-" if value != value else f"{value:.3g}"
    return str(value)


def _plot_ratios(table, labels, path: Path) -> None:
    """Each later run's time ratio per case (tridist's rows where present), a line at 1."""
    from matplotlib.figure import Figure

    rows = table[table["variant"] == "tridist"] if (table["variant"] == "tridist").any() else table
    names = [f"{r.op} {r.shape} {r.dtype} {r.mode}" for r in rows.itertuples()]
    fig = Figure(figsize=(9, 0.25 * len(names) + 2))
    ax = fig.subplots()
    height = 0.8 / max(len(labels) - 1, 1)
    for i, label in enumerate(labels[1:]):
        ax.barh([k + i * height for k in range(len(names))], rows[f"x {label}"].fillna(0), height=height, label=label)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(names)), names, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel(f"time / {labels[0]}'s (> 1: slower)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
