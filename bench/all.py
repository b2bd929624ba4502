"""`tridist bench all --out DIR`: the whole GPU evidence in one command and one folder.

Steps, in this order, each a `tridist` command run as its own process (a failing step leaves the
others' results; its output is also kept in DIR/logs/<step>.log):

    sweep      tridist autotune kernels --quick --minutes M   a short launch-configuration sweep; its table
                                                             DIR/kernel-configs.json is used by the steps below
    check      tridist check kernels --dtype bf16,fp16,fp32   compiled kernels vs eager and fp64, tuned configs
    kernels    tridist bench kernels                          vs eager, torch.compile and Liger-Kernel (if installed)
    model      tridist bench model                            a decoder layer and small Llamas' training steps
    overlap    tridist bench overlap                          the overlapped ring emulated on one GPU
    calibrate  tridist calibrate                              the device profile the cost model uses

About 14 minutes on one H100; `--steps` runs a subset into the same folder (e.g. when one
call of a remote machine is limited to 10 minutes), and the summary DIR/README.md (device, versions,
date, commit, each step's status and time, headline figures) is rebuilt from whatever the folder holds.
Exit codes: 0 every step ran cleanly, 1 a step failed, 2 bad arguments, 3 no GPU (nothing run).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import statistics
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from .report import format_value, markdown_table

NO_GPU_EXIT = 3
TABLE_NAME = "kernel-configs.json"


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    what: str
    argv: Callable[[Path, dict], list[str]]  # (out dir, options) -> tridist arguments
    uses_table: bool = True  # runs with the sweep's table (TRIDIST_KERNEL_CONFIGS)


STEPS = (
    Step("sweep", "kernel launch-configuration sweep (quick buckets)",
         lambda out, o: ["autotune", "kernels", "--quick", "--minutes", str(o["sweep_minutes"]),
                         "--storage", str(out / "sweep" / "kernel-sweep.db"), "--table", str(out / TABLE_NAME),
                         "--out", str(out / "sweep")], uses_table=False),
    Step("check", "compiled kernels vs eager and fp64 gold, bf16/fp16/fp32",
         lambda out, o: ["check", "kernels", "--dtype", "bf16,fp16,fp32", "--out", str(out / "check")]),
    Step("kernels", "kernel benchmark vs eager, torch.compile, Liger-Kernel",
         lambda out, o: ["bench", "kernels", "--out", str(out / "bench")]),
    Step("model", "decoder layer and small-model training step benchmark",
         lambda out, o: ["bench", "model", "--out", str(out / "model")]),
    Step("overlap", "overlapped all-gather ring emulated on one GPU (hidden fraction, chunking overhead)",
         lambda out, o: ["bench", "overlap", "--out", str(out / "overlap")], uses_table=False),
    Step("calibrate", "device profile for the cost model",
         lambda out, o: ["calibrate", "--out", str(out / "profile.json")], uses_table=False),
)
STEP_NAMES = tuple(step.name for step in STEPS)


def run_step_process(argv: Sequence[str], *, env: dict, log_path: Path, echo) -> int:
    """`python -m tridist ARGV` with its output copied line by line to the log and to `echo`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", buffering=1) as log:  # line-buffered: a step killed at a time limit keeps its log
        process = subprocess.Popen([sys.executable, "-m", "tridist", *argv], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in process.stdout:
            log.write(line)
            echo(line.rstrip("\n"))
        return process.wait()


def run_all(out: str | Path, *, steps: Sequence[str] = STEP_NAMES, sweep_minutes: float = 4.0,
            runner=run_step_process, echo=print) -> int:
    """Run `steps` into `out`, then rebuild its README.md; returns the exit code (0 or 1)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    status_path = out / "steps.json"
    status = json.loads(status_path.read_text()) if status_path.exists() else {}
    chosen = [step for step in STEPS if step.name in steps]
    for i, step in enumerate(chosen, 1):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if step.uses_table and (out / TABLE_NAME).exists():
            env["TRIDIST_KERNEL_CONFIGS"] = str(out / TABLE_NAME)
        argv = step.argv(out, {"sweep_minutes": sweep_minutes})
        echo(f"== [{i}/{len(chosen)}] {step.name}: tridist {' '.join(argv)}")
        start = time.monotonic()
        code = runner(argv, env=env, log_path=out / "logs" / f"{step.name}.log", echo=echo)
        seconds = time.monotonic() - start
        echo(f"== [{i}/{len(chosen)}] {step.name}: exit {code} after {seconds:.0f} s")
        status[step.name] = {"exit": code, "seconds": round(seconds, 1), "argv": argv,
                             "tuned_table": "TRIDIST_KERNEL_CONFIGS" in env,
                             "finished": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        status_path.write_text(json.dumps(status, indent=1) + "\n")
    write_summary(out)
    return 0 if all(status.get(s.name, {}).get("exit") == 0 for s in chosen) else 1


# ------------------------------------------------------------------------------------------- summary


def _read_csv(path: Path):
    import pandas as pd

    return pd.read_csv(path) if path.exists() else None


def _kernel_headlines(frame) -> list[str]:
    """fwd+bwd of each op at its largest shape: tridist's time, % of copy bandwidth, ratios to the others."""
    if frame is None or frame.empty:
        return []
    rows = []
    for op, sub in frame[frame["mode"] == "fwd+bwd"].groupby("op", sort=False):
        largest = sub[sub["bytes"] == sub["bytes"].max()]
        times = {v: t for v, t in zip(largest["variant"], largest["time_ms"]) if isinstance(t, float) and t == t}
        ours = largest[largest["variant"] == "tridist"]
        if ours.empty or "tridist" not in times:
            continue
        row = ours.iloc[0]
        rows.append([op, row["shape"], row["dtype"], format_value(times["tridist"], ".3f"), format_value(row["pct_copy_bw"], ".0f", "%"),
                     *(format_value(times[v] / times["tridist"], ".2f", "x") if v in times else "-"
                       for v in ("compile", "liger", "eager"))])
    if not rows:
        return []
    return ["Kernels, forward + backward at the largest shape (ratio = other's time / tridist's: above 1, tridist "
            "is faster):", "",
            markdown_table(["op", "shape", "dtype", "tridist ms", "% copy BW", "vs compile", "vs Liger", "vs eager"],
                           rows, align=["l", "l", "l", "r", "r", "r", "r", "r"]), ""]


def _model_headlines(frame) -> list[str]:
    if frame is None or frame.empty or "time_ms" not in frame:
        return []
    if "status" in frame:
        frame = frame[frame["status"] == "ok"]
    rows = []
    for target, sub in frame.groupby("target", sort=False):
        times = {v: t for v, t in zip(sub["variant"], sub["time_ms"]) if isinstance(t, float) and t == t}
        for variant, t in times.items():
            row = sub[sub["variant"] == variant].iloc[0]
            rows.append([target, row.get("shape", ""), variant, format_value(t, ".3f"), format_value(row.get("tokens_per_s"), ",.0f"),
                         format_value(row.get("peak_mem_gib"), ".2f"),
                         format_value(times["eager"] / t, ".2f", "x") if "eager" in times else "-",
                         format_value(times["compile"] / t, ".2f", "x") if "compile" in times else "-"])
    if not rows:
        return []
    return ["Decoder layer (forward + backward), small model and transformers' Llama (training step):", "",
            markdown_table(["target", "shape", "variant", "ms", "tokens/s", "peak GiB", "vs eager", "vs compile"], rows,
                           align=["l", "l", "l", "r", "r", "r", "r", "r"]), ""]


def _sweep_headline(frame) -> list[str]:
    if frame is None or frame.empty or "gain" not in frame:
        return []
    gains = [g for g in frame["gain"] if isinstance(g, float) and g == g and g > 0]
    if not gains:
        return []
    geo = statistics.geometric_mean(gains)
    best = frame.loc[frame["gain"].idxmax()]
    return [f"Launch-configuration sweep: geometric-mean gain {geo:.3f}x over the heuristic in {len(gains)} buckets; "
            f"largest {best['gain']:.2f}x ({best['kernel']} {best['shape']}). Table: `{TABLE_NAME}` (used by the check, "
            "kernel and model steps; install it with `TRIDIST_KERNEL_CONFIGS=<path>` or by copying it to "
            "`~/.cache/tridist/kernel-configs/<device>.json`).", ""]


def _check_headline(frame) -> list[str]:
    if frame is None or frame.empty:
        return []
    ok = frame["ok"].astype(str).str.lower() == "true"
    worst = (frame["error"] / frame["allowed"]).max()
    cases = frame.drop_duplicates(["op", "case", "dtype"]) if "case" in frame else frame
    return [f"Correctness: {int(ok.sum())}/{len(frame)} tensors within the criterion over {len(cases)} cases "
            f"(worst error/allowed {worst:.2f}).", ""]


def _overlap_headline(frame) -> list[str]:
    if frame is None or frame.empty:
        return []
    nvlink = frame[(frame["tp"] == frame["tp"].max()) & (frame["link_gbps"] == frame["link_gbps"].max())]
    return [f"Overlapped ring (emulated): at tp {int(nvlink['tp'].iloc[0])} over {nvlink['link'].iloc[0]}, "
            f"{nvlink['hidden_fraction'].min():.0%}-{nvlink['hidden_fraction'].max():.0%} of the communication hidden; "
            f"chunking overhead up to {frame['chunking_overhead'].max():+.1%} (targets: >= 80%, <= 5%).", ""]


def _calibrate_headline(path: Path) -> list[str]:
    if not path.exists():
        return []
    profile = json.loads(path.read_text())
    parts = []
    for key, label, scale, unit in (("peak_bf16_flops", "bf16 matmul", 1e12, "TFLOP/s"),
                                    ("layer_gemm_flops", "decoder-layer GEMMs", 1e12, "TFLOP/s"),
                                    ("attention_flops", "SDPA causal fwd+bwd", 1e12, "TFLOP/s"),
                                    ("hbm_bandwidth", "copy", 1e9, "GB/s"),
                                    ("fused_kernel_bandwidth", "fused kernels", 1e9, "GB/s")):
        value = profile.get(key)
        if value:
            eff = profile.get("matmul_efficiency") if key == "peak_bf16_flops" else None
            value = value * eff if eff else value
            parts.append(f"{label} {value / scale:,.0f} {unit}")
    return [f"Calibrated profile (`profile.json`): {'; '.join(parts)}.", ""] if parts else []


def write_summary(out: str | Path) -> Path:
    """DIR/README.md from what DIR holds: provenance, the steps' status, headline figures."""
    out = Path(out)
    status = json.loads((out / "steps.json").read_text()) if (out / "steps.json").exists() else {}
    provenance = {}
    for csv in (out / "bench" / "results.csv", out / "model" / "results.csv", out / "check" / "results.csv"):
        frame = _read_csv(csv)
        if frame is not None and not frame.empty:  # older runs' CSVs carry fewer columns: merge what each has
            first = frame.iloc[0]
            for key in ("device", "driver", "cuda", "torch", "triton", "tridist", "date", "commit"):
                if key in frame and first[key] == first[key] and key not in provenance:
                    provenance[key] = first[key]
    lines = [f"# GPU evidence: {provenance.get('device', 'unknown device')}", ""]
    if provenance:
        lines += ["- " + ", ".join(f"{k} {v}" for k, v in provenance.items() if k != "device"), ""]
    rows = []
    for step in STEPS:
        s = status.get(step.name)
        rows.append([step.name, step.what, "not run" if s is None else ("ok" if s["exit"] == 0 else f"exit {s['exit']}"),
                     "-" if s is None else f"{s['seconds']:.0f} s", "" if s is None else ("yes" if s["tuned_table"] else "no")])
    lines += [markdown_table(["step", "what", "status", "time", "tuned table"], rows), "",
              "Each step's own report is in its folder (`sweep/`, `check/`, `bench/`, `model/`), its output in "
              "`logs/<step>.log`.", "", "## Headlines", ""]
    lines += _check_headline(_read_csv(out / "check" / "results.csv"))
    lines += _kernel_headlines(_read_csv(out / "bench" / "results.csv"))
    lines += _model_headlines(_read_csv(out / "model" / "results.csv"))
    lines += _sweep_headline(_read_csv(out / "sweep" / "sweep.csv"))
    lines += _overlap_headline(_read_csv(out / "overlap" / "results.csv"))
    lines += _calibrate_headline(out / "profile.json")
    (out / "README.md").write_text("\n".join(lines).rstrip() + "\n")
    return out / "README.md"


def run_bench_all(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("tridist bench all: no CUDA GPU here; this command gathers GPU evidence (compiled kernels, timings, "
              "calibration), so nothing was run (exit code 3). On a CPU, `python3 -m pytest` checks the same "
              "kernels in Triton's interpreter.", file=sys.stderr)
        return NO_GPU_EXIT
    out = args.out or f"bench/results/{_device_slug()}-{datetime.date.today():%Y-%m-%d}"
    code = run_all(out, steps=args.steps or STEP_NAMES, sweep_minutes=args.sweep_minutes)
    print((Path(out) / "README.md").read_text())
    print(f"evidence: {out}")
    return code


def _device_slug() -> str:
    import torch

    from .report import device_slug

    return device_slug(torch.cuda.get_device_name())
