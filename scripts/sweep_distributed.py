"""Sweep `tridist.distcore.to_distributed` over the causal LMs transformers ships (every `AutoModelForCausalLM`
model type, or those named): each built at tiny sizes as scripts/sweep_families.py builds it, distributed over 4
gloo processes (torchrun) with the users' default config (fused kernels on) and one strategy, trained 2 SGD steps
on padded batches and compared with one process by tests/distributed/equivalence.py's criteria. Run it after a
transformers upgrade or a change to distcore: the verdicts say which families still train as one process does.

    python3 scripts/sweep_distributed.py [MODEL_TYPE ...] [--strategy dp2-tp2-sp] [--attention eager] [--dropout 0.1]
                                         [--lora] [--mixed-precision bfloat16] [--out sweep.jsonl]

One JSON line per model type (also written to --out), progress on stderr, a count per verdict at the end:
- equal: the first-step gradients, the losses and the parameters after the steps are one process's (the
  `measured` errors are fractions of what equivalence.py allows: 1 is the limit);
- refused: to_distributed, parallelize or the first training step raised one of tridist's errors, naming why (a
  model whose code was not written for this strategy gets an error, never wrong numbers; `stage` says when);
- differs at the first step: the first-step gradients or the losses differ: a bug;
- differs after the steps: the first step is equal but the parameters after the steps are not: a bug in the
  update, or rounding the optimizer amplified (a model whose training diverges; look at the losses);
- crash: any other exception (raised by torch or transformers, or a KeyError/AttributeError of ours): a bug, as
  the error names no cause;
- build / memory / process: the model does not build (or train on one process) at tiny sizes, or not within the
  address-space limit (fixed vision or audio sizes); the launch timed out or died (the kernel's OOM killer).

Strategies (--strategy): dp2-tp2-sp (dp 2 x tp 2 with sequence parallel, the default: the strategy that asks most
of a model's code), dp2-tp2, tp2-pp2 (2 micro-batches), dp2-pp2 (2 micro-batches, full recompute: the layer
list alone, also of models whose layers tensor parallel cannot read), dp4-zero3, tp4-sp (tp 4 with sequence
parallel: the tiny configs' 2 key/value heads each computed on 2 ranks), searched (to_distributed's own choice). --attention: transformers' attention implementation ("eager": explicit matmuls and softmax; "sdpa"; the
default: each model's own, SDPA for most). --dropout P: every dropout of the config at P instead of 0; one
process's numbers are then out of reach (the ranks draw their own masks), so the verdict is whether the ranks that
hold a parameter still agree on it after the steps ("replicas agree"; "replicas differ": a bug, silent in training)
with finite losses. --lora: peft's LoRA adapters on every projection but the head (the base weights frozen).
--mixed-precision bfloat16: to_distributed's mixed_precision (FSDP2 computing in bf16 over fp32 parameters, reducing
in fp32), compared with one fp32 process to bf16 rounding (equivalence.BF16_RTOL, BF16_LOSS_RTOL).
SGD at lr 0.1 (the tests' 0.5 makes some tiny models diverge, whose parameters then differ by amplified rounding);
dropout and router jitter off (`build_tiny(deterministic=True)`: ranks would draw other masks than one process;
PhiMoE's router samples in training regardless).
Each model type runs under a timeout, each process under an address-space limit. A run of the 2026-11-27 code:
README ("Tried by hand").
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sweep_families, beside this file
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.distributed.equivalence

from sweep_families import VOCAB, build_tiny  # noqa: E402

NPROC = 4
MEMORY_LIMIT = 6 << 30  # address space per process: torch and gloo take ~2 GiB of it, a tiny text model little more
TIMEOUT_S = 300
BATCH, BATCHES, SEQ_LEN, LR = 4, 2, 8, 0.1
STRATEGIES = {  # name -> autotune.Strategy fields (None: searched); the global batch of 4 sequences
    "dp2-tp2-sp": dict(dp=2, tp=2, pp=1, micro_batch_size=2, sharding_level=2, sequence_parallel=True),
    "dp2-tp2": dict(dp=2, tp=2, pp=1, micro_batch_size=2, sharding_level=2),
    "tp2-pp2": dict(dp=1, tp=2, pp=2, micro_batch_size=2, num_micro_batches=2),
    "dp2-pp2": dict(dp=2, tp=1, pp=2, micro_batch_size=1, num_micro_batches=2, recompute="full"),
    "dp4-zero3": dict(dp=4, tp=1, pp=1, micro_batch_size=1, sharding_level=3),
    "tp4-sp": dict(dp=1, tp=4, pp=1, micro_batch_size=4, sequence_parallel=True),
    "searched": None,
}


def _batches():
    """Two global batches of 4 padded sequences: left padding labelled -100, as Hugging Face's collators do."""
    import torch

    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(BATCHES):
        ids = torch.randint(3, VOCAB, (BATCH, SEQ_LEN), generator=generator)
        mask = torch.ones(BATCH, SEQ_LEN, dtype=torch.long)
        mask[1, :3] = 0
        mask[3, :4] = 0
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return batches


def _one_process(model):
    """The reference: the plain loop on one process."""
    import torch
    from tests.distributed import equivalence

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    trace = equivalence.Trace()
    for batch in _batches():
        torch.manual_seed(1)  # routers' jitter draws alike in both runs (dropout cannot: other slices per rank)
        out = model(**batch)
        out.loss.backward()
        trace.step(model, out.loss)
        optimizer.step()
        optimizer.zero_grad()
    return trace.end(model)


def _ours(error: BaseException) -> bool:
    """An error tridist raised on purpose, naming its cause: a ValueError, TypeError, NotImplementedError or
    RuntimeError (InvalidStrategy, UnrecognisedModel, TensorParallelCheckError among them) whose innermost frame
    is tridist's code."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    ours = (ValueError, TypeError, NotImplementedError, RuntimeError, AttributeError)  # pipeline stand-ins name the attribute
    return module.startswith("tridist.") and isinstance(error, ours)


def worker(model_type: str, strategy_name: str, attention: str | None = None, dropout: float | None = None,
           lora: bool = False, mixed_precision: str | None = None) -> dict:
    """One model type on this process's rank (under torchrun): its row, the same on every rank but for errors."""
    import torch
    import torch.distributed as dist

    from tests.distributed import equivalence
    from tridist import autotune, distcore

    distcore.init_parallel_env()
    row = {"type": model_type, "strategy": strategy_name, **({"attention": attention} if attention else {}),
           **({"dropout": dropout} if dropout is not None else {}), **({"lora": True} if lora else {}),
           **({"mixed precision": mixed_precision} if mixed_precision else {})}
    try:
        # Dropout off unless asked for: the ranks draw other masks than one process
        model, _ = build_tiny(model_type, deterministic=dropout is None, attention=attention, dropout=dropout)
        if hasattr(getattr(model, "config", None), "use_cache"):
            model.config.use_cache = False  # training: no key/value cache (hybrid models' caches refuse padded calls)
        if lora:  # all-linear LoRA, the base frozen, B drawn non-zero (as the suite's LoRA checks)
            from tests.distributed.transformers_worker import _lora

            model = _lora(model)
        reference = _one_process(copy.deepcopy(model)) if dropout is None else None
    except Exception as error:  # noqa: BLE001 - reported
        memory = "can't allocate memory" in str(error)  # the address-space limit (a vision tower's fixed sizes)
        return {**row, "verdict": "memory" if memory else "build", "error": f"{type(error).__name__}: {error}"[:300]}
    fields = STRATEGIES[strategy_name]
    strategy = None if fields is None else autotune.Strategy(**fields)
    samples = [{k: v[i] for k, v in b.items()} for b in _batches() for i in range(BATCH)]
    loader = torch.utils.data.DataLoader(samples, batch_size=BATCH)
    stage = "to_distributed"
    try:
        model, optimizer, loader = distcore.to_distributed(
            model, torch.optim.SGD(model.parameters(), lr=LR), loader, device_num=dist.get_world_size(),
            config=distcore.ToDistributedConfig(strategy=strategy, mixed_precision=mixed_precision))
        chosen = model.distributed_strategy
        row["chosen"] = f"dp{chosen.dp} tp{chosen.tp} pp{chosen.pp}{' sp' if chosen.sequence_parallel else ''}"
        row["global view"] = sorted(n for n, m in model.named_modules() if hasattr(m, "_tridist_global_view"))[:4]
        row["fused"] = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Fused")})
        stage = "training"
        trace, losses = equivalence.Trace(), []
        for batch in loader():
            torch.manual_seed(1)
            out = model(**batch)
            out.loss.backward()
            trace.step(model, out.loss)
            losses.append(out.loss.item())
            optimizer.step()
            optimizer.clear_grad()
        trace = trace.end(model)
        stage = "comparison"
        if dropout is not None:
            disagree = equivalence.shared_parameters_disagree(model)
            if disagree or not all(math.isfinite(loss) for loss in losses):
                return {**row, "verdict": "replicas differ", "error": f"losses {losses}; {len(disagree)} parameter(s) "
                                                                     f"differ between ranks: {disagree[:4]}"}
            return {**row, "verdict": "replicas agree"}
        equivalence.MEASURED.clear()
        rounding = {} if mixed_precision is None else dict(rtol=equivalence.BF16_RTOL, loss_rtol=equivalence.BF16_LOSS_RTOL)
        equivalence.assert_same_training(trace, reference, unused_zero=True, **rounding)  # (unused: experts no rank chose)
        return {**row, "verdict": "equal", "measured": {k: round(v, 4) for k, v in equivalence.MEASURED.items()}}
    except AssertionError as error:
        first = any(what in str(error) for what in ("initial values", "first-step gradients", "loss"))
        verdict = "differs at the first step" if first else "differs after the steps"
        return {**row, "verdict": verdict if stage == "comparison" else "crash", "error": str(error)[:400]}
    except Exception as error:  # noqa: BLE001 - classified and reported
        verdict = "refused" if _ours(error) else "crash"  # in training too: a late but clear error
        where = traceback.extract_tb(error.__traceback__)[-1]
        return {**row, "verdict": verdict, "stage": stage, "error": f"{type(error).__name__}: {error}"[:400],
                "raised at": f"{os.path.basename(where.filename)}:{where.lineno}"}


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _launch(model_type: str, strategy: str, attention: str | None = None, dropout: float | None = None,
            lora: bool = False, mixed_precision: str | None = None) -> dict:
    """torchrun on NPROC processes for one model type: rank 0's row (any rank's error where rank 0 has none)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as rows_dir:  # a file per rank: their stdout lines may interleave
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
                   os.path.abspath(__file__), "--worker", model_type, "--strategy", strategy, "--rows", rows_dir,
                   *(["--attention", attention] if attention else []),
                   *(["--dropout", str(dropout)] if dropout is not None else []), *(["--lora"] if lora else []),
                   *(["--mixed-precision", mixed_precision] if mixed_precision else [])]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, preexec_fn=_limited,
                                  env=env)
        except subprocess.TimeoutExpired:
            return {"type": model_type, "strategy": strategy, "verdict": "process", "error": f"over {TIMEOUT_S} s"}
        rows = [json.load(open(os.path.join(rows_dir, name))) for name in sorted(os.listdir(rows_dir))]
    if not rows:
        killed = "exitcode  : -9" in done.stderr  # torchrun's report of a rank the kernel's OOM killer took
        return {"type": model_type, "strategy": strategy, "verdict": "process",
                "error": "a rank was killed (out of memory?)" if killed else f"exit {done.returncode}: {done.stderr[-300:]}"}
    # The rank whose own error stopped the run, not one that lost its peer (gloo: "... caused by a remote worker ...")
    failed = sorted((r for r in rows if r["verdict"] not in ("equal", "replicas agree", "build")),
                    key=lambda r: "remote worker" in r.get("error", ""))
    return failed[0] if failed else rows[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", help="model types (default: every AutoModelForCausalLM one)")
    parser.add_argument("--strategy", default="dp2-tp2-sp", choices=list(STRATEGIES))
    parser.add_argument("--attention", choices=["eager", "sdpa"], help="transformers' attention implementation "
                        "(default: each model's own)")
    parser.add_argument("--dropout", type=float, help="every dropout of the config at this probability; the verdict "
                        "is whether the replicas agree after the steps")
    parser.add_argument("--lora", action="store_true", help="peft's LoRA adapters on every projection but the head, "
                        "the base weights frozen (as users fine-tune)")
    parser.add_argument("--mixed-precision", choices=["bfloat16"], help="to_distributed's mixed_precision; compared "
                        "with one fp32 process to bf16 rounding")
    parser.add_argument("--out", help="also write the JSON lines here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a torchrun process: one model type
    parser.add_argument("--rows", help=argparse.SUPPRESS)  # where each rank writes its row
    args = parser.parse_args()
    if args.worker:
        import logging

        logging.getLogger("tridist").setLevel(logging.ERROR)
        row = worker(args.worker, args.strategy, args.attention, args.dropout, args.lora, args.mixed_precision)
        with open(os.path.join(args.rows, f"rank{int(os.environ.get('RANK', 0)):03d}.json"), "w") as file:
            json.dump(row, file)
        return
    types = args.types
    if not types:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        types = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    out = open(args.out, "w") if args.out else None
    counts: dict[str, int] = {}
    start = time.monotonic()
    for i, model_type in enumerate(types, 1):
        row = _launch(model_type, args.strategy, args.attention, args.dropout, args.lora, args.mixed_precision)
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
        print(json.dumps(row), flush=True)
        if out:
            print(json.dumps(row), file=out, flush=True)
        detail = row.get("chosen", "") if row["verdict"] in ("equal", "replicas agree") else row.get("error", "")[:70]
        print(f"[{i}/{len(types)}, {time.monotonic() - start:.0f} s] {model_type}: {row['verdict']} {detail}",
              file=sys.stderr, flush=True)
    print(f"{len(types)} model types under {args.strategy}{', ' + args.attention + ' attention' if args.attention else ''}: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())),
          file=sys.stderr)


if __name__ == "__main__":
    main()
