"""`tridist tune`, `tridist calibrate` and `tridist bench tune`: strategy search from the command line,
its report (ranked table, Pareto front plot), device calibration, and the search-speed benchmark.

    tridist tune --model llama2-70b --nodes 16 --devices-per-node 8 --device h100-sxm --global-batch 1024
    tridist tune --model hf-llama --size seed --nodes 1 --devices-per-node 8 --global-batch 64 --report out/
    tridist tune --model mypkg.models:build --nodes 4 --devices-per-node 8 --global-batch 512
    tridist calibrate [--quick] [--name NAME] [--out PATH]     # torchrun --nproc-per-node 8 ... for links
    tridist bench tune [--quick]

A model is a preset name (autotune.PRESETS), a bench.models name (built on the meta device, no
memory for weights) or `module:function` returning an nn.Module or a ModelSpec. pandas and matplotlib
are imported inside the functions that use them.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from tridist.autotune import (
    Cluster,
    ModelSpec,
    PRESETS,
    SearchResult,
    UnrecognisedModel,
    default_storage,
    exhaustive_search,
    preset,
    search,
)

from tridist.autotune.calibrate import LAYER_SHAPES
from tridist.autotune.cost import clear_caches

from .report import markdown_table

__all__ = ["resolve_model", "run_tune", "ranked_frame", "write_tune_report", "plot_pareto", "run_tune_benchmark",
           "run_calibrate", "BENCH_MODELS"]

BENCH_MODELS = ("seed-llama", "hf-llama", "paddle-llama")
GB = 1e9


# ------------------------------------------------------------------------------------------- models


def resolve_model(name: str, *, seq_len: int | None = None, size: str = "seed") -> ModelSpec:
    """A ModelSpec from a preset name, a bench.models name or 'module:function'."""
    if name in PRESETS:
        return preset(name, **({"seq_len": seq_len} if seq_len else {}))
    factory = _model_factory(name, size)
    if factory is None:
        raise ValueError(f"unknown model {name!r}: use a preset ({', '.join(PRESETS)}), a bench model "
                         f"({', '.join(BENCH_MODELS)}) or 'module:function'")
    import torch

    with torch.device("meta"):  # shapes only: no memory for the weights, no initialisation work
        built = factory()
    if isinstance(built, ModelSpec):
        return built if seq_len is None else _with_seq_len(built, seq_len)
    return ModelSpec.from_module(built, seq_len=seq_len or 2048)


def _model_factory(name: str, size: str):
    """What builds a bench model or 'module:function' (None for other names)."""
    if name in BENCH_MODELS:
        from tridist.bench.models import build_model

        return lambda: build_model(name, size)
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load {name!r}: {exc}") from exc
    return None


def _with_seq_len(spec: ModelSpec, seq_len: int) -> ModelSpec:
    import dataclasses

    return dataclasses.replace(spec, seq_len=seq_len)


# ------------------------------------------------------------------------------------------- tables


def ranked_frame(result: SearchResult, candidates=None, *, index: str = "rank"):
    """The ranked candidates (or `candidates`, numbered in a column named `index`) as a DataFrame with
    readable units (s, GB) and one column per breakdown part."""
    import pandas as pd

    rows = []
    for rank, cand in enumerate(result.ranked if candidates is None else candidates, 1):
        b = cand.breakdown
        rows.append({
            index: rank, "strategy": cand.strategy.describe(), "step_s": cand.step_time_s,
            "mem_GB": cand.memory_bytes_per_device / GB, "TFLOP/s": cand.tflops_per_device,
            "MFU": b.get("mfu", math.nan),
            "compute_s": b.get("compute_s"), "tp_s": b.get("tp_comm_s"), "dp_s": b.get("dp_comm_s"),
            "pp_s": b.get("pp_comm_s"), "ep_s": b.get("ep_comm_s", 0.0), "bubble_s": b.get("bubble_s"),
            "optim_s": b.get("optimizer_s"),
            "weights_GB": b.get("weights_bytes", 0) / GB, "grads_GB": b.get("gradients_bytes", 0) / GB,
            "optim_GB": b.get("optimizer_states_bytes", 0) / GB, "act_GB": b.get("activations_bytes", 0) / GB,
            "buf_GB": b.get("buffers_bytes", 0) / GB,
        })
    return pd.DataFrame(rows)


def _markdown(frame) -> str:
    headers = list(frame.columns)
    rows = [[_cell(v) for v in row] for row in frame.itertuples(index=False)]
    return markdown_table(headers, rows, align=["r" if h not in ("strategy",) else "l" for h in headers])


def _cell(value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def summary_lines(result: SearchResult) -> list[str]:
    cluster = result.cluster
    lines = [
        f"- Model: {result.spec.describe()}",
        f"- Cluster: {cluster.describe()}; {cluster.num_devices} devices; usable memory "
        f"{cluster.profile.memory_bytes * 0.9 / GB:.1f} GB per device ({cluster.profile.source})",
        f"- Predictions: {cluster.profile.basis}; engine {cluster.engine.name} ({cluster.engine.source})",
        f"- Global batch: {result.global_batch_size} sequences of {result.spec.seq_len} tokens",
        f"- Search: {result.method} over {len(result.layouts)} layouts (tp, pp), {result.n_evaluated} strategies "
        f"scored, {result.n_new_trials} new trial(s) of {result.n_trials} in study `{result.study_name}` "
        f"({result.storage}), {result.elapsed_s:.2f} s",
    ]
    lines += [f"- Pruned: {reason}" for reason in result.pruned]
    if result.best:
        b = result.best
        lines.append(f"- Best: **{b.strategy.describe()}**: {b.step_time_s:.4g} s/step, "
                     f"{b.memory_bytes_per_device / GB:.1f} GB/device, {b.tflops_per_device:.1f} TFLOP/s/device "
                     f"(MFU {b.breakdown.get('mfu', math.nan) * 100:.1f}%)")
    else:
        lines.append(f"- No strategy fits: {result.message}")
    return lines


# ------------------------------------------------------------------------------------------ reports


def plot_pareto(result: SearchResult, path: str | Path) -> Path:
    """Step time vs memory per device: every stored candidate, the Pareto front, the best, the capacity."""
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg canvas

    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    seen = {}
    for layout in result.layouts:
        for cand in layout.top + layout.pareto:
            seen[cand.strategy] = cand
    points = list(seen.values())
    if points:
        ax.scatter([c.memory_bytes_per_device / GB for c in points], [c.step_time_s for c in points],
                   s=12, alpha=0.4, color="tab:gray", label="candidates kept (fastest and Pareto per layout)")
    if result.pareto:
        front = sorted(result.pareto, key=lambda c: c.memory_bytes_per_device)
        ax.plot([c.memory_bytes_per_device / GB for c in front], [c.step_time_s for c in front],
                marker="o", color="tab:blue", label="Pareto front")
    if result.best:
        ax.scatter([result.best.memory_bytes_per_device / GB], [result.best.step_time_s], s=120, marker="*",
                   color="tab:red", zorder=5, label=f"best: {result.best.strategy.describe()}")
    capacity = result.cluster.profile.memory_bytes * 0.9 / GB
    ax.axvline(capacity, color="tab:red", linestyle="--", linewidth=0.8, label="usable memory")
    ax.set_xlabel("memory per device (GB)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"{result.spec.name or 'model'} on {result.cluster.describe()}, batch {result.global_batch_size}")
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path


def write_tune_report(result: SearchResult, out_dir: str | Path) -> Path:
    """report.md (summary, ranked table, Pareto front, recognised structure), ranked.csv, pareto.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frame = ranked_frame(result)
    frame.to_csv(out / "ranked.csv", index=False)
    plot_pareto(result, out / "pareto.png")
    lines = ["# Strategy search", "", *summary_lines(result), "",
             f"Generated {datetime.datetime.now():%Y-%m-%d %H:%M:%S} by `tridist tune`. Times are predictions "
             "of the analytical cost model (autotune/cost.py), not measurements.", "",
             "## Ranked strategies (fastest first, out-of-memory excluded)", ""]
    lines.append(_markdown(frame) if len(frame) else "(none)")
    lines += ["", "## Time/memory Pareto front", "", "![Pareto front](pareto.png)", "",
              "Strategies no other beats in both step time and memory, by increasing memory.", ""]
    lines.append(_markdown(ranked_frame(result, result.pareto, index="#")) if result.pareto else "(none)")
    ordered = sorted((l for l in result.layouts if l.best), key=lambda l: l.best.sort_key())
    lines += ["", "## Best strategy per layout", ""]
    lines.append(markdown_table(
        ["tp", "pp", "dp", "best strategy", "step s", "mem GB", "scored", "fit"],
        [[l.tp, l.pp, l.dp, l.best.strategy.describe(), f"{l.best.step_time_s:.4g}",
          f"{l.best.memory_bytes_per_device / GB:.1f}", l.evaluated, l.feasible] for l in ordered],
        align=["r", "r", "r", "l", "r", "r", "r", "r"]) if ordered else "(none fits)")
    if result.spec.is_moe:
        lines += ["", "## Best strategy per expert-parallel degree", "",
                  "The fastest strategy found with each ep (the routed experts split over ep of the dp ranks; "
                  f"busiest rank's routed tokens {result.spec.expert_load_imbalance}x the mean under expert "
                  "parallel, ModelSpec.expert_load_imbalance).", ""]
        kept = sorted((c for l in result.layouts for c in l.top), key=lambda c: c.sort_key())
        best = {}
        for cand in kept:
            best.setdefault(cand.strategy.ep, cand)
        lines.append(markdown_table(
            ["ep", "best strategy", "step s", "ep comm s", "mem GB"],
            [[ep, c.strategy.describe(), f"{c.step_time_s:.4g}", f"{c.breakdown.get('ep_comm_s', 0.0):.3g}",
              f"{c.memory_bytes_per_device / GB:.1f}"] for ep, c in sorted(best.items())],
            align=["r", "l", "r", "r", "r"]) if best else "(none fits)")
    if result.spec.structure is not None:
        lines += ["", "## Recognised model structure", "", "```", result.spec.structure.describe(), "```"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out


def run_tune(args) -> int:
    """The `tridist tune` handler."""
    import pandas as pd

    if args.measure:
        return run_measured_tune(args)
    try:
        spec = resolve_model(args.model, seq_len=args.seq_len, size=args.size)
        if args.trainable_fraction is not None:
            spec = dataclasses.replace(spec, trainable_fraction=args.trainable_fraction)
        cluster = Cluster(args.nodes, args.devices_per_node, args.device, dtype=args.dtype,
                          engine=args.engine)
    except UnrecognisedModel as exc:
        print(f"tridist tune: model not recognised: {exc}\n(to_distributed falls back to data parallel with "
              "sharding for such models)", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        print(f"tridist tune: error: {exc}", file=sys.stderr)
        return 2
    from tridist.distcore.auto import unsupported  # what distcore cannot apply to this model (tp, pp), and why

    storage = default_storage() if args.storage is None else args.storage
    result = search(spec, cluster, global_batch_size=args.global_batch, storage=storage, top_k=args.top_k,
                    method=args.method, progress=True, excluded=unsupported(spec))
    print("\n".join(line.replace("**", "") for line in summary_lines(result)))
    frame = ranked_frame(result)
    if len(frame):
        with pd.option_context("display.width", 250, "display.max_columns", 40, "display.float_format", "{:.4g}".format):
            print(frame.to_string(index=False))
    if args.report:
        out = write_tune_report(result, args.report)
        print(f"report: {out / 'report.md'}")
    return 0 if result.best else 1


def run_measured_tune(args) -> int:
    """`tridist tune --measure`: to_distributed's measured search on this job's devices (torchrun), with the
    model built for real and random token batches of the global batch; rank 0 prints and reports each
    candidate's predicted and measured step time."""
    import os

    import torch

    from tridist import distcore

    def fail(message: str) -> int:
        print(f"tridist tune --measure: error: {message}", file=sys.stderr)
        return 2

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.nodes * args.devices_per_node != world:
        return fail(f"{args.nodes} x {args.devices_per_node} devices asked, but this job has {world} process(es); launch "
                    f"with torchrun --nnodes {args.nodes} --nproc-per-node {args.devices_per_node} -m tridist.bench tune ...")
    if args.engine == "megatron":
        return fail("--engine megatron cannot be measured here: the strategies run on torch (engine torch or torch+tridist)")
    if getattr(args, "trainable_fraction", None) is not None:
        return fail("--trainable-fraction prices a model's frozen share without building it; --measure builds the model "
                    "and reads its requires_grad (freeze its parameters in the module:function that builds it)")
    try:
        torch.manual_seed(0)  # every rank builds the same model (parallelize refuses one that differs between ranks)
        model = _build_module(args.model, args.size)
    except ValueError as exc:
        return fail(str(exc))
    seq_len = args.seq_len or 128
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or ModelSpec.from_module(model, seq_len=seq_len).vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2 * args.global_batch, seq_len), generator=generator)
    samples = [{"input_ids": row, "labels": row} for row in ids]  # causal LMs shift the labels themselves
    loader = torch.utils.data.DataLoader(samples, batch_size=args.global_batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    storage = default_storage() if args.storage is None else args.storage
    config = distcore.ToDistributedConfig(
        device=args.device, fuse_kernels=args.engine == "torch+tridist", storage=storage, top_k=args.top_k,
        measure=True, measure_top_k=args.measure_top_k, measure_steps=args.measure_steps,
        measure_pick=getattr(args, "measure_pick", "top"))
    model, _, _ = distcore.to_distributed(model, optimizer, loader, device_num=args.devices_per_node,
                                          node_num=args.nodes, config=config)
    if int(os.environ.get("RANK", "0")) == 0 and args.report:
        out = write_measured_report(model.distributed_measurements, args.report, pick=getattr(args, "measure_pick", "top"))
        print(f"report: {out / 'report.md'}")
    return 0


def _build_module(name: str, size: str):
    """The nn.Module behind a bench model name or 'module:function' (presets are shapes only)."""
    factory = None if name in PRESETS else _model_factory(name, size)
    if factory is None:
        raise ValueError(f"--measure runs the model: give a bench model ({', '.join(BENCH_MODELS)}) or "
                         f"module:function building an nn.Module, not {name!r}")
    built = factory()
    if not hasattr(built, "parameters"):
        raise ValueError(f"{name!r} built a {type(built).__name__}, not an nn.Module: --measure runs the model")
    return built


def write_measured_report(measurements, out_dir: str | Path, *, pick: str = "top") -> Path:
    """report.md with the predicted vs measured table, measured.csv and measured.png (bars per candidate)."""
    import pandas as pd
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame([{"strategy": m.strategy.describe(), "predicted_ms": m.predicted_s * 1e3,
                           "measured_ms": m.measured_s * 1e3 if m.measured_s is not None else float("nan"),
                           "measured/predicted": m.ratio if m.ratio is not None else float("nan"),
                           "dropped": m.failure} for m in measurements])
    frame.to_csv(out / "measured.csv", index=False)
    ran = frame.dropna(subset=["measured_ms"])
    # Spearman's rank correlation of predicted and measured times: does the cost model order these
    # candidates as the clock does? Undefined below 2 candidates or with ties only. Computed as the
    # Pearson correlation of the ranks (ties averaged), which is what pandas' method="spearman" returns,
    # without the scipy that method imports (not a dependency of ours: a clean install lacks it).
    rho = ran["predicted_ms"].rank().corr(ran["measured_ms"].rank()) if len(ran) > 1 else float("nan")
    fig = Figure(figsize=(8, 0.6 * len(frame) + 1.5))
    ax = fig.subplots()
    rows = range(len(frame))
    ax.barh([r + 0.2 for r in rows], frame["predicted_ms"], height=0.4, label="predicted", color="tab:gray")
    ax.barh([r - 0.2 for r in rows], frame["measured_ms"].fillna(0), height=0.4, label="measured", color="tab:blue")
    ax.set_yticks(list(rows), frame["strategy"], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("step time (ms)")
    ax.set_title("measured re-ranking: fastest measured first (dropped candidates: no bar)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "measured.png", dpi=120)
    lines = ["# Measured strategy search", "",
             f"Generated {datetime.datetime.now():%Y-%m-%d %H:%M:%S} by `tridist tune --measure`: "
             + ("the best predicted strategy of each dp x tp x pp layout" if pick == "layouts"
                else "the best predicted strategies") + " ran real steps on this job's devices; the fastest measured "
             "is first.", "",
             f"Rank correlation of predicted and measured step times (Spearman): "
             f"{'-' if rho != rho else f'{rho:.2f}'} over {len(ran)} candidate(s) that ran.", "",
             markdown_table(list(frame.columns), [[_cell(v) for v in row] for row in frame.itertuples(index=False)]),
             "", "![predicted vs measured](measured.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    return out


# ---------------------------------------------------------------------------------------- calibrate


def profile_device(args):
    """The device `tridist calibrate --device` names ("auto": the current GPU, else the CPU)."""
    import torch

    if args.device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(args.device)


def measure_fused_kernels(device, shape: dict, *, progress=print) -> float:
    """Bytes/s of tridist's fused RMSNorm, rotary and SwiGLU, forward + backward, at one decoder layer's
    shapes in bf16: the minimum bytes each must move (bench/kernels.py's counts) over its measured time."""
    from tridist.bench import kernels as kb

    tokens = shape["batch"] * shape["seq"]
    cases = [kb.Case("rms_norm", tokens, shape["hidden"], "bf16"),
             kb.Case("rotary", tokens, shape["heads"] * shape["head_dim"], "bf16", head_dim=shape["head_dim"],
                     seq_len=shape["seq"]),
             kb.Case("swiglu", tokens, shape["ffn"], "bf16")]
    moved = seconds = 0.0
    for case in cases:
        fn = kb.build_variant(case.op, "tridist", device=device)
        timed = kb.make_timed_fn(fn, kb.make_inputs(case, device, requires_grad=True), "fwd+bwd")
        ms = kb.time_ms(timed, device=device)
        nbytes = kb.bytes_moved(case, "fwd+bwd")
        progress(f"  fused {case.op} {case.shape}: {ms:.3f} ms forward + backward, {nbytes / ms / 1e6:.0f} GB/s")
        moved, seconds = moved + nbytes, seconds + ms / 1e3
    return moved / seconds


QUICK_LAYER = dict(batch=1, seq=64, hidden=128, heads=2, kv_heads=1, head_dim=64, ffn=352)  # a smoke run's layer


def run_calibrate(args) -> int:
    """The `tridist calibrate` handler: measure, save, print how to use the profile."""
    import torch

    from tridist.autotune import save_profile
    from tridist.autotune.calibrate import calibrate

    if args.device == "cuda" and not torch.cuda.is_available():
        print("tridist calibrate: error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    device = profile_device(args)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else ([128, 256] if args.quick else None)
    rank = int(__import__("os").environ.get("RANK", "0"))
    say = print if rank == 0 else (lambda *_: None)
    profile = calibrate(device, name=args.name, sizes=sizes, comm=not args.no_comm,
                        repeats=2 if args.quick else 5, copy_bytes=(1 << 22) if args.quick else None, progress=say,
                        layer=QUICK_LAYER if args.quick else None)
    if device.type == "cuda":
        from tridist.bench.overlap import calibrate_overlap

        shape = QUICK_LAYER if args.quick else LAYER_SHAPES["cuda"]
        overlap = calibrate_overlap(device, hidden=shape["hidden"], tokens=shape["batch"] * shape["seq"])
        say(f"  overlapped ring (emulated, tp 8, 450 GB/s): chunked matmuls +{overlap['overlap_chunking_overhead']:.1%}, "
            f"interference {overlap['overlap_interference']:.3f} s per hidden transfer second")
        profile = dataclasses.replace(profile, fused_kernel_bandwidth=measure_fused_kernels(device, shape, progress=say),
                                      **overlap)
    else:
        say("  fused kernels and the overlapped ring: not measured on a CPU (Triton runs interpreted, nothing "
            "runs beside the matmuls there)")
    if rank != 0:
        return 0
    path = save_profile(profile, args.out)
    print(json.dumps(profile.to_dict(), indent=2))
    print(f"saved {path}; use it with: tridist tune --device {path if args.out else profile.name} ...")
    return 0


# ------------------------------------------------------------------------------------- bench tune


BENCH_CASES = (
    # (label, model preset, nodes, devices per node, device, global batch)
    ("1x8 llama2-7b", "llama2-7b", 1, 8, "h100-sxm", 64),
    ("1x8 llama3-8b", "llama3-8b", 1, 8, "h100-sxm", 32),
    ("128x8 llama2-70b", "llama2-70b", 128, 8, "h100-sxm", 1024),
    ("128x8 gpt3-175b", "gpt3-175b", 128, 8, "h100-sxm", 1536),
    ("128x8 megatron-76.1b", "megatron-76.1b", 128, 8, "a100-80gb", 1792),
)
TARGET_SECONDS = {1: 1.0, 128: 10.0}  # the targets per node count


def run_tune_benchmark(*, quick: bool = False, storages=("memory", "journal", "sqlite"), check_exhaustive: bool = True,
                       out=print):
    """Time `search` on 1x8 and 128x8 clusters (in memory and in a fresh SQLite file), compare its
    answer with `exhaustive_search`, and return the rows as a DataFrame."""
    import pandas as pd

    cases = BENCH_CASES[:1] + BENCH_CASES[2:3] if quick else BENCH_CASES
    if "optuna" not in sys.modules:  # paid once per process, by the first search; reported apart
        start = time.perf_counter()
        import optuna  # noqa: F401

        out(f"import optuna: {time.perf_counter() - start:.3f} s (once per process; not in the times below)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, model, nodes, per_node, device, batch in cases:
            spec, cluster = preset(model), Cluster(nodes, per_node, device)
            reference = exhaustive_search(spec, cluster, global_batch_size=batch, top_k=1) if check_exhaustive else []
            for kind in storages:
                name = label.replace(" ", "_")
                storage = {"memory": None, "journal": f"{tmp}/{name}.log", "sqlite": f"sqlite:///{tmp}/{name}.db"}[kind]
                clear_caches()  # every timed search starts cold, as in a fresh process
                start = time.perf_counter()
                result = search(spec, cluster, global_batch_size=batch, storage=storage)
                seconds = time.perf_counter() - start
                target = TARGET_SECONDS.get(nodes, math.inf)
                same = (reference[0].strategy == result.best.strategy) if reference and result.best else None
                rows.append({"case": label, "storage": kind, "seconds": round(seconds, 3), "target_s": target,
                             "within_target": seconds < target, "layouts": len(result.layouts),
                             "strategies_scored": result.n_evaluated, "trials": result.n_trials,
                             "best": result.best.strategy.describe() if result.best else "-",
                             "equals_exhaustive": same})
                out(f"{label:22s} {kind:6s} {seconds:7.3f} s  target {target:4.0f} s  best "
                    f"{rows[-1]['best']}  exhaustive match: {same}")
    return pd.DataFrame(rows)
