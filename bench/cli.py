"""The `tridist` command line.

    tridist bench kernels [--ops rms_norm,swiglu] [--dtype bf16] [--device auto] [--quick] [--no-compile] [--out DIR]
    tridist bench tune [--quick] [--no-sqlite]
    tridist tune --model llama2-70b --nodes 16 --devices-per-node 8 --device h100-sxm --global-batch 1024 [--report DIR]
    tridist calibrate [--device auto] [--quick] [--name NAME] [--out PATH]
    tridist bench model [--targets layer,model,hf-model,hf-moe] [--variants ...] [--quick] [--no-compile] [--out DIR]
    tridist bench overlap [--quick] [--device auto] [--out DIR]
    tridist bench all [--out DIR] [--steps sweep,check,kernels,model,calibrate] [--sweep-minutes 4]
    tridist autotune kernels [--ops ...] [--dtype bf16] [--trials 32] [--minutes M] [--quick] [--storage URL] [--out DIR]

Commands are data: COMMANDS maps a name to a `Command` (its arguments and its handler), and
`bench` has its own table of targets. Handlers import their package when they run, so that
`tridist --help` and argument errors stay instant (no torch, pandas or matplotlib at import time).
A new command (`tridist tune`, `tridist calibrate`, `tridist demo`) is one more entry.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Callable

# Known here as well as in bench.kernels (which imports torch): argument checking stays import-free.
# tests/test_bench.py checks that the two lists agree.
KERNEL_OPS = ("rms_norm", "add_rms_norm", "rotary", "swiglu", "geglu", "linear_cross_entropy")
KERNEL_DTYPES = ("bf16", "fp16", "fp32")
# The kernels `tridist autotune kernels` sweeps (autotune.kernel_sweep.OPS, checked by tests/test_bench.py): geglu
# runs swiglu's kernels with swiglu's tuned configurations; linear_cross_entropy sizes its chunks from memory.
SWEPT_OPS = ("rms_norm", "add_rms_norm", "rotary", "swiglu")


@dataclasses.dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int] | None = None
    subcommands: dict[str, "Command"] = dataclasses.field(default_factory=dict)


# -------------------------------------------------------------------------------- tridist bench kernels


def choice_list(valid: tuple[str, ...], what: str) -> Callable[[str], list[str]]:
    """An argparse type: 'a,b' -> ['a', 'b'], each one of `valid`; an unknown name is an error that lists them."""

    def parse(text: str) -> list[str]:
        given = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in given if name not in valid]
        if unknown or not given:
            raise argparse.ArgumentTypeError(
                f"unknown {what}(s): {', '.join(unknown) or '(none given)'}; valid {what}s: {', '.join(valid)}")
        return given

    return parse


parse_ops = choice_list(KERNEL_OPS, "op")  # 'rms_norm,swiglu' -> ['rms_norm', 'swiglu']


def _kernels_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", type=parse_ops, default=None,
                        help=f"comma-separated ops (default: all of {','.join(KERNEL_OPS)})")
    parser.add_argument("--dtype", choices=KERNEL_DTYPES, default=None,
                        help="element type (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--quick", action="store_true", help="one shape per op")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="skip the torch.compile baseline (its compilation dominates short runs)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="report directory (default: reports/kernels-<device>-<timestamp>/)")


def _launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed repeat (default 2000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; the best is kept (default 5)")
    parser.add_argument("--out", default="reports/launch", help="folder for results.csv, report.md, plot.png")


def _bench_launch(args: argparse.Namespace) -> int:
    from tridist.bench.launch import run_launch_benchmark

    run_launch_benchmark(calls=args.calls, repeats=args.repeats, out_dir=args.out)
    print((Path(args.out) / "report.md").read_text())
    return 0


def _bench_kernels(args: argparse.Namespace) -> int:
    from tridist.bench.kernels import resolve_device, run_kernel_benchmark

    try:
        device = resolve_device(args.device)
    except RuntimeError as exc:  # --device cuda without a GPU
        print(f"tridist bench kernels: error: {exc}", file=sys.stderr)
        return 2
    df = run_kernel_benchmark(ops=args.ops, dtype=args.dtype, device=device, quick=args.quick,
                              compile=args.compile, out_dir=args.out, progress=True)
    report_dir = df.attrs["report_dir"]
    with open(f"{report_dir}/report.md") as f:
        print(f.read())
    print(f"report: {report_dir}")
    errors = (df["error"].fillna("") != "").sum()
    return 1 if errors and errors == len(df) else 0  # fail only when nothing ran cleanly


def _check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="bf16,fp16,fp32", help="comma-separated of bf16, fp16, fp32")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="report directory (default: reports/correctness-<device>-<timestamp>/)")


def _check_kernels(args: argparse.Namespace) -> int:
    from tridist.bench.correctness import DTYPES, run_correctness_check
    from tridist.bench.kernels import resolve_device

    names = [name.strip() for name in args.dtype.split(",") if name.strip()]
    unknown = [name for name in names if name not in DTYPES]
    if unknown or not names:
        print(f"tridist check kernels: error: unknown dtype(s) {unknown}; valid: {', '.join(DTYPES)}", file=sys.stderr)
        return 2
    try:
        device = resolve_device(args.device)
    except RuntimeError as exc:
        print(f"tridist check kernels: error: {exc}", file=sys.stderr)
        return 2
    if device.type == "cpu":
        print("tridist check kernels: on a CPU the fused ops run their PyTorch path unless TRITON_INTERPRET=1 is "
              "set (then the Triton kernels run in the interpreter, on small shapes)", file=sys.stderr)
    frame = run_correctness_check(device=device, dtypes=[DTYPES[n] for n in names], quick=args.quick, out_dir=args.out)
    report_dir = frame.attrs["report_dir"]
    print((Path(report_dir) / "report.md").read_text())
    print(f"report: {report_dir}")
    return 0 if frame["ok"].all() else 1


# ------------------------------------------------------------------------------------- tridist tune


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _tune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="a preset (llama2-7b, llama2-70b, llama3-8b, gpt3-175b, megatron-76.1b, ...), a bench "
                             "model (seed-llama, hf-llama, paddle-llama) or module:function returning an nn.Module "
                             "or a ModelSpec")
    parser.add_argument("--size", default="seed", help="config size of a bench model (tiny, seed; default seed)")
    parser.add_argument("--nodes", type=_positive_int, required=True)
    parser.add_argument("--devices-per-node", type=_positive_int, required=True)
    parser.add_argument("--device", default="h100-sxm",
                        help="device profile: h100-sxm, h200, a100-80gb, a100-40gb, cpu, a calibrated profile's "
                             "name or a JSON path (default h100-sxm)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--engine", choices=("torch+tridist", "torch", "megatron"), default="torch+tridist",
                        help="the software that runs the step (autotune/engine.py): torch+tridist (what to_distributed "
                             "runs: torch-native with tridist's fused kernels; default), torch (eager torch-native) or "
                             "megatron (Megatron-LM's kernels, for comparison with its published figures)")
    parser.add_argument("--global-batch", type=_positive_int, required=True, help="sequences per step")
    parser.add_argument("--seq-len", type=_positive_int, default=None, help="tokens per sequence (default: the model's)")
    parser.add_argument("--trainable-fraction", type=float, default=None, metavar="F",
                        help="the share of the parameters that train, in (0, 1] (LoRA adapters on frozen weights: "
                             "~0.01; default: the model's requires_grad, 1 for a preset)")
    parser.add_argument("--storage", default=None,
                        help="Optuna storage: an RDB URL, an SQLite file path, a journal file (*.log) or 'memory' "
                             "(default: sqlite under ~/.cache/tridist/tune.db, resumable)")
    parser.add_argument("--top-k", type=_positive_int, default=10)
    parser.add_argument("--method", choices=("auto", "exhaustive", "tpe"), default="auto")
    parser.add_argument("--report", default=None, metavar="DIR", help="write report.md, ranked.csv, pareto.png there")
    parser.add_argument("--measure", action="store_true",
                        help="run the best predicted strategies for a few real steps on this job's devices (launch "
                             "with torchrun, nodes x devices-per-node processes; the model must be a bench model or "
                             "module:function building an nn.Module; random token batches) and rank them by the "
                             "clock; the device's step-time factor is refitted and saved as <device>-measured")
    parser.add_argument("--measure-top-k", type=_positive_int, default=3, help="candidates to measure (default 3)")
    parser.add_argument("--measure-steps", type=_positive_int, default=3, help="timed steps per candidate (default 3)")
    parser.add_argument("--measure-pick", choices=("top", "layouts"), default="top",
                        help="which candidates to measure: the best predicted (top, default) or the best of each "
                             "dp x tp x pp layout (layouts: the strategy benchmark, a spread of strategies with the "
                             "rank correlation of predicted and measured times)")


def _tune(args: argparse.Namespace) -> int:
    from tridist.bench.tune import run_tune

    return run_tune(args)


def _calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--name", default=None, help="profile name (default: measured-<device>)")
    parser.add_argument("--out", default=None, metavar="PATH",
                        help="JSON file to write (default: ~/.cache/tridist/device-profiles/<name>.json)")
    parser.add_argument("--sizes", default=None, help="comma-separated square matmul sizes")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (a smoke run)")
    parser.add_argument("--no-comm", action="store_true", help="skip collectives even under torchrun")


def _calibrate(args: argparse.Namespace) -> int:
    from tridist.bench.tune import run_calibrate

    return run_calibrate(args)


def _bench_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="DIR",
                        help="run directories written by `tridist bench kernels` (results.csv, or bench/results.csv); "
                             "one: re-render it; several: compare each with the first")
    parser.add_argument("--out", default=None, metavar="DIR", help="report directory (default: reports/report-<time>/)")
    parser.add_argument("--noise", type=float, default=None,
                        help="relative change within which two runs on one device count as the same (default 0.05)")


def _bench_report(args: argparse.Namespace) -> int:
    import datetime

    from tridist.bench.compare import DEFAULT_NOISE, RunError, write_report

    out = args.out or f"reports/report-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    noise = DEFAULT_NOISE if args.noise is None else args.noise
    if not 0 <= noise < 1:
        print(f"tridist bench report: error: --noise must be in [0, 1), got {noise}", file=sys.stderr)
        return 2
    try:
        out, regressions = write_report(args.runs, out, noise=noise)
    except RunError as exc:
        print(f"tridist bench report: error: {exc}", file=sys.stderr)
        return 2
    print((out / "report.md").read_text())
    print(f"report: {out}")
    return 1 if regressions else 0


def _bench_tune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="one 1x8 and one 128x8 case")
    parser.add_argument("--no-sqlite", action="store_true", help="time the in-memory storage only")


def _bench_tune(args: argparse.Namespace) -> int:
    from tridist.bench.tune import run_tune_benchmark

    frame = run_tune_benchmark(quick=args.quick, storages=("memory",) if args.no_sqlite else ("memory", "journal", "sqlite"))
    print(frame.to_string(index=False))
    return 0 if frame["equals_exhaustive"].all() else 1


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    # The names of bench.model_bench's TARGETS and VARIANTS (which imports torch): argument checking
    # stays import-free; tests/test_model_bench.py checks that they agree.
    targets = ("layer", "model", "hf-model", "hf-moe")
    variants = ("eager", "compile", "liger", "fused-no-lce", "fused-experts-loop", "fused", "fused+compile")
    parser.add_argument("--targets", type=choice_list(targets, "target"), default=None,
                        help=f"comma-separated of {','.join(targets)} (default: all): one decoder layer's "
                             "forward+backward, a small Llama's training step, the same step on transformers' Llama "
                             "and Mixtral (needs transformers)")
    parser.add_argument("--variants", type=choice_list(variants, "variant"), default=None,
                        help=f"comma-separated of {','.join(variants)} (default: all; liger needs a GPU and liger_kernel; "
                             "fused-no-lce is fuse without the fused LM head + loss, hf-model only; fused-experts-loop "
                             "runs hf-moe's experts as a loop where fused runs grouped GEMMs)")
    parser.add_argument("--dtype", choices=KERNEL_DTYPES, default=None,
                        help="parameter dtype (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (GPU: 2048-token layer, 2-layer model)")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="skip the torch.compile variants (compile, fused+compile)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="report directory (default: reports/model-<device>-<timestamp>/)")


def _bench_model(args: argparse.Namespace) -> int:
    from tridist.bench.kernels import resolve_device
    from tridist.bench.model_bench import COMPILED_VARIANTS, TARGETS, VARIANTS, exit_status, run_model_benchmark

    try:
        device = resolve_device(args.device)
    except RuntimeError as exc:  # --device cuda without a GPU
        print(f"tridist bench model: error: {exc}", file=sys.stderr)
        return 2
    variants = [v for v in (args.variants or VARIANTS) if args.compile or v not in COMPILED_VARIANTS]
    if not variants:
        print("tridist bench model: error: --no-compile leaves no variant to run", file=sys.stderr)
        return 2
    df = run_model_benchmark(targets=args.targets or TARGETS, variants=variants, device=device,
                             dtype=args.dtype, quick=args.quick, out_dir=args.out, progress=True)
    report_dir = df.attrs["report_dir"]
    print((Path(report_dir) / "report.md").read_text())
    print(f"report: {report_dir}")
    return exit_status(df)  # 1: a variant disagreed with eager, or nothing ran cleanly


# ---------------------------------------------------------------------------- tridist bench overlap


def _overlap_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--quick", action="store_true", help="one case per link (hidden 4096, 8192 tokens, tp 8)")
    parser.add_argument("--out", default=None, metavar="DIR", help="report directory (default: reports/overlap-<time>/)")


def _bench_overlap(args: argparse.Namespace) -> int:
    from tridist.bench.overlap import run

    return run(args)


# -------------------------------------------------------------------------------- tridist bench all


def _parse_steps(text: str) -> list[str]:
    from tridist.bench.all import STEP_NAMES  # light: no torch at import

    return choice_list(STEP_NAMES, "step")(text)


def _bench_all_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="evidence folder (default: bench/results/<device>-<date>/)")
    parser.add_argument("--steps", type=_parse_steps, default=None,
                        help="comma-separated subset, run in the fixed order (default: sweep,check,kernels,model,calibrate)")
    parser.add_argument("--sweep-minutes", type=_positive_float, default=4.0,
                        help="time budget of the kernel sweep step (default 4)")


def _bench_all(args: argparse.Namespace) -> int:
    from tridist.bench.all import run_bench_all

    return run_bench_all(args)


# --------------------------------------------------------------------------- tridist autotune kernels


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def _parse_swept_ops(text: str) -> list[str]:
    given = [name.strip() for name in text.split(",") if name.strip()]
    if "geglu" in given:
        raise argparse.ArgumentTypeError("geglu runs swiglu's kernels with swiglu's tuned configurations: sweep swiglu")
    return choice_list(SWEPT_OPS, "op")(text)


def _autotune_kernels_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", type=_parse_swept_ops, default=None,
                        help=f"comma-separated ops (default: all of {','.join(SWEPT_OPS)}; geglu shares swiglu's "
                             "configurations); forward and backward kernels are swept separately")
    parser.add_argument("--dtype", default="bf16", help="comma-separated of bf16, fp16, fp32 (default bf16)")
    parser.add_argument("--trials", type=_positive_int, default=32,
                        help="trials per shape bucket, the heuristic's included (default 32)")
    parser.add_argument("--minutes", type=_positive_float, default=None,
                        help="time budget of the whole sweep, shared by the buckets (default: none)")
    parser.add_argument("--quick", action="store_true", help="one shape per kernel (16384 tokens)")
    parser.add_argument("--storage", default=None,
                        help="Optuna storage: an RDB URL, an SQLite file path, a journal file (*.log) or 'memory' "
                             "(default: sqlite under ~/.cache/tridist/kernel-sweep.db; an interrupted sweep resumes)")
    parser.add_argument("--table", default=None, metavar="PATH",
                        help="tuned table to update (default: where the kernels look for this device, "
                             "~/.cache/tridist/kernel-configs/<device>.json, or $TRIDIST_KERNEL_CONFIGS)")
    parser.add_argument("--no-write", dest="write", action="store_false", help="report only; leave the table alone")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="report directory (default: reports/kernel-sweep-<device>-<timestamp>/)")


def _autotune_kernels(args: argparse.Namespace) -> int:
    from tridist.bench.kernel_tune import run_kernel_autotune

    return run_kernel_autotune(args)


# ------------------------------------------------------------------------------------------- the table


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes to launch (default: one per GPU, else 4 CPU processes)")


def _demo(args: argparse.Namespace) -> int:
    from tridist.bench.demo import launch

    return launch(args.nproc)


COMMANDS: dict[str, Command] = {
    "demo": Command(
        help="to_distributed end to end: the seed's model on this machine's devices, strategy chosen, losses vs one device",
        add_arguments=_demo_arguments,
        handler=_demo,
    ),
    "check": Command(
        help="correctness checks",
        add_arguments=lambda parser: None,
        subcommands={
            "kernels": Command(
                help="fused ops' forward and backward vs the references at training sizes (compiled on a GPU)",
                add_arguments=_check_arguments,
                handler=_check_kernels,
            ),
        },
    ),
    "bench": Command(
        help="benchmarks and reports",
        add_arguments=lambda parser: None,
        subcommands={
            "kernels": Command(
                help="fused ops vs eager, torch.compile and Liger-Kernel: time, GB/s, share of copy bandwidth",
                add_arguments=_kernels_arguments,
                handler=_bench_kernels,
            ),
            "launch": Command(
                help="host time of each fused op's launch path (Triton launch stubbed out) against torch.mul, "
                     "forward and forward+backward; targets 3x and 2x",
                add_arguments=_launch_arguments,
                handler=_bench_launch,
            ),
            "all": Command(
                help="all GPU evidence in one folder: kernel sweep, correctness, kernel and model benchmarks, "
                     "calibration (exit 3 without a GPU)",
                add_arguments=_bench_all_arguments,
                handler=_bench_all,
            ),
            "overlap": Command(
                help="the overlapped all-gather ring emulated on one GPU: communication hidden, chunking overhead, "
                     "interference, at hidden 4096/8192, 8k-32k tokens, tp 2/4/8, 450/100/25 GB/s links",
                add_arguments=_overlap_arguments,
                handler=_bench_overlap,
            ),
            "report": Command(
                help="render a kernel-benchmark run, or compare runs (before/after, two devices) and flag regressions",
                add_arguments=_bench_report_arguments,
                handler=_bench_report,
            ),
            "tune": Command(
                help="strategy-search speed on 1x8 and 128x8 clusters and agreement with exhaustive enumeration",
                add_arguments=_bench_tune_arguments,
                handler=_bench_tune,
            ),
            "model": Command(
                help="a decoder layer's forward+backward and a small Llama's training step: eager, torch.compile, "
                     "Liger-Kernel, fuse(), fuse()+compile; time, tokens/s, peak memory",
                add_arguments=_model_arguments,
                handler=_bench_model,
            ),
        },
    ),
    "tune": Command(
        help="search the fastest training strategy (dp/tp/pp, sharding, micro-batches, recompute) with the cost model",
        add_arguments=_tune_arguments,
        handler=_tune,
    ),
    "autotune": Command(
        help="auto-tuning sweeps",
        add_arguments=lambda parser: None,
        subcommands={
            "kernels": Command(
                help="Optuna sweeps of the fused kernels' launch configurations on this GPU; writes the table the "
                     "kernels read at launch (exit 3 without a GPU)",
                add_arguments=_autotune_kernels_arguments,
                handler=_autotune_kernels,
            ),
        },
    ),
    "calibrate": Command(
        help="measure this machine (matmul, copy, collectives under torchrun) and save a device profile",
        add_arguments=_calibrate_arguments,
        handler=_calibrate,
    ),
}


def _add_commands(subparsers, commands: dict[str, Command], dest: str) -> None:
    for name, command in commands.items():
        parser = subparsers.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(parser)
        if command.subcommands:
            nested = parser.add_subparsers(dest=f"{dest}_{name}", metavar="TARGET", required=True)
            _add_commands(nested, command.subcommands, f"{dest}_{name}")
        else:
            parser.set_defaults(handler=command.handler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tridist", description="tridist: fused kernels and distributed training")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_commands(subparsers, COMMANDS, "command")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tridist` console script and of `python -m tridist`; returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
