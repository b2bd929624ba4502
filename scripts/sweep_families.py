"""Sweep `tridist.kernels.fuse` over the causal LMs transformers ships (every `AutoModelForCausalLM` model type,
or those named): each built from its own config class at tiny sizes, fused, then its loss and every gradient
compared with the unfused model in fp32 and with an fp64 copy. Run it after a transformers upgrade: a family
whose modules fuse wrongly shows a ratio of orders of magnitude, one that crashes shows its error.

    python3 scripts/sweep_families.py [MODEL_TYPE ...] [--out sweep.jsonl]

One JSON line per model type (also written to --out), progress on stderr, a summary at the end. Each model type
runs in its own process under a memory limit and a timeout: a family whose fixed sizes are too large for a tiny
build is reported ("build"), not fatal. Tiny sizes: hidden 64, 4 heads (2 key/value heads), head_dim 16, 4
layers (hybrid families' defaults put an attention layer among them), 4 experts (top-2); a config that rejects
them is tried without head_dim, with 8 layers, then with DeepSeek's latent-attention widths.

ratio: the fused model's largest gradient error from fp64 (each parameter's relative to its largest fp64 gradient,
the worst parameter's) over the unfused fp32 model's largest. Worst over worst: a parameter's own ratio would
divide by whatever rounding luck eager had on it (a scalar's gradient is one long sum). Near 1 (up to ~2) is the fused kernels' rounding (mixtures of experts run their
experts as a loop in fp64: torch's grouped GEMMs take no fp64). A model with no fp64 path is compared with fp32
instead, its error over 1e-7 (then up to ~50 is rounding). Gradients under
1e-6 of their largest are left out (a key bias's gradient is zero but for rounding). 2026-11-27 run: README.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import time

MEMORY_LIMIT = 8 << 30  # address space per model type: a tiny build needs well under 2 GiB
TIMEOUT_S = 240
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K = 128, 64, 4, 2, 16, 4, 2
_BASE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
             num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
             bos_token_id=0, eos_token_id=1, pad_token_id=2,
             # Gemma 3n's and Gemma 4's per-layer inputs: their own table is 262,144 x 256 per layer by default
             vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8)
# Settings a type needs at the sizes above:
# - hybrids whose config builds state-space layers alone by default, laid out as their released checkpoints are:
#   attention layers among the Mamba-2 ones (Bamba-9B's attn_layer_indices, Granite 4.0-H's layer_types), Zamba2's
#   shared hybrid blocks among its Mamba-2 layers, LFM2-MoE's attention among its convolutions (a dense first layer);
# - configs whose defaults do not fit 4 layers of width 64: Mamba-2's heads (hidden x expand = heads x head_dim),
#   GPT-Neo's global/local pattern, GPT-J's and CodeGen's rotary width (64 by default), Gemma 3n's key/value sharing
#   (its last 2 layers reuse the first 2 layers' keys and values, as the last 15 of 35 do in the released model);
# - dots.llm1's shared expert count (None by default: the model fails to build).
_TYPE_CONFIGS = {"bamba": dict(attn_layer_indices=[1, 3]),
                 "granitemoehybrid": dict(layer_types=["linear_attention", "attention"] * 2),
                 "zamba2": dict(layers_block_type=["linear_attention", "hybrid"] * 2, mamba_headdim=16, n_mamba_heads=8,
                                mamba_d_state=16, num_mem_blocks=1),
                 "lfm2_moe": dict(layer_types=["conv", "full_attention"] * 2, num_dense_layers=1),
                 # LFM2's and LFM3's gated short convolutions beside attention layers (their configs default to
                 # attention alone at a tiny depth)
                 "lfm2": dict(layer_types=["conv", "full_attention"] * 2),
                 "lfm3": dict(layer_types=["conv", "full_attention"] * 2),
                 # Jamba's Mamba-1 layers beside attention layers (one in 8 by default: none at 4 layers)
                 "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
                 "mamba2": dict(num_heads=8, head_dim=16, n_groups=2, state_size=16, chunk_size=8),
                 "gpt_neo": dict(attention_types=[[["global", "local"], 2]]),
                 "gptj": dict(rotary_dim=8), "codegen": dict(rotary_dim=8),
                 "gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2),
                 "dots1": dict(n_shared_experts=1)}
# Every name a config uses for the expert count and top-k (unknown names are plain attributes to a config).
_MOE = dict(num_experts=EXPERTS, num_local_experts=EXPERTS, n_routed_experts=EXPERTS, moe_num_experts=EXPERTS,
            num_experts_per_tok=TOP_K, moe_k=TOP_K, top_k=TOP_K, moe_topk=TOP_K, n_group=1, topk_group=1,
            moe_intermediate_size=32, first_k_dense_replace=1)
# DeepSeek's latent attention: its config's head_dim is the rotary part (DeepSeek-V3) or a query head (others).
_LATENT = dict(num_key_value_heads=HEADS, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16)
TRIES = [dict(head_dim=HEAD_DIM, **_MOE), dict(_MOE), dict(head_dim=HEAD_DIM, **_MOE, num_hidden_layers=8),
         dict(**_LATENT, qk_nope_head_dim=12, head_dim=8, **_MOE), dict(**_LATENT, qk_nope_head_dim=8, head_dim=16, **_MOE)]


def _settings(model_type: str, extra: dict) -> dict:
    """The config settings of one try: _BASE's, the type's and the try's, but `num_key_value_heads` where the type's
    config class neither takes it as an argument nor maps it (`attribute_map`): such a config keeps any keyword as an
    attribute (GPT2Config does), where a reader of key/value heads finds it (GPT-2 under tp 4 then ran in global view,
    its 4 heads read as grouped over 2 key/value heads its code does not have)."""
    import inspect

    import transformers

    settings = {**_BASE, **_TYPE_CONFIGS.get(model_type, {}), **extra}
    cls = transformers.AutoConfig.for_model(model_type).__class__
    if "num_key_value_heads" not in {*inspect.signature(cls.__init__).parameters, *getattr(cls, "attribute_map", {})}:
        settings.pop("num_key_value_heads", None)
    return settings


def build_tiny(model_type: str, *, deterministic: bool = False, attention: str | None = None,
               dropout: float | None = None):
    """(model, config extras) of the first try whose model runs a labelled forward on a left-padded batch, else
    raises the last error. (GLM-4.7-Flash's latent attention with fewer key/value heads than heads, an unnatural
    config, runs unpadded but fails padded in transformers itself: its next try, heads alike, builds.)
    `deterministic`: every dropout probability and router jitter of the config set to 0, so that training draws
    nothing at random (runs laid out differently, as distributed ones, draw differently). `dropout`: every dropout
    probability set to it instead (router jitter to 0). `attention`: transformers' attention implementation ("eager",
    "sdpa"; None: the model's default)."""
    import torch
    import transformers

    error = None
    for extra in TRIES:
        try:
            torch.manual_seed(0)
            config = transformers.AutoConfig.for_model(model_type, **_settings(model_type, extra))
            if deterministic or dropout is not None:
                for key, value in config.to_dict().items():
                    if any(word in key for word in ("dropout", "pdrop", "jitter")) and isinstance(value, float):
                        setattr(config, key, dropout if dropout is not None and "jitter" not in key else 0.0)
            chosen = {} if attention is None else {"attn_implementation": attention}
            model = transformers.AutoModelForCausalLM.from_config(config, **chosen).float()
            ids = torch.randint(3, VOCAB, (2, 8))
            mask = torch.ones_like(ids)
            mask[1, :3] = 0
            model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
            torch.manual_seed(0)  # a fresh build: a forward may leave state behind (RecurrentGemma's, not copyable)
            return transformers.AutoModelForCausalLM.from_config(config, **chosen).float(), extra
        except Exception as exc:  # noqa: BLE001 - the next try, or the report
            error = exc
    raise error


def _gradients(model, ids, labels) -> tuple[float, dict]:
    import torch

    torch.manual_seed(1)  # routers' jitter and dropout draw alike in every copy
    out = model(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


def check(model_type: str) -> dict:
    """One model type's row (see the module docstring)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    from tridist import kernels

    try:
        model, extra = build_tiny(model_type)
    except Exception as exc:  # noqa: BLE001
        return {"type": model_type, "stage": "build", "error": f"{type(exc).__name__}: {exc}"[:300]}
    row = {"type": model_type, "config": sorted(set(extra) - set(_MOE)) or ["default"]}
    try:
        fused = copy.deepcopy(model)
        report = kernels.fuse(fused)
        row["fused"] = sorted({what.split(":")[0].split(" ")[0] for _, what in report.replaced})
        row["skipped"] = [f"{name}: {why}"[:160] for name, why in report.skipped]
        generator = torch.Generator().manual_seed(0)
        ids, labels = (torch.randint(3, VOCAB, (2, 8), generator=generator) for _ in range(2))
        reference, floor = copy.deepcopy(model).double(), 0.0
        if hasattr(reference, "set_experts_implementation"):  # torch's grouped GEMMs take no fp64: the loop does
            reference.set_experts_implementation("eager")
        try:
            _, want = _gradients(reference, ids, labels)
        except Exception:  # noqa: BLE001 - no fp64 path: fp32 is the reference
            reference, floor = None, 1e-7
        _, eager = _gradients(model, ids, labels)
        if reference is None:
            want = eager
        _, got = _gradients(fused, ids, labels)
    except Exception as exc:  # noqa: BLE001
        return {**row, "stage": "fused run", "error": f"{type(exc).__name__}: {exc}"[:300]}
    if got.keys() != eager.keys():
        return {**row, "stage": "gradients", "error": f"gradients of {sorted(got.keys() ^ eager.keys())[:3]} differ in presence"}
    fused_errors, eager_errors = {}, {}
    for name, w in want.items():
        scale = w.abs().max().item()
        if scale >= 1e-6:
            fused_errors[name] = (got[name] - w).abs().max().item() / scale
            eager_errors[name] = (eager[name] - w).abs().max().item() / scale
    worst = max(fused_errors, key=fused_errors.get)
    ratio = fused_errors[worst] / max(max(eager_errors.values()), floor, 1e-12)
    return {**row, "reference": "fp64" if reference is not None else "fp32", "worst": worst,
            "max_error": f"{fused_errors[worst]:.1e}", "ratio": round(ratio, 2)}


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", help="model types (default: every AutoModelForCausalLM one)")
    parser.add_argument("--out", help="also write the JSON lines here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one model type
    args = parser.parse_args()
    if args.one:
        print(json.dumps(check(args.one)), flush=True)
        return
    types = args.types
    if not types:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        types = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    out = open(args.out, "w") if args.out else None
    rows, start = [], time.monotonic()
    for i, model_type in enumerate(types, 1):
        try:
            done = subprocess.run([sys.executable, __file__, "--one", model_type], capture_output=True, text=True,
                                  timeout=TIMEOUT_S, preexec_fn=_limited)
            lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
            row = json.loads(lines[-1]) if lines else {
                "type": model_type, "stage": "process", "error": f"exit {done.returncode}: {done.stderr[-200:]}"}
        except subprocess.TimeoutExpired:
            row = {"type": model_type, "stage": "process", "error": f"over {TIMEOUT_S} s"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out:
            print(json.dumps(row), file=out, flush=True)
        verdict = f"ratio {row['ratio']}" if "ratio" in row else f"{row['stage']}: {row['error'][:60]}"
        print(f"[{i}/{len(types)}, {time.monotonic() - start:.0f} s] {model_type}: {verdict}", file=sys.stderr, flush=True)
    compared = [r for r in rows if "ratio" in r]
    print(f"{len(rows)} model types: {len(compared)} compared (largest ratio "
          f"{max((r['ratio'] for r in compared), default=0)}), {len(rows) - len(compared)} not built or failed",
          file=sys.stderr)


if __name__ == "__main__":
    main()
