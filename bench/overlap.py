"""`tridist bench overlap`: how well the all-gather ring hides its transfers, on one GPU.

One GPU has no peer to exchange chunks with, so the ring of `tp` ranks is emulated: the matmuls are the
real ones (`tp` chunks of [tokens / tp, hidden] times the entry weight [hidden, out / tp], into one
output), and each of the `tp - 1` transfers is a device-to-device copy of one chunk on a side stream
followed by a GPU spin (`torch.cuda._sleep`, one thread block) lasting what the chunk takes at the link's
bandwidth (450 GB/s NVLink-class, 100 GB/s, 25 GB/s; the copy itself comes on top, a few percent at
these rates). The schedule is the ring's (as `kernels.comm_matmul` posts it): the transfer of chunk
s + 1 is posted once the work queued before matmul s is done (the chunk it forwards has arrived, its
buffer is free), runs beside matmul s, and matmul s + 1 waits for it.

Reported per case (hidden, tokens, tp, link):
- `full_ms`: one unchunked matmul; `chunked_ms`: the tp chunked matmuls alone; `chunking_overhead`:
  chunked / full - 1 (smaller matmuls run less efficiently);
- `comm_ms`: the tp - 1 transfers alone; `overlapped_ms`: the ring; `exposed_ms`: overlapped - chunked;
  `hidden_fraction`: 1 - exposed / comm (1: every transfer hidden);
- `interference`: the matmuls' slowdown from copies running beside them (the same ring with the copies
  only, no spin: they take memory bandwidth and an SM or two; NCCL's kernels hold more SMs for the whole
  transfer, so this is a lower bound of what real transfers cost).

Targets (benchmarks, not tests) on H100/H200: at tp 8 over a 450 GB/s link at least 80% hidden, and a
chunking overhead of at most 5%. On a CPU the matmuls and "transfers" run one after the other (no
streams): the rows show the benchmark runs, and nothing is concluded from them.

`calibrate_overlap` measures one layer's entry at the calibration shape and returns the two numbers the
cost model's overlap term uses per device profile (`DeviceProfile.overlap_chunking_overhead`,
`overlap_interference`; `tridist calibrate` stores them on a GPU).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from pathlib import Path

import torch

LINKS_GBPS = {"nvlink-450": 450.0, "link-100": 100.0, "link-25": 25.0}
HIDDEN = (4096, 8192)
TOKENS = (8192, 16384, 32768)
TP = (2, 4, 8)
QUICK = dict(hidden=(4096,), tokens=(8192,), tp=(8,))
CPU_CASE = dict(hidden=(64,), tokens=(64,), tp=(2, 4))
COLUMNS = ("hidden", "tokens", "tp", "link", "link_gbps", "dtype", "full_ms", "chunked_ms", "chunking_overhead",
           "comm_ms", "overlapped_ms", "exposed_ms", "hidden_fraction", "copies_only_ms", "interference", "device")


def ffn_width(hidden: int) -> int:
    """Llama's SwiGLU width, 3.5 x hidden rounded to 256 (14336 for 4096): the entry is gate and up."""
    return int(round(3.5 * hidden / 256)) * 256


@dataclasses.dataclass
class _Ring:
    """One emulated entry: this rank's chunk, every rank's chunk slot, the weight, the output."""

    chunks: torch.Tensor  # [tp, rows, hidden]: slot s holds the chunk of step s
    weight_t: torch.Tensor  # [hidden, out]
    out: torch.Tensor  # [tp * rows, out]

    @staticmethod
    def make(hidden: int, tokens: int, tp: int, dtype: torch.dtype, device: torch.device) -> "_Ring":
        rows, out = tokens // tp, 2 * ffn_width(hidden) // tp
        gen = torch.Generator(device="cpu").manual_seed(0)
        chunks = torch.randn(tp, rows, hidden, generator=gen).to(device=device, dtype=dtype)
        weight_t = (torch.randn(hidden, out, generator=gen) / hidden**0.5).to(device=device, dtype=dtype)
        return _Ring(chunks, weight_t, torch.empty(tp * rows, out, device=device, dtype=dtype))

    def matmul(self, step: int) -> None:
        rows = self.chunks.shape[1]
        torch.mm(self.chunks[step], self.weight_t, out=self.out[step * rows:(step + 1) * rows])

    def full(self) -> None:
        torch.mm(self.chunks.view(-1, self.chunks.shape[-1]), self.weight_t, out=self.out)


class _Link:
    """A transfer of one chunk: a copy into the next slot plus a spin for the rest of the time the link takes."""

    def __init__(self, ring: _Ring, gbps: float | None, cycles_per_s: float):
        self.ring, self.spare = ring, torch.empty_like(ring.chunks[0])
        chunk_bytes = ring.chunks[0].numel() * ring.chunks.element_size()
        self.cycles = 0 if gbps is None else int(chunk_bytes / (gbps * 1e9) * cycles_per_s)

    def transfer(self, step: int) -> None:
        self.spare.copy_(self.ring.chunks[step])  # the bytes move through memory, as a received chunk does
        if self.cycles and self.spare.is_cuda:
            torch.cuda._sleep(self.cycles)


def _gpu_cycles_per_second(device: torch.device) -> float:
    """torch.cuda._sleep's cycles per second, measured on this GPU before the cases run (its clock then;
    under a matmul's load the SM clock may run lower, so an emulated transfer can last a little longer)."""
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize(device)
    return cycles / (start.elapsed_time(end) * 1e-3)


def _time_ms(fn, device: torch.device, repeats: int) -> float:
    """Median ms over `repeats` runs after one warm-up (CUDA events around the whole ring; perf_counter on CPU)."""
    import time

    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


def _ring_schedule(ring: _Ring, link: _Link, side) -> None:
    """The all-gather ring's schedule on one GPU: transfer s + 1 beside matmul s, each matmul after its chunk."""
    tp = ring.chunks.shape[0]
    if side is None:  # CPU: no concurrency
        for step in range(tp):
            if step + 1 < tp:
                link.transfer(step + 1)
            ring.matmul(step)
        return
    main = torch.cuda.current_stream()
    arrived = [None] * tp
    for step in range(tp):
        if step + 1 < tp:
            side.wait_stream(main)  # the chunk being sent is ready; the spare is free again
            with torch.cuda.stream(side):
                link.transfer(step + 1)
                arrived[step + 1] = torch.cuda.Event()
                arrived[step + 1].record(side)
        if arrived[step] is not None:
            main.wait_event(arrived[step])
        ring.matmul(step)
    main.wait_stream(side)


def measure_case(hidden: int, tokens: int, tp: int, gbps: float | None, *, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16, repeats: int = 10, cycles_per_s: float = 0.0) -> dict:
    ring = _Ring.make(hidden, tokens, tp, dtype, device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    link, copies_only = _Link(ring, gbps, cycles_per_s), _Link(ring, None, cycles_per_s)

    def transfers():
        for step in range(1, tp):
            link.transfer(step)

    full = _time_ms(ring.full, device, repeats)
    chunked = _time_ms(lambda: [ring.matmul(s) for s in range(tp)], device, repeats)
    comm = _time_ms(transfers, device, repeats)
    overlapped = _time_ms(lambda: _ring_schedule(ring, link, side), device, repeats)
    with_copies = _time_ms(lambda: _ring_schedule(ring, copies_only, side), device, repeats)
    exposed = max(0.0, overlapped - chunked)
    return {"hidden": hidden, "tokens": tokens, "tp": tp, "full_ms": full, "chunked_ms": chunked,
            "chunking_overhead": chunked / full - 1, "comm_ms": comm, "overlapped_ms": overlapped,
            "exposed_ms": exposed, "hidden_fraction": 1 - min(exposed, comm) / comm if comm > 0 else math.nan,
            "copies_only_ms": with_copies, "interference": with_copies / chunked - 1,
            "dtype": str(dtype).removeprefix("torch.")}


def run_overlap_benchmark(*, device=None, quick: bool = False, links: dict | None = None, shapes: dict | None = None,
                          repeats: int | None = None, progress=print):
    """Every case (hidden x tokens x tp x link); returns a pandas DataFrame with provenance columns."""
    import pandas as pd

    from .kernels import environment, resolve_device
    from .report import ROW_PROVENANCE, stamp_provenance

    device = resolve_device(device)
    on_gpu = device.type == "cuda"
    shapes = shapes or (CPU_CASE if not on_gpu else QUICK if quick else dict(hidden=HIDDEN, tokens=TOKENS, tp=TP))
    links = links or LINKS_GBPS
    repeats = repeats or (10 if on_gpu else 2)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    cycles = _gpu_cycles_per_second(device) if on_gpu else 0.0
    if not on_gpu:
        progress("tridist bench overlap: no GPU; the CPU runs the ring's matmuls and copies one after the other, so "
                 "these rows only show that the benchmark runs (nothing is hidden on a CPU)")
    rows = []
    cases = [(h, t, p, name, gbps) for h in shapes["hidden"] for t in shapes["tokens"] for p in shapes["tp"]
             for name, gbps in links.items()]
    for i, (hidden, tokens, tp, name, gbps) in enumerate(cases, 1):
        row = measure_case(hidden, tokens, tp, gbps, device=device, dtype=dtype, repeats=repeats, cycles_per_s=cycles)
        row.update(link=name, link_gbps=gbps)
        rows.append(row)
        progress(f"[{i}/{len(cases)}] hidden {hidden} tokens {tokens} tp {tp} {name}: {row['hidden_fraction']:.0%} hidden, "
                 f"chunking +{row['chunking_overhead']:.1%}, interference +{row['interference']:.1%}")
    frame = stamp_provenance(pd.DataFrame(rows), environment(device, math.nan))
    return frame[[*COLUMNS, *(c for c in ROW_PROVENANCE if c not in COLUMNS)]]


def write_overlap_report(frame, out_dir: str | Path) -> Path:
    from matplotlib.figure import Figure

    from .report import markdown_table

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "results.csv", index=False)
    gpu = not str(frame["device"].iloc[0]).startswith("CPU")
    lines = [f"# Overlapped all-gather ring, emulated on one device: {frame['device'].iloc[0]}", "",
             f"torch {frame['torch'].iloc[0]}, {frame['date'].iloc[0]}. Each transfer is a chunk copy on a side stream "
             "plus a spin for the link's bandwidth; the matmuls are real (bench/overlap.py).", ""]
    if not gpu:
        lines += ["**CPU run: matmuls and copies run one after the other; these numbers only show that it runs.**", ""]
    table = [[r.hidden, r.tokens, r.tp, r.link, f"{r.full_ms:.3f}", f"{r.chunking_overhead:+.1%}", f"{r.comm_ms:.3f}",
              f"{r.exposed_ms:.3f}", f"{r.hidden_fraction:.0%}", f"{r.interference:+.1%}"] for r in frame.itertuples()]
    lines.append(markdown_table(["hidden", "tokens", "tp", "link", "matmul ms", "chunking", "comm ms", "exposed ms",
                                 "hidden", "interference"], table, align=["r", "r", "r", "l", "r", "r", "r", "r", "r", "r"]))
    target = frame[(frame["tp"] == 8) & (frame["link_gbps"] >= 400)]
    if gpu and not target.empty:
        lines += ["", f"Targets: at tp 8 over {target['link'].iloc[0]}, hidden {target['hidden_fraction'].min():.0%} (min) "
                      f"against >= 80%; chunking overhead {frame['chunking_overhead'].max():+.1%} (max) against <= 5%."]
    fig = Figure(figsize=(9, 4))
    ax = fig.subplots()
    for name, sub in frame.groupby("link", sort=False):
        labels = [f"{h}/{t}/tp{p}" for h, t, p in zip(sub["hidden"], sub["tokens"], sub["tp"])]
        ax.plot(labels, sub["hidden_fraction"], marker="o", label=name)
    ax.axhline(0.8, color="gray", linestyle="--", linewidth=0.8)
    ax.set_ylabel("communication hidden")
    ax.set_xlabel("hidden / tokens / tp")
    ax.tick_params(axis="x", labelrotation=60, labelsize=6)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=120)
    lines += ["", "![hidden fraction](plot.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    return out


def calibrate_overlap(device: torch.device, *, hidden: int, tokens: int, tp: int = 8) -> dict[str, float]:
    """The cost model's two overlap terms measured at one layer's entry (GPU only): the chunked matmuls'
    overhead and the matmuls' slowdown per second of transfer hidden beside them."""
    cycles = _gpu_cycles_per_second(device)
    row = measure_case(hidden, tokens, tp, LINKS_GBPS["nvlink-450"], device=device, cycles_per_s=cycles)
    # interference is per matmul second with copies beside; the cost model charges it per hidden
    # comm second: scale by matmul time over transfer time.
    per_comm_second = row["interference"] * row["chunked_ms"] / max(row["comm_ms"], 1e-9)
    return {"overlap_chunking_overhead": max(0.0, row["chunking_overhead"]),
            "overlap_interference": max(0.0, per_comm_second)}


def run(args) -> int:
    from .kernels import resolve_device

    try:
        device = resolve_device(args.device)
    except RuntimeError as exc:
        print(f"tridist bench overlap: error: {exc}", file=sys.stderr)
        return 2
    frame = run_overlap_benchmark(device=device, quick=args.quick, progress=lambda m: print(m, file=sys.stderr))
    import datetime

    out = args.out or f"reports/overlap-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    report = write_overlap_report(frame, out)
    print((report / "report.md").read_text())
    print(f"report: {report}")
    return 0
