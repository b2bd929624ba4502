"""Sweep `tridist.distcore.to_distributed` over transformers' vision-language models (tests/distributed/vision_worker.py's
MODELS: Qwen2.5-VL, Qwen2-VL, Qwen3-VL, LLaVA, Gemma 3, Mistral 3, Pixtral, LFM2-VL, InternVL, GLM-4.1V, tiny) and strategies on 4 gloo processes (torchrun), each trained 2 SGD steps on
batches of images as users collate them (any number of images per sample, each of its own size, some samples with
none) and compared with one process (tests/distributed/equivalence.py).

    python3 scripts/sweep_vision.py [MODEL ...] [--strategy NAME ...] [--mixed-precision bfloat16] [--out sweep.jsonl]

One JSON line per (model, strategy), with the verdicts of scripts/sweep_distributed.py: equal, refused (one of
tridist's errors, naming why), differs (a bug), crash (any other exception: a bug). Strategies: those of
sweep_distributed.py (default: all). --mixed-precision bfloat16: to_distributed's mixed_precision, compared with one fp32
process to bf16 rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sweep_distributed, beside this file
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.distributed

from sweep_distributed import NPROC, STRATEGIES, TIMEOUT_S, _ours  # noqa: E402


def worker(model_name: str, strategy_name: str, mixed_precision: str | None = None) -> dict:
    from tests.distributed import vision_worker
    from tridist import autotune, distcore

    distcore.init_parallel_env()
    row = {"model": model_name, "strategy": strategy_name, **({"mixed precision": mixed_precision} if mixed_precision else {})}
    fields = STRATEGIES[strategy_name]
    try:
        chosen = vision_worker.train(vision_worker.MODELS[model_name],
                                     None if fields is None else autotune.Strategy(**fields),
                                     mixed_precision=mixed_precision)
        return {**row, "chosen": chosen.describe(), "verdict": "equal"}
    except AssertionError as error:
        return {**row, "verdict": "differs", "error": str(error)[:400]}
    except Exception as error:  # noqa: BLE001 - classified and reported
        where = traceback.extract_tb(error.__traceback__)[-1]
        return {**row, "verdict": "refused" if _ours(error) else "crash", "error": f"{type(error).__name__}: {error}"[:400],
                "raised at": f"{os.path.basename(where.filename)}:{where.lineno}"}


def _launch(model_name: str, strategy: str, mixed_precision: str | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as rows_dir:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
                   os.path.abspath(__file__), "--worker", model_name, "--strategy", strategy, "--rows", rows_dir,
                   *(["--mixed-precision", mixed_precision] if mixed_precision else [])]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            return {"model": model_name, "strategy": strategy, "verdict": "process", "error": f"over {TIMEOUT_S} s"}
        rows = [json.load(open(os.path.join(rows_dir, name))) for name in sorted(os.listdir(rows_dir))]
    if not rows:
        return {"model": model_name, "strategy": strategy, "verdict": "process",
                "error": f"exit {done.returncode}: {done.stderr[-300:]}"}
    failed = sorted((r for r in rows if r["verdict"] != "equal"), key=lambda r: "remote worker" in r.get("error", ""))
    return failed[0] if failed else rows[0]


def main() -> None:
    from tests.distributed.vision_worker import MODELS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", help=f"of {list(MODELS)} (default: all)")
    parser.add_argument("--strategy", nargs="*", choices=list(STRATEGIES), help="default: all")
    parser.add_argument("--mixed-precision", choices=["bfloat16"], help="to_distributed's mixed_precision")
    parser.add_argument("--out", help="also write the JSON lines here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rows", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        row = worker(args.worker, args.strategy[0], args.mixed_precision)
        with open(os.path.join(args.rows, f"rank{int(os.environ.get('RANK', 0)):03d}.json"), "w") as file:
            json.dump(row, file)
        return
    out = open(args.out, "w") if args.out else None
    start = time.monotonic()
    for model_name in args.models or list(MODELS):
        for strategy in args.strategy or list(STRATEGIES):
            row = _launch(model_name, strategy, args.mixed_precision)
            for stream in filter(None, (sys.stdout, out)):
                print(json.dumps(row), file=stream, flush=True)
            print(f"[{time.monotonic() - start:.0f} s] {model_name} {strategy}: {row['verdict']} "
                  f"{row.get('chosen', row.get('error', ''))[:80]}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
