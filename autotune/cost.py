"""Analytical cost model of one training step: time (with its breakdown) and memory per device.

Standard formulas (ARCHITECTURE.md section 3), generalised where Llama departs from Megatron's GPT:

* FLOPs: Megatron's 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)) counts 2 FLOPs per parameter per token in
  the forward pass (24h² per layer: 4h² attention + 8h² GELU MLP), 4·s·h for the attention core and
  2·V·h for the logits, times 3 for forward + backward. `model_flops_per_step` computes the same sum
  from the real matrices instead: q/o of heads·head_dim and k/v of kv_heads·head_dim (GQA), three
  MLP matrices for SwiGLU (two for GELU). For Megatron's GPT shapes it *equals* the 72 formula.
  Hardware FLOPs add recomputation: a full layer forward with full recompute (Narayanan et al.'s
  96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)): the logits are not recomputed, so it is a bit less than
  4/3 of the 72 formula), the attention core with selective recompute, and flash attention's own
  recomputation of Q·Kᵀ in its backward pass (half the attention core's forward FLOPs).
* Activations per layer per micro-batch (Korthikanti et al. 2022): s·b·h·(34 + 5·a·s/h) bytes for
  GPT with dropout, rebuilt term by term so that GQA (smaller K/V), SwiGLU (three ffn-wide tensors
  instead of two) and no dropout are priced; 5·a·s²·b (the stored attention matrix) disappears with
  flash attention. Tensor parallel splits the terms inside the parallel regions (24 of the 34);
  sequence parallel splits the rest (norm inputs, dropout masks) as well; full recompute keeps
  only each layer's input (2·s·b·h, /t with sequence parallel) plus one layer's working set.
* Collectives: ring alpha-beta (all-reduce 2(n−1)/n·bytes/bw + 2(n−1)·α; all-gather and
  reduce-scatter half that). Tensor parallel: 4 all-reduces of b·s·h per layer per micro-batch (6
  with full recompute); the same volume as all-gather + reduce-scatter under sequence parallel.
  Some models add their own per layer: a packed q/k/v of unequal parts (reduce-scatter of its output,
  all-gather of its gradient) and q/k norms (per-head: their weights' gradients all-reduced; over the
  whole projection: the statistic and its gradient all-reduced, the weights' gradients all-gathered).
  A group that spans nodes is priced at the inter-node bandwidth. Data-parallel gradient traffic
  overlaps the backward pass (the last layer's share cannot); ZeRO-2 reduce-scatters and ZeRO-3
  gathers every micro-batch (gradients cannot be accumulated unsharded), which is what keeps them
  from being free.
* Pipeline (1F1B): bubble (p−1)/(m+p−1) of the step where the stages are equal; with stages of unequal time,
  the other stages' time once beside m times the slowest's (a flow shop, `_bubble`); (p−1)/(v·m) of the ideal
  time with v interleaved chunks; the first stage holds p micro-batches of activations (×(1 + (p−1)/(p·v))
  interleaved); the slowest stage (the last, which also runs the LM head) sets the pace. Where p·v
  does not divide the layers the stages are uneven (strategy.stage_layers) and each rank is priced by
  the layers it holds, interleaved or not.
* Modules a recognised structure does not plan (ModelSpec.unplanned_parameters: LongCat-Flash's second attention
  and MLP) are whole on every tensor-parallel rank: their weights counted there in full and
  their compute priced as a matmul of all their weights over every token, not divided by tp (their activations not
  counted).
* Model states: 16 bytes per parameter for mixed-precision Adam (2 weights + 2 grads + 12 fp32
  master/momentum/variance), ZeRO-1/2/3 dividing the 12, then the grads, then the weights by dp.
* Frozen weights (ModelSpec.trainable_fraction < 1: peft's LoRA adapters on frozen projections, a frozen vision
  tower): gradients, optimizer states, their data-parallel traffic and the optimizer step for the trained share
  alone, spread evenly; the backward's GEMMs take the input's gradient and the trained share of the weights' (2 + f
  passes of the matmuls where 3; the adapters' own small GEMMs are not priced); weights, ZeRO-3's gathers and the
  activations as for full training. Llama 3 70B with LoRA (f = 0.8%) fits on 8 H100s (dp1 tp4 pp2x4 + sp, 69 of
  72 GB); its full training fits on neither 8 nor 16.

Mixtures of experts (ModelSpec.num_experts > 0; its moe_layers priced apart from the dense layers, each
pipeline rank by the layers it holds):

* compute on the active parameters: the router ([tokens, hidden] x [hidden, experts]), the shared experts
  on every token, and the routed experts as E/ep local GEMM groups of tokens·k·imbalance/(E/ep) rows each
  (one grouped GEMM per projection: small groups are priced memory-bound by the roofline, which is what
  makes many small experts slower than their FLOPs say); their ffn split over tp as the dense MLP's.
* activations: the experts' gate, up and product for the k·imbalance routed copies of each token and the
  shared experts' for every token (inside the tensor-parallel region), the dispatched copies of the token
  and the fp32 router probabilities (outside it).
* all-to-all over the ep ranks (a pairwise exchange: (ep−1)/ep of the bytes leave the rank, the peers on
  the node over NVLink and the others over the NIC at once): dispatch and combine of tokens·k·imbalance
  hidden vectors, forward and backward (4 per MoE layer and micro-batch, 6 with full recompute), exposed.
* `ModelSpec.expert_load_imbalance`: the busiest ep rank's routed tokens over the mean (1.0: balanced);
  it scales the experts' compute, activations and all-to-all under expert parallel (ep > 1; with ep = 1
  every rank runs all the experts on its own tokens, k per token, whatever the routing).
* weights and gradient reductions: each rank holds E/ep experts; the experts' gradients are reduced (and
  ZeRO-sharded) over the dp/ep ranks that hold the same experts, the other parameters over dp.
* expert tensor parallel (`EngineProfile.expert_tensor_parallel`, "etp" below): Megatron splits the routed
  and shared experts' ffn over tp like the dense MLP; the torch engines (distcore) keep the MoE blocks whole
  on every tp rank (etp = 1: their weights are not divided by tp). Without sequence parallel each tp rank runs
  the same tokens through them (GEMMs and activations not divided by tp); with it, its own slice of the
  sequence (GEMMs, all-to-all and activations on tokens / tp), and the blocks' gradients are then summed over
  the tp ranks once per step (an all-reduce of their parameters, exposed), expert-parallel experts' in each
  backward (one all-reduce per layer and micro-batch).

Gated DeltaNet linear attention (ModelSpec.gated_delta_net: Qwen3-Next, Qwen3.5; its layers priced apart from the
attention layers, with a dense or MoE MLP as any layer):

* its projections (to q, k, v, the output gate z, β and the decay; back from the value heads) split over tp as
  attention's; its convolution, per-head biases and decays and gated norm whole on every rank (as distcore holds
  them), their gradients all-reduced over the tp ranks (a small, latency-bound message per layer);
* its core as flash-linear-attention's chunk_gated_delta_rule runs it, over chunks of 64 tokens: linear in the
  sequence, at the attention kernel's rate, its backward recomputing the chunks' states first;
* its activations: the tensors its mixer keeps for the backward (`_linear_mixer_bytes`), inside the tp region; no
  attention core, so selective recompute (which distcore does not apply to these layers) frees nothing in them.
Mamba-1 layers (Jamba's: a `SelectiveScan` in ModelSpec.gated_delta_net) likewise: three split projections (the
selective one row-parallel, its [dt | B | C] all-reduced both ways), dt_proj whole on every rank as the convolution
is, the scan's 9 FLOPs per channel and state recomputed in the backward, the tensors mamba-ssm's kernels keep. LFM2's
gated short convolutions (a `ShortConvolution`) are priced in the same places: their projections ([B | C | x] and
back) split over tp, the convolution's weight whole on every rank, their core the convolution's taps and two gates per
channel (`ShortConvolution.core_flops`), their activations six per channel (`ShortConvolution.kept_elements`).
MiniMax's lightning attention (a `LightningAttention`) too: [q k v] per head and the output gate split over tp, the
projection back row-parallel, its norm's weight whole on every rank and its statistics (a value per token) all-reduced
both ways, its blocked core (`LightningAttention.core_flops`), its activations as transformers' torch path keeps them.

Time of the non-matmul work (norms, activations, softmax, residual adds) is priced as memory
traffic proportional to the stored activations; GEMMs use a roofline (the slower of FLOPs at the
achievable matmul rate and bytes at the memory bandwidth), so tiny shapes are memory-bound.

The hardware (the cluster's `DeviceProfile`) and the software that runs the step (its `EngineProfile`,
engine.py) are separate: the engine sets the attention kernel's rate, the elementwise traffic, a
layer's dispatch floor and FSDP2's buffer copies. A device's measured `step_time_scale` (fitted by a
`measure=True` search) multiplies every term.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from .hardware import Cluster
from .model import ChannelMixer, LightningAttention, ModelSpec, SelectiveScan, block_parts
from .strategy import Strategy, balanced_stage_layers, check, kv_head_replicas, rank_layer_indices, stage_layers

__all__ = [
    "Estimate",
    "TimeBreakdown",
    "MemoryBreakdown",
    "estimate",
    "model_flops_per_step",
    "hardware_flops_per_step",
    "megatron_flops_per_step",
    "all_reduce_time",
    "all_gather_time",
    "reduce_scatter_time",
    "p2p_time",
    "all_to_all_time",
    "pipeline_bubble_fraction",
    "activation_bytes_per_layer",
    "model_state_bytes",
    "stage_parameters",
    "layer_forward_flops",
    "balanced_layout",
    "COST_MODEL_VERSION",
]

# Bump when a formula changes: stored search results (Optuna studies) are keyed by it.
COST_MODEL_VERSION = 28  # 28: MiniMax's lightning attention layers (LightningAttention) split over tp by head; 27: a learned position embedding (ModelSpec.position_parameters) on the first stage, whole on every tp rank; 26: Mamba-1's kept dt, B and C whole on every tp rank (ChannelMixer.kept_whole_elements); 25: Mamba-1's dt_proj whole on every tp rank (other_parameters), its work in the core; 24: Mamba-1 layers (SelectiveScan: Jamba's) split over tp by channel; 23: LFM2's gated short convolutions (ShortConvolution) priced as they run, split over tp by channel; 22: a multimodal model's media encoders (ModelSpec.media_parameters) on the first stage, whole on every tp rank; 21: the 1F1B bubble is the other stages' time (a flow shop), not (p - 1) x the slowest's; 20: a linear mixer beside the attention (Falcon-H1's), both split and priced in every layer, Mamba-2's B and C columns whole on each rank where tp exceeds the groups; 19: stages as a Strategy lists them (layers_per_stage; the search offers balanced_layout); 18: blocks of one part (Nemotron-H's), each priced by its part, experts on a latent, MoE blocks whole on every tp rank without activation collectives; 17: a linear mixer's unequally packed projections' collectives (Qwen3.5's, Mamba-2's), Mamba-2's replicated B and C; 16: a packed [q | k | v] whose key/value heads tp exceeds, whole on every rank; 15: a packed qkv interleaved per key/value head (GPT-NeoX's, Falcon's) split without a reduce-scatter; 14: Gated DeltaNet layers priced as they run, gated attention's output gate; 13: an fp16 head's fused loss's fourth GEMM; 12: a task head (a classifier's) priced at its own width, not the vocabulary's; 11: MoE blocks on sequence slices under sequence parallel; 10: latent attention's latents whole under sequence parallel; 9: multi-head latent attention priced as it runs; 8: the fused loss under tp (vocabulary-parallel); 7: mixtures of experts and expert parallel; 3: uneven pipeline stages (strategy.stage_layers); 4: engine profiles (engine.py),
# the tied embedding's gradient all-reduce across stages, unequal packed q/k/v collectives; 5: the torch
# engines overlap tensor parallel's collectives (distcore's overlap_comm), fp32 reduce-scatter wire bytes;
# 6: q/k norms' tensor-parallel collectives and weights (ModelSpec.qk_norm)

FWD_BWD_PASSES = 3  # backward = 2x forward: gradients w.r.t. inputs and w.r.t. weights
BWD_TO_FWD = 2.0
# Flash attention's backward recomputes S = Q·Kᵀ (1 of the forward's 2 attention-core matmuls):
# 5 matmuls in backward vs 2 forward (Dao 2023, FlashAttention-2, section 3.1.2).
FLASH_BWD_RECOMPUTE = 0.5
# Communication overlapped with compute is not free: NCCL kernels hold 8-32 SMs and share HBM
# bandwidth, slowing the GEMMs they hide behind. Each second of hidden traffic costs this much compute.
OVERLAP_COMPUTE_COST = 0.15
# Adam step traffic per parameter, mixed precision: read fp32 master, m, v and the bf16 gradient
# (14 bytes), write master, m, v and the bf16 weight (14 bytes).
ADAM_BYTES_PER_PARAM = 28
# Memory the allocator can actually hand out: the CUDA context (~0.5-1 GB) and fragmentation take
# the rest (PyTorch's caching allocator typically loses 5-10% to fragmentation at peak).
USABLE_MEMORY_FRACTION = 0.9
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP bucket_cap_mb=25
DDP_BUCKETS_IN_FLIGHT = 2  # one being filled, one being reduced
ZERO3_PREFETCH_LAYERS = 2  # FSDP keeps the current and the prefetched layer's parameters gathered
LOSS_FP32_BYTES = 4  # the logits are upcast to fp32 for the cross entropy
# tridist's linear_cross_entropy (kernels/ops/linear_cross_entropy.py, chunk_tokens) runs the loss over chunks
# of about tokens·h/V tokens, raised to min(4096, h), clamped to [128, 4096] and evened out, or, for a
# half-precision head, in one chunk up to 2·h tokens (no fp32 accumulator of the weight's gradient then);
# tests/test_cost_terms.py checks that the rules agree.
FUSED_LOSS_MIN_CHUNK, FUSED_LOSS_SPEED_CHUNK, FUSED_LOSS_MAX_CHUNK = 128, 4096, 4096
FUSED_LOSS_ONE_CHUNK_HIDDEN_MULTIPLE = 2
DROPOUT_MASK_BYTES = 1  # Korthikanti et al.: masks stored as bytes
# Gated DeltaNet's core as flash-linear-attention's chunk_gated_delta_rule runs it (its fixed chunk of 64 tokens).
LINEAR_ATTENTION_CHUNK = 64
LINEAR_STATISTIC_BYTES = 4  # its per-head statistics and its gated norm's upcast features are fp32
# transformers' gated RMSNorm (eager: tridist's fuse leaves it) keeps per value feature 3 fp32 tensors (its upcast
# input, the gate's SiLU, their product) and 2 in the compute dtype, measured with saved-tensor hooks
# (_linear_mixer_bytes).
GATED_NORM_FP32_PER_FEATURE, GATED_NORM_TENSORS_PER_FEATURE = 3, 2
NORM_STATISTIC_BYTES = 4  # a split RMSNorm's sum of squares (and its gradient) is all-reduced in fp32
ROUTER_PROB_BYTES = 4  # the router's softmax / sigmoid scores are kept in fp32 (Hugging Face, Megatron-Core)
FLASH_LSE_BYTES = 4  # flash attention stores an fp32 log-sum-exp per head and token
SOFTMAX_FP32_BYTES = 4  # an attention softmax computed in fp32 (transformers' eager attention) keeps its fp32 output
# Optimizer bytes per parameter: fp32 master weights + Adam m and v (12) when training in 16 bits;
# pure fp32 training needs no master copy (8). Weights and gradients take the dtype's bytes.
OPTIMIZER_BYTES = {2: 12, 4: 8}


# -------------------------------------------------------------------------------------------- FLOPs


@functools.lru_cache(maxsize=1024)
def _forward_flops_per_token(spec: ModelSpec) -> tuple[float, float, float, float]:
    """(layer matmuls, attention core, linear-attention core, logits) forward FLOPs per token, summed over layers
    (`layer_forward_flops`)."""
    counts = _layer_kinds(spec, range(spec.num_layers))
    matmul, core, linear_core = (sum(n * _layer_forward_flops(spec, kind)[part] for n, kind in zip(counts, LAYER_KINDS)
                                     if n) for part in range(3))
    logits = 2.0 * spec.head_width * spec.hidden_size
    return matmul, core, linear_core, logits


@functools.lru_cache(maxsize=4096)
def _layer_forward_flops(spec: ModelSpec, kind: tuple[bool, bool, str]) -> tuple[float, float, float]:
    """(matmuls, attention core, linear-attention core) forward FLOPs per token of one layer of `kind`
    (LAYER_KINDS): an MoE layer's matmuls are its attention's, the router's, the shared experts' and the k routed
    experts' a token runs; a Gated DeltaNet layer's mixer's projections take attention's place, its core
    attention's; a block of one part (Nemotron-H's) has no attention, or no MLP. Modules no plan names
    (unplanned_parameters) run in every layer."""
    moe, linear, part = kind
    attends = part != "mlp" and _attends(spec, linear)
    mixer = (spec.gated_delta_net.matmul_parameters(spec.hidden_size) if linear else 0) + \
        (spec.attention_parameters if attends else 0)
    mlp = spec.moe_active_mlp_parameters if moe else spec.mlp_parameters
    matmul = 2.0 * ((mixer if part != "mlp" else 0) + (mlp if part != "mixer" else 0) + spec.unplanned_parameters)
    # Q·Kᵀ and P·V (q_size: 4·s·q_size unless latent attention's value heads differ), no causal halving (Megatron)
    core = 2.0 * spec.seq_len * (spec.q_size + spec.attention_output_size) if attends else 0.0
    linear_core = _linear_core_flops(spec)[0] if linear else 0.0
    return matmul, core, linear_core


def _attends(spec: ModelSpec, linear: bool) -> bool:
    """Whether a layer whose token mixer is (`linear`) or is not linear attention holds an attention: every layer but
    those whose linear mixer takes the attention's place (Falcon-H1's runs beside it: gated_delta_net.beside_attention)."""
    return not linear or spec.gated_delta_net.beside_attention


def layer_forward_flops(spec: ModelSpec) -> tuple[float, ...]:
    """Each decoder layer's forward FLOPs per token, in layer order (its kind's, `_layer_forward_flops`)."""
    return tuple(sum(_layer_forward_flops(spec, kind)) for kind in _kind_of_each_layer(spec))


@functools.lru_cache(maxsize=1024)
def balanced_layout(spec: ModelSpec, num_stages: int) -> tuple[int, ...] | None:
    """The decoder layers per pipeline stage that balance the stages' FLOPs (strategy.balanced_stage_layers: each
    layer's forward FLOPs, the LM head's on the last stage), or None where `stage_layers`' even layout is as
    balanced. The LM head outweighs a layer where the vocabulary is large against the layer's width (Gemma 2 2B:
    ~7 layers; Llama 3 8B: ~2), and layers differ in mixtures of experts with dense layers and in hybrids
    (Nemotron-H's Mamba-2, attention and MLP blocks); the pipeline runs at its slowest stage's pace. Compute
    alone: the first stage's larger share of activations (1F1B) is the memory check's to weigh, as the search
    prices both layouts."""
    layout = balanced_stage_layers(layer_forward_flops(spec), num_stages, last=_forward_flops_per_token(spec)[3])
    return None if layout == stage_layers(spec.num_layers, num_stages) else layout


def _linear_chunk(spec: ModelSpec) -> int:
    """The tokens of a Gated DeltaNet chunk: chunk_gated_delta_rule's, or the whole sequence where shorter."""
    return min(LINEAR_ATTENTION_CHUNK, spec.seq_len)


def _linear_core_flops(spec: ModelSpec) -> tuple[float, float]:
    """A Gated DeltaNet layer's core per token, as flash-linear-attention's chunk_gated_delta_rule runs it over
    chunks of C tokens (`_linear_chunk`), for each value head (a key head serves a group of them): (its forward FLOPs, those its backward
    recomputes first). Multiply-adds of the forward: the chunk's K·Kᵀ (C·dk), the WY representation's w and u
    (C·dk + C·dv), the pass over the chunks' states S (v_new = u − w·S and the update Kᵀ·v_new: 2·dk·dv) and the
    output (q·S: dk·dv; the chunk's masked q·Kᵀ and its product with v_new: C·dk + C·dv). The backward first
    recomputes w, u and the states (C·dk + C·dv + 2·dk·dv; it saves none of them), then does twice the forward's
    work, as any layer's. Linear in the sequence: no s x s term."""
    linear = spec.gated_delta_net
    if isinstance(linear, ChannelMixer):  # its own core (no chunked delta rule)
        return linear.core_flops()
    c, dk, dv = _linear_chunk(spec), linear.head_k_dim, linear.head_v_dim
    heads = 2.0 * linear.num_v_heads  # 2 FLOPs per multiply-add
    return heads * (3 * c * dk + 2 * c * dv + 3 * dk * dv), heads * (c * dk + c * dv + 2 * dk * dv)


def model_flops_per_step(spec: ModelSpec, global_batch_size: int) -> float:
    """FLOPs of forward + backward without any recomputation (the 'model FLOPs' of MFU). Frozen weights
    (ModelSpec.trainable_fraction < 1: LoRA) take no weight-gradient GEMM: the layers' and the head's matmuls count
    2 + the trained share passes where 3."""
    matmul, core, linear_core, logits = _forward_flops_per_token(spec)
    return global_batch_size * spec.seq_len * ((1 + _gemm_backward(spec)) * (matmul + logits)
                                               + FWD_BWD_PASSES * (core + linear_core))


def hardware_flops_per_step(spec: ModelSpec, global_batch_size: int, recompute: str = "none") -> float:
    """FLOPs actually executed: model FLOPs + recomputation (full layer, attention core, flash's Q·Kᵀ, the
    linear-attention kernels' states). Selective recompute re-runs the attention layers' core only (distcore leaves
    Gated DeltaNet layers as they are: apply_recompute)."""
    matmul, core, linear_core, _ = _forward_flops_per_token(spec)
    tokens = global_batch_size * spec.seq_len
    extra = 0.0
    if recompute == "full":
        extra += matmul + core + linear_core
    elif recompute == "selective":
        extra += core
    if spec.flash_attention:
        extra += FLASH_BWD_RECOMPUTE * core
    if spec.gated_delta_net:
        extra += spec.num_linear_layers * _linear_core_flops(spec)[1]
    return model_flops_per_step(spec, global_batch_size) + tokens * extra


def megatron_flops_per_step(batch: int, seq_len: int, layers: int, hidden: int, vocab: int,
                            full_recompute: bool = False) -> float:
    """Narayanan et al. 2021: 72·B·s·l·h²·(1 + s/6h + V/12lh), or 96·...·(1 + s/6h + V/16lh) with
    full recomputation (kept verbatim as the reference the general formula is tested against)."""
    if full_recompute:
        return 96.0 * batch * seq_len * layers * hidden**2 * (1 + seq_len / (6 * hidden) + vocab / (16 * layers * hidden))
    return 72.0 * batch * seq_len * layers * hidden**2 * (1 + seq_len / (6 * hidden) + vocab / (12 * layers * hidden))


# ------------------------------------------------------------------------------------- collectives


def all_reduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of `nbytes` over `n` ranks: 2(n−1)/n·bytes/bw + 2(n−1)·α."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def all_gather_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather producing `nbytes` in total: (n−1)/n·bytes/bw + (n−1)·α."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


def reduce_scatter_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring reduce-scatter of `nbytes` in total (each rank keeps 1/n): same cost as all-gather."""
    return all_gather_time(nbytes, n, bandwidth, latency)


def all_to_all_time(nbytes: float, n: int, bandwidth: float, latency: float, *, local_ranks: int | None = None,
                    inter_bandwidth: float | None = None, inter_latency: float | None = None) -> float:
    """Pairwise all-to-all in which each rank sends `nbytes` in all, 1/n to every rank (itself included):
    (n−1)/n·bytes/bw + (n−1)·α inside a node. When only `local_ranks` of the n share a node, the other
    n − local_ranks are reached over the inter-node link at the same time: the slower of the two parts."""
    if n <= 1:
        return 0.0
    local = n if local_ranks is None else max(1, min(local_ranks, n))
    intra = (local - 1) / n * nbytes / bandwidth + (local - 1) * latency
    if local == n:
        return intra
    inter = (n - local) / n * nbytes / inter_bandwidth + (n - local) * inter_latency
    return max(intra, inter)


def p2p_time(nbytes: float, bandwidth: float, latency: float) -> float:
    """One point-to-point send: α + bytes/bw."""
    return latency + nbytes / bandwidth


def pipeline_bubble_fraction(pp: int, num_micro_batches: int, virtual_pp: int = 1) -> float:
    """Share of a 1F1B step spent idle: (p−1)/(v·m + p−1), i.e. (p−1)/(m+p−1) without interleaving and
    a bubble of (p−1)/(v·m) times the ideal (bubble-free) time."""
    return (pp - 1) / (virtual_pp * num_micro_batches + pp - 1)


# -------------------------------------------------------------------------------------------- memory


def _activation_terms(spec: ModelSpec, micro_batch_size: int, dtype_bytes: int, moe: bool = False,
                      imbalance: float = 1.0, experts_split: bool = True, linear: bool = False,
                      kv_replicas: int = 1, part: str = "both") -> tuple[float, float, float, float]:
    """Stored bytes per layer per micro-batch, split into (outside the tensor-parallel regions,
    inside them, the attention core, whole on every tensor-parallel rank even under sequence parallel). For
    Megatron's GPT with 2-byte activations: 10·sbh, 24·sbh, 5·a·s²·b (Korthikanti et al. 2022, eq. 1) and 0.
    The last holds latent attention's latents: distcore runs its down-projections unsplit on the whole
    sequence (after sequence parallel's all-gather), so no split divides them. `moe`: an MoE layer, its busiest rank receiving
    `imbalance` times the mean of the routed tokens; `experts_split` False: its experts run whole on every tp
    rank (etp = 1), their activations outside the split regions (sequence parallel splits them with the rest: the
    blocks then run on each rank's slice of the sequence). `linear`: a Gated DeltaNet layer (`_linear_mixer_bytes`
    in attention's place: inside the split region, no core term; beside the attention, Falcon-H1's, added to the
    attention's terms). `kv_replicas`: the tp ranks that compute each
    key/value head (tp above the key/value heads): their keys and values that many times in the split region. `part`:
    a block of one part ("mixer", "mlp": Nemotron-H's) keeps that part's."""
    sb = spec.seq_len * micro_batch_size
    e = dtype_bytes
    h, q = spec.hidden_size, spec.q_size
    mask = DROPOUT_MASK_BYTES if spec.dropout else 0
    # Each part: its norm's input, its first projection's input (qkv's, the MLP's) and the dropout mask after it.
    half = sb * (e * h + e * h + mask * h)
    if part == "mlp":
        outside, mlp = _mlp_activation_terms(spec, sb, e, moe, imbalance, experts_split, half)
        return outside, sb * mlp, 0.0, 0.0
    outside, mlp = _mlp_activation_terms(spec, sb, e, moe, imbalance, experts_split, 2 * half)
    if part == "mixer":
        outside, mlp = half, 0.0
    linear_bytes = _linear_mixer_bytes(spec, e) if linear else 0.0
    # what a channel mixer keeps whole on every tp rank (Mamba-1's dt, B and C)
    linear_whole = sb * e * spec.gated_delta_net.kept_whole_elements() if linear and isinstance(
        spec.gated_delta_net, ChannelMixer) else 0.0
    if not _attends(spec, linear):
        return outside, sb * (linear_bytes + mlp), 0.0, linear_whole
    if linear:  # beside the attention: its own copy of the normed input (a region of its own gathers it under sp)
        outside += sb * e * h
    # Q, K, V for the attention core, the output projection's input.
    # An output gate from the query projection: that output twice as wide (the query's norm keeps a view of it) and
    # the gate's sigmoid.
    gate = 2 * e * q if spec.attention_output_gate else 0
    keys_values = kv_replicas * e * (spec.key_size + spec.value_size)
    inside = sb * (e * q + keys_values + e * spec.attention_output_size + gate + mlp + linear_bytes)
    latent = spec.latent_attention
    # The latents and their norms' inputs, whole on every tensor-parallel rank.
    whole = sb * 2 * e * (latent.q_lora_rank + latent.kv_lora_rank + latent.rope_head_dim) if latent else 0.0
    whole += linear_whole
    if spec.flash_attention:
        core = FLASH_LSE_BYTES * spec.num_heads * sb
    else:  # the softmax's output; the probabilities the next matmul reads where they are another tensor (a dropout's
        # output, or transformers' eager cast of an fp32 softmax back to the compute dtype); the dropout mask
        softmax = SOFTMAX_FP32_BYTES if spec.softmax_fp32 else e
        probabilities = e if spec.dropout or softmax != e else 0
        core = spec.num_heads * spec.seq_len * sb * (softmax + probabilities + mask)
    return outside, inside, core, whole


def _mlp_activation_terms(spec: ModelSpec, sb: int, e: int, moe: bool, imbalance: float, experts_split: bool,
                          outside: float) -> tuple[float, float]:
    """(`outside` with the MLP's terms outside the tensor-parallel regions for `sb` tokens, the MLP's bytes per token
    inside them): GELU's input and output (2 x ffn) or SwiGLU's gate, up and product (3 x ffn)."""
    mlp_tensors = 3 if spec.gated_mlp else 2
    mlp = mlp_tensors * e * spec.ffn_hidden_size
    if moe:  # k·imbalance routed copies of each token through an expert, every token through the shared ones
        routed = spec.experts_per_token * imbalance
        mlp = mlp_tensors * e * (routed * spec.expert_ffn_hidden_size + spec.shared_ffn_hidden_size)
        # the dispatched copies (at the experts' width), the router's scores, a latent projection's output
        outside += sb * (routed * e * spec.expert_width + ROUTER_PROB_BYTES * spec.num_experts
                         + (e * spec.expert_input_size if spec.expert_input_size else 0))
        if not experts_split:
            outside, mlp = outside + sb * mlp, 0.0
    return outside, mlp


def activation_bytes_per_layer(spec: ModelSpec, micro_batch_size: int, tp: int = 1, sequence_parallel: bool = False,
                               recompute: str = "none", dtype_bytes: int = 2, *, moe: bool = False,
                               imbalance: float = 1.0, etp: int | None = None, linear: bool = False,
                               part: str = "both") -> float:
    """Activation bytes one layer (an MoE layer with `moe`, a Gated DeltaNet layer with `linear`, a block of one
    `part`: "mixer" or "mlp") keeps for one micro-batch on one device.

    GPT (dropout, no flash): s·b·h·(34 + 5·a·s/h) without parallelism, s·b·h·(10 + 24/t + 5·a·s/(h·t))
    with tensor parallel, (…)/t with tensor + sequence parallel, 2·s·b·h (/t with sp) with full
    recompute; selective recompute drops the attention-core term (a Gated DeltaNet layer has none: selective
    recompute leaves it as it is). `etp` (an MoE layer; default tp): the experts' tensor-parallel split, 1 where
    they run whole on every tp rank. Where tp exceeds the key/value heads each rank holds the one head its query
    heads use (strategy.kv_head_replicas).
    """
    if recompute == "full":
        layer_input = dtype_bytes * spec.seq_len * micro_batch_size * spec.hidden_size
        return layer_input / tp if sequence_parallel else layer_input
    experts_split = etp is None or etp == tp
    outside, inside, core, whole = _activation_terms(spec, micro_batch_size, dtype_bytes, moe, imbalance, experts_split,
                                                     linear, kv_head_replicas(spec, tp) if _attends(spec, linear) else 1,
                                                     part)
    if recompute == "selective":
        core = 0.0
    return (outside / tp if sequence_parallel else outside) + (inside + core) / tp + whole


def _linear_mixer_bytes(spec: ModelSpec, e: int) -> float:
    """What a Gated DeltaNet mixer keeps per token for its backward, as transformers runs Qwen3.5's and Qwen3-Next's
    on flash-linear-attention's and causal-conv1d's kernels. In the compute dtype: the convolution's input (the
    packed [q | k | v]; the fused convolution and SiLU keep nothing else), q and k l2-normalised at the key heads'
    count (flash-linear-attention groups value heads over them, GVA) and v's contiguous copy, the chunk's WY matrix A
    (C values per value head), β, the gated norm's two tensors per value feature and the output projection's input.
    In fp32: the gated norm's three per value feature and its 1/rms per value head; per value head the decay's log
    (its chunk sum), its softplus's input and output; per key head q's and k's 1/norm."""
    linear = spec.gated_delta_net
    if isinstance(linear, ChannelMixer):
        return e * linear.kept_elements()
    nk, nv, value = linear.num_k_heads, linear.num_v_heads, linear.value_size
    kept = (linear.conv_channels + 2 * linear.key_size + value + nv * _linear_chunk(spec) + nv
            + GATED_NORM_TENSORS_PER_FEATURE * value + value)
    fp32 = GATED_NORM_FP32_PER_FEATURE * value + nv + 3 * nv + 2 * nk
    return e * kept + LINEAR_STATISTIC_BYTES * fp32


def model_state_bytes(parameters: float, dp: int, sharding_level: int, dtype_bytes: int = 2,
                      trainable: float = 1.0) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) bytes on one device: 2 + 2 + 12 bytes per parameter
    for mixed-precision Adam, ZeRO-1 sharding the 12 over dp, ZeRO-2 also the gradients, ZeRO-3 also
    the weights. `trainable`: the share of the parameters that train (ModelSpec.trainable_fraction): gradients and
    optimizer states for those alone."""
    weights = dtype_bytes * parameters
    grads = dtype_bytes * parameters * trainable
    optimizer = OPTIMIZER_BYTES[dtype_bytes] * parameters * trainable
    if sharding_level >= 1:
        optimizer /= dp
    if sharding_level >= 2:
        grads /= dp
    if sharding_level >= 3:
        weights /= dp
    return weights, grads, optimizer


def stage_parameters(spec: ModelSpec, tp: int, pp: int, stage: int, virtual_pp: int = 1, ep: int = 1,
                     etp: int | None = None, layers_per_stage: tuple[int, ...] | None = None) -> float:
    """Parameters held by one device of pipeline rank `stage`: its layers' matrices split by tp (norm
    weights replicated; layers per rank as strategy.rank_layers lays them out: as `layers_per_stage` lists the
    stages, else uneven where pp does not divide them), the vocabulary-parallel embedding on the first rank, the LM head and final norm on
    the last (a tied head is a second copy when the two ends are different ranks); in MoE layers the
    router (replicated), the shared experts and E/ep routed experts (split by etp: tp by default, 1 where
    the experts run whole on every tp rank)."""
    etp = tp if etp is None else etp
    layout = tuple(layers_per_stage) if layers_per_stage is not None else None  # (a list is no cache key)
    kinds = _rank_kinds(spec, pp, virtual_pp, layout)[stage]
    return sum(_rank_parameters(spec, tp, pp, stage, kinds, ep, etp))


# A decoder layer's kind: (its MLP is a mixture of experts, its token mixer is Gated DeltaNet linear attention, its
# parts: "both" a token mixer and an MLP, "mixer" or "mlp" alone: Nemotron-H's blocks of one part). A rank's layers
# are counted per kind in this order (`_layer_kinds`).
LAYER_KINDS = ((False, False, "both"), (True, False, "both"), (False, True, "both"), (True, True, "both"),
               (False, False, "mixer"), (False, True, "mixer"), (False, False, "mlp"), (True, False, "mlp"))


@functools.lru_cache(maxsize=65536)
def _rank_kinds(spec: ModelSpec, pp: int, virtual_pp: int,
                layout: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], ...]:
    """Each pipeline rank's layer counts per kind (LAYER_KINDS), its stages' layers as `layout` (a Strategy's
    layers_per_stage) lists them, else as stage_layers lays them out."""
    return tuple(_layer_kinds(spec, layers) for layers in rank_layer_indices(spec.num_layers, pp, virtual_pp, layout))


@functools.lru_cache(maxsize=1024)
def _kind_of_each_layer(spec: ModelSpec) -> tuple[tuple[bool, bool, str], ...]:
    """Each decoder layer's kind (one of LAYER_KINDS), in layer order."""
    moe, linear = set(spec.moe_layer_indices), set(spec.linear_layer_indices)
    parts = block_parts(spec.mixer_free_layers, spec.mlp_free_layers)
    return tuple((i in moe, i in linear, parts.get(i, "both")) for i in range(spec.num_layers))


def _layer_kinds(spec: ModelSpec, layers) -> tuple[int, ...]:
    """The counts of each kind (LAYER_KINDS) among the layer indices `layers`."""
    each = _kind_of_each_layer(spec)
    return tuple(sum(each[i] == kind for i in layers) for kind in LAYER_KINDS)


def _count_layers(kinds: tuple[int, ...], holds) -> int:
    """How many of the layers counted per kind in `kinds` are of a kind (LAYER_KINDS' (moe, linear, part)) that
    `holds` accepts."""
    return sum(n for n, kind in zip(kinds, LAYER_KINDS) if n and holds(kind))


@functools.lru_cache(maxsize=1024)
def _spec_kinds(spec: ModelSpec) -> tuple[tuple[bool, bool, str], ...]:
    """The kinds of layer `spec` has (the dense attention layer's always: it prices the model's ends)."""
    counts = _layer_kinds(spec, range(spec.num_layers))
    return tuple(kind for i, kind in enumerate(LAYER_KINDS) if counts[i] or i == 0)


@functools.lru_cache(maxsize=65536)
def _layer_parameters(spec: ModelSpec, tp: int, ep: int, moe: bool, etp: int, linear: bool = False,
                      part: str = "both") -> tuple[float, float]:
    """(parameters reduced over dp, routed experts' parameters reduced over dp/ep) of one layer on one device. A
    Gated DeltaNet layer's mixer in attention's place: its projections split, its other parameters whole (distcore
    holds them whole on every rank), its norms the two layer norms (no q/k norms). A block of one `part` ("mixer",
    "mlp") holds that part and one norm."""
    if part == "mlp":
        mlp_only = spec.hidden_size + (spec.mlp_parameters / tp if not moe else
                                       spec.shared_expert_parameters / etp + spec.moe_whole_parameters)
        return mlp_only, spec.num_experts // ep * spec.expert_parameters / etp if moe else 0.0
    mixer, norms = 0.0, 2 * spec.hidden_size
    if linear:
        mixer = (spec.gated_delta_net.matmul_parameters(spec.hidden_size) / tp + spec.gated_delta_net.other_parameters
                 + _replicated_key_columns(spec, tp) * spec.hidden_size)
    if _attends(spec, linear):  # (beside the linear mixer where it runs beside the attention: Falcon-H1's)
        # Whole on every rank: latent attention's down-projections; the key/value projections where tp exceeds their
        # heads (each rank computes the head its query heads use from the whole weight: ReplicatedColWiseParallel).
        unsplit = spec.attention_unsplit_parameters
        if kv_head_replicas(spec, tp) > 1:
            unsplit += _replicated_kv_weights(spec)
        mixer += (spec.attention_parameters - unsplit) / tp + unsplit
        norms = spec.layer_norm_parameters
    mixer += spec.unplanned_parameters  # modules no plan names: whole on every rank
    if part == "mixer":
        return mixer + norms - spec.hidden_size, 0.0
    if not moe:
        return mixer + spec.mlp_parameters / tp + norms, 0.0
    shared = mixer + spec.shared_expert_parameters / etp + spec.moe_whole_parameters + norms
    return shared, spec.num_experts // ep * spec.expert_parameters / etp


def _replicated_key_columns(spec: ModelSpec, tp: int) -> float:
    """A Mamba-2 mixer's B and C columns of its input projection that a rank holds beyond 1/tp of them, where tp
    exceeds its state groups: each rank computes its group's whole (2 x key_size / groups where 1/tp was priced)."""
    linear = spec.gated_delta_net
    if not (linear and linear.key_heads_replicable and tp > linear.num_k_heads):
        return 0.0
    return 2 * linear.key_size * (1 / linear.num_k_heads - 1 / tp)


def _replicated_kv_weights(spec: ModelSpec) -> int:
    """The weights of one attention that are whole on every rank where tp exceeds the key/value heads: the key and
    value projections, or a packed [q | k | v] (GPTBigCode's and Falcon's multi-query, Phi-3's) with its query part
    (ReplicatedColWiseParallel(packed_query=...): the weight is one parameter)."""
    packed = spec.q_size if spec.packed_unequal_qkv else 0
    return (packed + spec.kv_size + spec.value_size) * spec.hidden_size


@functools.lru_cache(maxsize=65536)
def _rank_parameters(spec: ModelSpec, tp: int, pp: int, stage: int, kinds: tuple[int, ...],
                     ep: int, etp: int) -> tuple[float, float]:
    """(dense, expert) parameters of a rank holding `kinds` (its layer counts per LAYER_KINDS; see stage_parameters)."""
    params = experts = 0.0
    for count, (moe, linear, part) in zip(kinds, LAYER_KINDS):
        if count:
            layer, expert_layer = _layer_parameters(spec, tp, ep, moe, etp, linear, part)
            params += count * layer
            experts += count * expert_layer
    if stage == 0:
        # a vision tower and learned positions: whole on every tp rank
        params += spec.embedding_parameters / tp + spec.media_parameters + spec.position_parameters
    if stage == pp - 1:
        params += spec.final_norm_parameters
        if not spec.tied_embeddings:
            params += spec.head_parameters / tp
        elif pp > 1:  # the embedding's copy on the last stage
            params += spec.embedding_parameters / tp
    return params, experts


# ------------------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds of one step on the critical path; communication is what stays exposed after overlap."""

    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    optimizer_s: float
    ep_comm_s: float = 0.0  # expert parallel's all-to-alls (mixtures of experts)

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.tp_comm_s + self.dp_comm_s + self.pp_comm_s + self.bubble_s + self.optimizer_s
                + self.ep_comm_s)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes on the most loaded device (the first or the last pipeline stage)."""

    weights: float
    gradients: float
    optimizer_states: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer_states + self.activations + self.buffers


@dataclass(frozen=True)
class Estimate:
    """Predicted step time and memory of one strategy; `fits` = memory within the usable capacity."""

    strategy: Strategy
    step_time_s: float
    time: TimeBreakdown
    memory: MemoryBreakdown
    capacity_bytes: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    num_devices: int
    peak_flops: float
    tokens_per_step: int

    @property
    def memory_bytes_per_device(self) -> float:
        return self.memory.total

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity_bytes

    @property
    def tflops_per_device(self) -> float:
        """Model TFLOP/s per device (recomputation not counted, as in MFU)."""
        return self.model_flops_per_step / self.step_time_s / self.num_devices / 1e12

    @property
    def hardware_tflops_per_device(self) -> float:
        """Executed TFLOP/s per device, recomputation included (what Megatron-LM reports)."""
        return self.hardware_flops_per_step / self.step_time_s / self.num_devices / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOP/s over the devices' peak."""
        return self.tflops_per_device * 1e12 / self.peak_flops

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_time_s

    def breakdown(self) -> dict[str, float]:
        """A flat dict (JSON- and pandas-friendly) of the time and memory breakdowns and rates."""
        t, m = self.time, self.memory
        return {
            "compute_s": t.compute_s, "tp_comm_s": t.tp_comm_s, "dp_comm_s": t.dp_comm_s,
            "pp_comm_s": t.pp_comm_s, "ep_comm_s": t.ep_comm_s, "bubble_s": t.bubble_s, "optimizer_s": t.optimizer_s,
            "weights_bytes": m.weights, "gradients_bytes": m.gradients,
            "optimizer_states_bytes": m.optimizer_states, "activations_bytes": m.activations,
            "buffers_bytes": m.buffers, "capacity_bytes": self.capacity_bytes,
            "hardware_tflops_per_device": self.hardware_tflops_per_device, "mfu": self.mfu,
            "tokens_per_s": self.tokens_per_second,
        }


# ----------------------------------------------------------------------------------------- estimate


@dataclass(frozen=True)
class _LayerCost:
    """Per-layer, per-micro-batch costs on one device for a given (tp, micro-batch, sp)."""

    gemm_fwd: float
    core_fwd: float
    core_bwd: float  # with the core kernel's own recomputation in its backward
    selective_fwd: float  # what selective recompute re-runs: the attention core (nothing in a Gated DeltaNet layer)
    elementwise_fwd: float
    core_elementwise_fwd: float
    tp_collective: float  # one all-reduce (or all-gather + reduce-scatter pair) of b·s·h
    tp_collectives: int  # how many a forward and backward run: 2 per split part (attention's, a dense MLP's)
    ep_collective: float  # one all-to-all of the routed tokens (dispatch or combine) over the ep ranks
    packed_qkv_collectives: float  # unequal packed q/k/v: its output's reduce-scatter + gradient all-gather
    qk_norm_collectives: float  # q/k norms: statistics / weight gradients across the tp ranks
    latent_collectives: float  # latent attention: its backward all-reduces in place of the attention's of b·s·h
    # Gated DeltaNet: its whole parameters' gradients summed across the tp ranks; its unequally packed projections'
    # reduce-scatter and all-gather; replicated key heads' (Mamba-2's B and C) all-reduces
    linear_collectives: float
    head_gemm_fwd: float
    head_elementwise_fwd: float
    activations: dict  # recompute mode -> bytes per layer
    logits_bytes: float
    embedding_output_bytes: float
    p2p_bytes: float


def _gemm_time(m: float, k: float, n: float, flops: float, bandwidth: float, dtype_bytes: int) -> float:
    """Roofline of one GEMM [m,k]x[k,n]: the slower of its FLOPs and its operand traffic."""
    return max(2.0 * m * k * n / flops, dtype_bytes * (m * k + k * n + m * n) / bandwidth)


def clear_caches() -> None:
    """Forget the memoised per-layer and per-rank terms (a timed search then starts cold, as in a fresh process)."""
    for cached in (_forward_flops_per_token, _layer_forward_flops, _kind_of_each_layer, balanced_layout, _rank_kinds,
                   _layer_parameters,
                   _layer_cost, _layer_timing, _rank_timings, _pace, _rank_layer_counts, _peak_ranks, _rank_parameters,
                   _spec_kinds):
        cached.cache_clear()


def _mlp_gemms(rows: float, hidden: int, ffn: float, gated: bool, flops: float, bw: float, e: int) -> float:
    """One MLP's GEMMs over `rows` tokens (its ffn width as split on this device)."""
    return (_gemm_time(rows, hidden, (2 if gated else 1) * ffn, flops, bw, e)
            + _gemm_time(rows, ffn, hidden, flops, bw, e))


def _expert_tp(cluster: Cluster, tp: int) -> int:
    """The experts' tensor-parallel split under the cluster's engine (EngineProfile.expert_tensor_parallel)."""
    return tp if cluster.engine.expert_tensor_parallel else 1


def _expert_imbalance(spec: ModelSpec, ep: int) -> float:
    """The busiest rank's routed tokens over the mean: only expert parallel spreads them unevenly."""
    return spec.expert_load_imbalance if ep > 1 else 1.0


@functools.lru_cache(maxsize=65536)
def _layer_cost(spec: ModelSpec, cluster: Cluster, tp: int, micro_batch_size: int, sequence_parallel: bool,
                moe: bool = False, ep: int = 1, linear: bool = False, part: str = "both") -> _LayerCost:
    """A layer's costs; a block of one `part` ("mixer": attention or a linear mixer alone, "mlp": an MLP or MoE
    block alone) has that part's."""
    mixer_part, mlp_part = part != "mlp", part != "mixer"
    p = cluster.profile
    e = cluster.dtype_bytes
    engine = cluster.engine
    measured = engine.torch_kernels and cluster.dtype != "fp32"  # calibrate measures torch's kernels in bf16
    flops = (p.layer_gemm_flops if measured and p.layer_gemm_flops else p.matmul_flops(cluster.dtype))
    bw = p.hbm_bandwidth * p.hbm_efficiency
    tokens = micro_batch_size * spec.seq_len
    h, f = spec.hidden_size, spec.ffn_hidden_size
    imbalance = _expert_imbalance(spec, ep) if moe else 1.0
    etp = _expert_tp(cluster, tp)
    # The tokens an MoE block runs on this rank: under sequence parallel with whole blocks (etp = 1) its slice.
    moe_tokens = tokens / tp if moe and sequence_parallel and etp == 1 else tokens
    gdn = spec.gated_delta_net if linear else None
    attends = _attends(spec, linear)  # an attention in the layer: alone, or beside the linear mixer (Falcon-H1's)
    attention_projections = spec.attention_projections if attends else ()
    replicas = kv_head_replicas(spec, tp) if attends else 1
    if replicas > 1:  # tp above the key/value heads: each rank computes the one its query heads use, replicas / tp of k, v
        (n_in, n_out, split), output = attention_projections
        attention_projections = ((n_in, n_out + (spec.kv_size + spec.value_size) * (replicas - 1), split), output)
    projections = (gdn.projections(h) if gdn else ()) + tuple(attention_projections)
    gemm = sum(_gemm_time(tokens, n_in / (tp if split == "in" else 1), n_out / (tp if split == "out" else 1),
                          flops, bw, e) for n_in, n_out, split in projections) if mixer_part else 0.0
    replicated_keys = _replicated_key_columns(spec, tp) if gdn and mixer_part else 0.0
    if replicated_keys:  # B and C of the rank's group, whole
        gemm += _gemm_time(tokens, h, replicated_keys, flops, bw, e)
    if spec.unplanned_parameters and mixer_part:  # modules no plan names, whole on every rank: as matmuls of their weights
        gemm += _gemm_time(tokens, h, spec.unplanned_parameters / h, flops, bw, e)
    ep_collective = 0.0
    if moe and mlp_part:
        # Router, shared experts on every token, and the E/ep local experts as grouped GEMMs of
        # tokens·k·imbalance/(E/ep) rows each (the roofline prices small groups by their weights' traffic); a latent
        # narrower than the hidden size: its projections on every token, the experts and their all-to-alls at its width.
        local = spec.num_experts // ep
        routed = moe_tokens * spec.experts_per_token * imbalance
        width = spec.expert_width
        gemm += _gemm_time(moe_tokens, h, spec.num_experts, flops, bw, e)
        if spec.expert_input_size:
            gemm += _gemm_time(moe_tokens, h, width, flops, bw, e) + _gemm_time(moe_tokens, width, h, flops, bw, e)
        gemm += local * _mlp_gemms(routed / local, width, spec.expert_ffn_hidden_size / etp, spec.gated_mlp, flops, bw, e)
        if spec.shared_ffn_hidden_size:
            gemm += _mlp_gemms(moe_tokens, h, spec.shared_ffn_hidden_size / etp, spec.gated_mlp, flops, bw, e)
        # The ep ranks are dp ranks tp apart (ParallelDims: tp innermost): those on one node talk over NVLink.
        bw_ep, lat_ep = cluster.link(ep, tp)
        bw_out, lat_out = p.inter_node_bandwidth * p.comm_efficiency, p.inter_node_latency
        ep_collective = all_to_all_time(e * routed * width, ep, bw_ep, lat_ep,
                                        local_ranks=max(1, cluster.devices_per_node // tp),
                                        inter_bandwidth=bw_out, inter_latency=lat_out)
    elif mlp_part:
        gemm += _mlp_gemms(tokens, h, f / tp, spec.gated_mlp, flops, bw, e)
    # Flash attention's rate (measured, or the engine's share of the GEMM rate). A Gated DeltaNet core runs at it
    # too: flash-linear-attention's kernels are, like flash attention's, small per-block matmuls in fused Triton
    # kernels (no separate measurement of theirs exists here).
    flash_flops = p.attention_flops if measured and p.attention_flops else flops * engine.attention(p.arch)
    core = core_bwd = attention_core = 0.0
    if gdn:
        linear_fwd, linear_recompute = _linear_core_flops(spec)
        core = tokens * linear_fwd / tp / flash_flops
        core_bwd = BWD_TO_FWD * core + tokens * linear_recompute / tp / flash_flops
    if attends:
        core_flops = flash_flops if spec.flash_attention else flops
        attention_core = 2.0 * micro_batch_size * spec.seq_len**2 * (spec.q_size + spec.attention_output_size) / tp / core_flops
        core += attention_core
        core_bwd += (BWD_TO_FWD + (FLASH_BWD_RECOMPUTE if spec.flash_attention else 0.0)) * attention_core
    if not mixer_part:
        core = core_bwd = attention_core = 0.0
    outside, inside, core_bytes, whole = _activation_terms(spec, micro_batch_size, e, moe, imbalance, etp == tp,
                                                           linear, replicas, part)
    stored = (outside / tp if sequence_parallel else outside) + (inside + core_bytes) / tp + whole
    # The fused kernels' measured bandwidth, where calibrated (their traffic is what the engine counts).
    bw_elementwise = p.fused_kernel_bandwidth if engine.fused_kernels and p.fused_kernel_bandwidth else bw
    elementwise = engine.elementwise_traffic * stored / bw_elementwise
    core_elementwise = 0.0 if spec.flash_attention else engine.elementwise_traffic * core_bytes / tp / bw
    # Selective recompute re-runs the attention core; distcore leaves a Gated DeltaNet mixer as it is.
    selective = attention_core + core_elementwise if attends else 0.0
    bw_tp, lat_tp = cluster.link(tp, 1)
    message = e * tokens * h
    tp_collective = all_reduce_time(message, tp, bw_tp, lat_tp)
    # Packed q/k/v of unequal parts: distcore splits the weight on its input features and reduce-scatters
    # the packed output (forward), all-gathering its gradient (backward), per layer (tensor_parallel.py's
    # _UnequalPackedColwise), on top of the four collectives of b·s·h; priced per layer as a share of them.
    packed = e * tokens * (spec.q_size + 2 * spec.kv_size)
    packed_qkv = (reduce_scatter_time(packed, tp, bw_tp, lat_tp) + all_gather_time(packed, tp, bw_tp, lat_tp)
                  if spec.packed_unequal_qkv and not spec.qkv_interleaved and tp > 1 and replicas == 1 and attends
                  else 0.0)  # replicated key/value heads: column-parallel on every rank's rows (no reduce-scatter)
    # q/k norms under tensor parallel (distcore's tensor_parallel.py). Per head (Qwen3): each rank's heads
    # give a partial gradient of the q and k norm weights (head_dim each, Replicate), summed over the tp
    # ranks: 2 all-reduces of head_dim elements. Over the whole projection (OLMo2): the normalised dim is
    # split, so each of the two norms all-reduces its statistic (the row's sum of squares, one fp32 per
    # token) forward and the statistic's gradient backward (4 all-reduces of tokens fp32 values), and the
    # weights' gradients (Shard over the features) are all-gathered to Replicate: q_size + kv_size elements.
    # Priced per layer per micro-batch, with the other tp collectives. That over-counts with several
    # micro-batches: the per-head all-reduces run once per step (DTensor reduces the Partial gradient when
    # FSDP / the optimizer reads it), not once per micro-batch. (Full recompute's second forward repeats the
    # statistics' all-reduces, not counted, as for the packed q/k/v.) Every message is small (a value per
    # token, a weight of head_dim or q + kv), so the term is latency-bound: ring steps x alpha, not bytes/bw.
    if not attends:  # no q/k norms (its packed projections' collectives are linear_collectives)
        qk_norm = 0.0
    elif spec.qk_norm == "projection" and tp > 1:
        qk_norm = (4 * all_reduce_time(NORM_STATISTIC_BYTES * tokens, tp, bw_tp, lat_tp)
                   + all_gather_time(e * (spec.q_size + spec.kv_size), tp, bw_tp, lat_tp))
    elif spec.qk_norm == "head" and tp > 1:
        qk_norm = 2 * all_reduce_time(e * spec.head_dim, tp, bw_tp, lat_tp)
    else:
        qk_norm = 0.0
    # Latent attention under tp: its split projections take the latents, so the backward all-reduces the
    # gradients of the query latent (the hidden state without one), of the key/value latent and of the rotary
    # key every head uses (ReduceSharedOutputGradient) instead of the hidden state's: three smaller messages,
    # each paying the latency. (Priced alike under sequence parallel, whose pair per collective has the same size.)
    latent = spec.latent_attention if attends else None
    latent_collectives = 0.0
    if latent and tp > 1:
        widths = (latent.q_lora_rank or h, latent.kv_lora_rank, latent.rope_head_dim)
        latent_collectives = sum(all_reduce_time(e * tokens * w, tp, bw_tp, lat_tp) for w in widths) - tp_collective
    # Gated DeltaNet under tp: the parameters distcore keeps whole on every rank (its convolution, per-head biases
    # and decays, its gated norm's weight) get each rank's partial gradients, summed over the tp ranks: one small
    # all-reduce, priced per layer and micro-batch as the q/k norms' (latency-bound).
    linear_collectives = all_reduce_time(e * gdn.other_parameters, tp, bw_tp, lat_tp) if gdn and tp > 1 else 0.0
    if gdn and tp > 1:
        # Its projections packing unequal parts, split on their inputs: the output's reduce-scatter forward and its
        # gradient's all-gather backward (packed q/k/v's). Key heads fewer than the ranks (Mamba-2's state groups):
        # their q and k (B and C), computed whole on every rank, are all-reduced instead, forward and backward
        # (packed.SumBothWays), and the gated norm's statistics, a value per token and group, too (SplitGroupNorm).
        whole = 2 * gdn.key_size if gdn.key_heads_replicable and tp > gdn.num_k_heads else 0
        scattered = e * tokens * max(gdn.packed_split_outputs - whole, 0)
        if scattered:
            linear_collectives += (reduce_scatter_time(scattered, tp, bw_tp, lat_tp)
                                   + all_gather_time(scattered, tp, bw_tp, lat_tp))
        if whole:
            linear_collectives += 2 * (all_reduce_time(e * tokens * whole, tp, bw_tp, lat_tp) + all_reduce_time(
                NORM_STATISTIC_BYTES * tokens * gdn.num_k_heads, tp, bw_tp, lat_tp))
        if isinstance(gdn, SelectiveScan):  # Mamba-1's [dt | B | C]: all-reduced forward, its gradient backward
            linear_collectives += 2 * all_reduce_time(e * tokens * gdn.shared_outputs, tp, bw_tp, lat_tp)
        if isinstance(gdn, LightningAttention):  # its norm over every head: a statistic per token, both ways
            linear_collectives += 2 * all_reduce_time(NORM_STATISTIC_BYTES * tokens, tp, bw_tp, lat_tp)
    if not mixer_part:  # an MLP or MoE block alone: none of the mixer's collectives
        packed_qkv = qk_norm = latent_collectives = linear_collectives = 0.0
    head = _gemm_time(tokens, h, spec.head_width / tp, flops, bw, e)
    logits_bytes = tokens * spec.head_width / tp * (e + LOSS_FP32_BYTES)
    head_elementwise = engine.elementwise_traffic * logits_bytes / bw
    activations = {mode: activation_bytes_per_layer(spec, micro_batch_size, tp, sequence_parallel, mode, e, moe=moe,
                                                    etp=etp, imbalance=imbalance, linear=linear, part=part)
                   for mode in ("none", "selective", "full")}
    split = tp if sequence_parallel else 1
    # Attention's (or a linear mixer's) pair and a dense MLP's; an MoE block runs whole on every tp rank (on this rank's
    # slice under sp) and moves no activations, unless the engine splits its experts over tp.
    # (a linear mixer beside the attention: a pair of its own)
    collectives = ((2 + 2 * (gdn is not None and attends)) if mixer_part else 0) + (2 if mlp_part and (not moe or etp > 1)
                                                                                   else 0)
    return _LayerCost(gemm, core, core_bwd, selective, elementwise, core_elementwise, tp_collective, collectives,
                      ep_collective,
                      packed_qkv, qk_norm, latent_collectives, linear_collectives, head, head_elementwise, activations,
                      logits_bytes, message / split, message / split)


def fused_loss_bytes(spec: ModelSpec, tokens: int, dtype_bytes: int, tp: int = 1) -> float:
    """What linear_cross_entropy holds at its peak, the end of the forward (a mean loss's gradients are
    computed there) or, for a half-precision head in one chunk, the backward (which runs that chunk's gradient
    GEMMs): one chunk's logits (the input dtype; the kernel writes their gradient in place), the hidden states'
    gradient (or the hidden rows times grad_output) and, for a half-precision head cut in more than
    one chunk, the fp32 accumulator of its weight's gradient (the gradient itself becomes the parameter's
    .grad, counted with the model state). Under tp the head is vocabulary-parallel: chunks and accumulator cover this rank's
    ceil(V / tp) rows, the hidden gradient is whole (summed over the ranks). Its time is eager's: the same
    three GEMMs (nothing is recomputed for a mean or sum loss, except with an fp16 head: a fourth GEMM and the
    statistics again, which `_pace` prices from the cluster's dtype), and its elementwise passes read and write the
    chunks in the input dtype, no more than eager's; under tp each chunk adds two small all-reduces of its
    statistics (`_pace`)."""
    v, h = -(-spec.head_width // tp), spec.hidden_size
    chunk = fused_loss_chunk(tokens, h, v, dtype_bytes)
    accumulator = LOSS_FP32_BYTES * v * h if dtype_bytes < LOSS_FP32_BYTES and chunk < tokens else 0
    return chunk * v * dtype_bytes + tokens * h * dtype_bytes + accumulator


def fused_loss_chunk(tokens: int, hidden_size: int, vocab_rows: int, dtype_bytes: int) -> int:
    """linear_cross_entropy's tokens per chunk over `vocab_rows` rows of the head (kernels' chunk_tokens) when
    it trains the head's weight in `dtype_bytes`-byte elements."""
    if dtype_bytes < LOSS_FP32_BYTES and tokens <= FUSED_LOSS_ONE_CHUNK_HIDDEN_MULTIPLE * hidden_size:
        return max(tokens, 1)
    floor = max(FUSED_LOSS_MIN_CHUNK, min(FUSED_LOSS_SPEED_CHUNK, hidden_size))
    chunk = min(max(-(-tokens * hidden_size // vocab_rows), floor), FUSED_LOSS_MAX_CHUNK, tokens)
    return -(-tokens // -(-tokens // chunk))  # evened out over the chunks


def _loss_bytes(spec: ModelSpec, cluster: Cluster, s: Strategy, c: _LayerCost) -> float:
    """The last stage's loss: the logits (input dtype and fp32 upcast, split by tp), or the fused loss's
    buffers where the engine runs it (engine.fused_loss says where distcore can)."""
    if cluster.engine.fused_loss:
        return fused_loss_bytes(spec, s.micro_batch_size * spec.seq_len, cluster.dtype_bytes, s.tp)
    return c.logits_bytes


def _in_flight_layers(chunk_layers: tuple[int, ...], pp: int, num_micro_batches: int, stage: int) -> float:
    """Layer-micro-batches of activations pipeline rank `stage` holds at its peak under 1F1B, its chunks (virtual
    stages) holding `chunk_layers` layers each (Megatron's warm-up: p − r micro-batches on rank r; interleaved:
    2(p − r − 1) + (v − 1)·p + 1 forwards, the k-th on chunk (k // p) mod v: groups of p micro-batches per chunk,
    so the layers counted are each warm-up forward's own chunk's, which differ where the stages are uneven)."""
    v = len(chunk_layers)
    if v == 1:
        return chunk_layers[0] * min(num_micro_batches, pp - stage)
    forwards = min(2 * (pp - stage - 1) + (v - 1) * pp + 1, num_micro_batches * v)
    return float(sum(chunk_layers[(k // pp) % v] for k in range(forwards)))


def _hidden_behind(comm: float, window: float, parts: int, interference: float = OVERLAP_COMPUTE_COST) -> float:
    """Time `comm` adds when overlapped with `window` of compute: what does not fit (at least one of
    its `parts`: the first gather / the last reduction has nothing to hide behind), plus the
    slowdown the hidden part inflicts on the compute (`interference` per second hidden)."""
    exposed = max(comm - window, comm / max(parts, 1))
    return exposed + interference * (comm - exposed)


@dataclass(frozen=True)
class _LayerTiming:
    """One micro-batch through one layer on one device: its forward and backward (the windows data-parallel
    traffic hides behind), its compute with recomputation, its exposed tp and ep communication."""

    fwd: float
    bwd: float
    compute: float
    tp: float
    ep: float


def _gemm_backward(spec: ModelSpec) -> float:
    """A GEMM's backward over its forward: the input's gradient (1) and the weight's (1) for the parameters that train
    (ModelSpec.trainable_fraction: peft's LoRA adapters on frozen weights take the input's alone, their adapters'
    small GEMMs not priced)."""
    return 1.0 + (BWD_TO_FWD - 1.0) * spec.trainable_fraction


@functools.lru_cache(maxsize=65536)
def _layer_timing(spec: ModelSpec, cluster: Cluster, t: int, micro_batch_size: int, sequence_parallel: bool,
                  recompute: str, overlap_tp_comm: bool, moe: bool, ep: int, linear: bool = False,
                  part: str = "both") -> _LayerTiming:
    p = cluster.profile
    c = _layer_cost(spec, cluster, t, micro_batch_size, sequence_parallel, moe, ep, linear, part)
    fwd = c.gemm_fwd + c.core_fwd + c.elementwise_fwd
    gemm_bwd = _gemm_backward(spec) * c.gemm_fwd  # (frozen weights take no weight-gradient GEMM)
    bwd = gemm_bwd + BWD_TO_FWD * c.elementwise_fwd + c.core_bwd
    collectives = c.tp_collectives
    all_to_alls = 4  # dispatch and combine, forward and backward
    gemm_total = c.gemm_fwd + gemm_bwd
    if recompute == "full":
        recompute_s = fwd
        collectives += c.tp_collectives // 2  # the forward's, again
        all_to_alls += 2
        gemm_total += c.gemm_fwd
    elif recompute == "selective":
        recompute_s = c.selective_fwd
    else:
        recompute_s = 0.0
    # The engine's CPU dispatch of a layer's kernels is a floor under its time (the GPU runs ahead); its
    # ops count a forward and a backward of twice the forward's, and full recompute dispatches one more forward.
    floor = cluster.engine.layer_floor_s() * ((1 + BWD_TO_FWD + 1) / (1 + BWD_TO_FWD) if recompute == "full" else 1.0)
    tp_layer = (collectives * c.tp_collective + c.packed_qkv_collectives + c.qk_norm_collectives + c.latent_collectives
                + c.linear_collectives)
    chunked_gemms = 0.0
    if overlap_tp_comm:  # split into t chunks: the first chunk's transfer has nothing to hide behind
        # Every projection GEMM sits at a region's edge and runs in t chunks; a calibrated profile says how
        # much slower that is and how much the transfers beside them slow them (else OVERLAP_COMPUTE_COST).
        chunking = p.overlap_chunking_overhead or 0.0
        interference = OVERLAP_COMPUTE_COST if p.overlap_interference is None else p.overlap_interference
        chunked_gemms = chunking * gemm_total
        wire = cluster.engine.overlap_wire_factor if cluster.dtype_bytes < 4 else 1.0  # fp32 sends fp32 sums anyway
        tp_layer = _hidden_behind(tp_layer * wire, gemm_total, t, interference)
    compute = max(fwd + bwd + recompute_s + chunked_gemms, floor)
    return _LayerTiming(fwd, bwd, compute, tp_layer, all_to_alls * c.ep_collective)


@functools.lru_cache(maxsize=65536)
def _rank_timings(spec: ModelSpec, cluster: Cluster, t: int, micro_batch_size: int, sequence_parallel: bool,
                  recompute: str, overlap_tp_comm: bool, ep: int, pp: int, virtual_pp: int,
                  layout: tuple[int, ...] | None = None) -> tuple[_LayerTiming, ...]:
    """Each pipeline rank's layers summed: a micro-batch's forward, backward, compute, tp and ep time."""
    columns = {kind: dataclasses.astuple(_layer_timing(spec, cluster, t, micro_batch_size, sequence_parallel, recompute,
                                                       overlap_tp_comm, kind[0], ep if kind[0] else 1, kind[1], kind[2]))
               for kind in _spec_kinds(spec)}
    width = len(dataclasses.fields(_LayerTiming))
    summed: dict = {}  # ranks holding the same layer counts per kind cost the same
    for kinds in set(_rank_kinds(spec, pp, virtual_pp, layout)):
        present = [(n, columns[kind]) for n, kind in zip(kinds, LAYER_KINDS) if n]
        summed[kinds] = _LayerTiming(*(sum(n * column[i] for n, column in present) for i in range(width)))
    return tuple(summed[kinds] for kinds in _rank_kinds(spec, pp, virtual_pp, layout))


@functools.lru_cache(maxsize=65536)
def _pace(spec: ModelSpec, cluster: Cluster, t: int, micro_batch_size: int, sequence_parallel: bool, recompute: str,
          overlap_tp_comm: bool, ep: int, pp: int, virtual_pp: int,
          layout: tuple[int, ...] | None = None) -> tuple[float, float, float, int, float]:
    """(compute, tp, ep seconds of one micro-batch, rank) of the slowest pipeline rank, and every rank's time of
    one micro-batch summed (the bubble's). The ends of the pipeline: embedding (one collective in the forward, with
    tp) and LM head + loss (its GEMM forward and backward, the cross entropy over the logits, two collectives): the
    first, the last or a middle rank sets the pace."""
    c = _layer_cost(spec, cluster, t, micro_batch_size, sequence_parallel)
    ranks = _rank_timings(spec, cluster, t, micro_batch_size, sequence_parallel, recompute, overlap_tp_comm, ep, pp,
                          virtual_pp, layout)
    head_compute = ((1 + _gemm_backward(spec)) * c.head_gemm_fwd + (1 + BWD_TO_FWD) * c.head_elementwise_fwd)
    # An fp16 head's fused loss computes its gradients in the backward, re-running its forward's chunk loop: the
    # logits' GEMM (a fourth), their statistics' pass and, under tp, their all-reduces (linear_cross_entropy's
    # _gradients_in_backward; grad_output 1 would underflow fp16's logits' gradient).
    recomputes = cluster.engine.fused_loss and cluster.dtype == "fp16"
    if recomputes:
        head_compute += c.head_gemm_fwd + c.head_elementwise_fwd
    head_tp = 2 * c.tp_collective + (1 + recomputes) * _fused_loss_statistics_time(spec, cluster, t, micro_batch_size)
    stages = [(rank.compute + (head_compute if r == pp - 1 else 0.0),
               rank.tp + c.tp_collective * (r == 0) + head_tp * (r == pp - 1), rank.ep, r) for r, rank in enumerate(ranks)]
    return (*max(stages, key=lambda stage: stage[0] + stage[1] + stage[2]),
            sum(stage[0] + stage[1] + stage[2] for stage in stages))


def _bubble(pp: int, virtual_pp: int, slowest: float, every_stage: float) -> float:
    """The idle time of a pipeline step beyond its m micro-batches at the slowest rank's pace (`slowest`: one
    micro-batch's time there; `every_stage`: one micro-batch's time on every rank, summed).

    1F1B (torch's Schedule1F1B): the pipeline is a flow shop of m identical jobs, whose makespan is every stage's
    time once plus m - 1 times the slowest's (exact for GPipe's order; for 1F1B's an upper bound that its
    simulation reaches where the stages are equal, tests/test_pipeline_schedule.py): the bubble is the other
    ranks' time, (p - 1) x the slowest's only where they are all equal. Before cost model 21 it was priced so
    everywhere, which overpriced a pipeline whose last stage is heavy (Gemma 2's 256k-vocabulary head weighs ~7 of
    its layers) by up to 1.3x at m = p against the simulated schedule, 1.5% at most on even layouts now.
    Interleaved (ScheduleInterleaved1F1B): (p - 1) / v of the slowest rank's time (Megatron's), whose chunks are
    what warm the pipeline up and drain it; on even and FLOPs-balanced layouts this prices 0.96x to 1.19x the
    simulated schedule's step (chunks of unequal layers pace its rounds unevenly), a known limit."""
    if pp == 1:
        return 0.0
    if virtual_pp == 1:
        return every_stage - slowest
    return (pp - 1) / virtual_pp * slowest


def _fused_loss_statistics_time(spec: ModelSpec, cluster: Cluster, tp: int, micro_batch_size: int) -> float:
    """A vocabulary-parallel fused loss (tp > 1) all-reduces each chunk's row statistics: the max, then three
    fp32 sums per token (linear_cross_entropy's _reduce_stats), latency-bound messages."""
    if tp == 1 or not cluster.engine.fused_loss:
        return 0.0
    tokens = micro_batch_size * spec.seq_len
    chunk = fused_loss_chunk(tokens, spec.hidden_size, -(-spec.head_width // tp), cluster.dtype_bytes)
    bw, lat = cluster.link(tp, 1)
    chunks = -(-tokens // chunk)
    return chunks * (all_reduce_time(LOSS_FP32_BYTES * chunk, tp, bw, lat) + all_reduce_time(3 * LOSS_FP32_BYTES * chunk, tp, bw, lat))


@functools.lru_cache(maxsize=65536)
def _rank_layer_counts(spec: ModelSpec, pp: int, virtual_pp: int, layout: tuple[int, ...] | None = None) -> tuple[int, ...]:
    return tuple(sum(k) for k in _rank_kinds(spec, pp, virtual_pp, layout))


def _data_parallel_time(cluster: Cluster, nbytes: float, n: int, stride: int, level: int, micro_batches: int,
                        window_fwd: float, window_bwd: float, parts: int, trainable: float = 1.0) -> float:
    """Gradient traffic (and ZeRO's parameter gathers) of `nbytes` of parameters over `n` ranks `stride`
    apart, hidden behind the forward and backward windows where it can be. `trainable`: the share of them that
    train (ModelSpec.trainable_fraction): gradients, and the updated weights ZeRO-1/2 gather, of that share alone;
    ZeRO-3 gathers every weight."""
    if n <= 1 or nbytes == 0:
        return 0.0
    p = cluster.profile
    bw, lat = cluster.link(n, stride)
    grads = nbytes * trainable
    all_reduce = all_reduce_time(grads, n, bw, lat)
    gather = all_gather_time(grads, n, bw, lat)
    gather_weights = all_gather_time(nbytes, n, bw, lat)
    scatter = reduce_scatter_time(grads, n, bw, lat)
    # The engine's copies into and out of the communication buffers (FSDP2's copy-in / copy-out), one per
    # collective below, at memory bandwidth and not hidden.
    copy = cluster.engine.fsdp_copy_passes * grads / (p.hbm_bandwidth * p.hbm_efficiency)
    copy_weights = cluster.engine.fsdp_copy_passes * nbytes / (p.hbm_bandwidth * p.hbm_efficiency)
    if level == 0:
        return _hidden_behind(all_reduce, window_bwd, parts) + copy
    if level == 1:
        return _hidden_behind(scatter, window_bwd, parts) + _hidden_behind(gather, window_fwd, parts) + 2 * copy
    if level == 2:
        return (micro_batches * (_hidden_behind(scatter, window_bwd, parts) + copy)
                + _hidden_behind(gather, window_fwd, parts) + copy)
    return micro_batches * (_hidden_behind(gather_weights, window_fwd, parts)
                            + _hidden_behind(gather_weights + scatter, window_bwd, parts) + 2 * copy_weights + copy)


def estimate(spec: ModelSpec, cluster: Cluster, strategy: Strategy, *, global_batch_size: int,
             validate: bool = True) -> Estimate:
    """Predict the step time and per-device memory of `strategy` (see the module docstring).

    Raises `InvalidStrategy` (listing every broken rule) unless `validate=False` (the search
    enumerates valid strategies only and skips the check for speed).
    """
    if validate:
        check(spec, cluster, strategy, global_batch_size=global_batch_size)
    s = strategy
    p = cluster.profile
    e = cluster.dtype_bytes
    t, pp, dp, m, v = s.tp, s.pp, s.dp, s.num_micro_batches, s.virtual_pp
    costs = {kind: _layer_cost(spec, cluster, t, s.micro_batch_size, s.sequence_parallel, kind[0],
                               s.ep if kind[0] else 1, kind[1], kind[2]) for kind in _spec_kinds(spec)}
    c = costs[LAYER_KINDS[0]]  # a dense attention layer's: the model's ends are priced from it
    layout = s.layers_per_stage
    kinds = _rank_kinds(spec, pp, v, layout)  # each rank's layers per kind, uneven where pp does not divide them
    per_rank = _rank_layer_counts(spec, pp, v, layout)
    knobs = (spec, cluster, t, s.micro_batch_size, s.sequence_parallel, s.recompute, s.overlap_tp_comm, s.ep, pp, v,
             layout)
    ranks = _rank_timings(*knobs)
    stage_compute, stage_tp, stage_ep, slowest, every_stage = _pace(*knobs)
    stage_time = stage_compute + stage_tp + stage_ep

    compute_s = m * stage_compute
    tp_s = m * stage_tp
    ep_s = m * stage_ep
    if spec.is_moe and s.sequence_parallel and t > 1 and _expert_tp(cluster, t) == 1:
        # Whole MoE blocks on each tp rank's slice of the sequence: their gradients cover the slice. DTensor sums
        # them over the tp ranks once per step, when they are read (an all-reduce of the blocks' parameters of the
        # rank holding the most MoE layers, exposed); expert-parallel experts sum theirs in each backward, one
        # all-reduce per layer and micro-batch (distcore's ExpertParallelExperts).
        moe_layers = max(_count_layers(k, lambda kind: kind[0]) for k in kinds)
        experts = spec.num_experts // s.ep * spec.expert_parameters
        block = spec.moe_whole_parameters + spec.shared_expert_parameters + (experts if s.ep == 1 else 0)
        bw_tp, lat_tp = cluster.link(t, 1)
        tp_s += all_reduce_time(e * moe_layers * block, t, bw_tp, lat_tp)
        if s.ep > 1:
            tp_s += m * moe_layers * all_reduce_time(e * experts, t, bw_tp, lat_tp)
    if kv_head_replicas(spec, t) > 1:
        # The key/value projections (a packed qkv whole) on every tp rank, each rank's gradient its own query heads'
        # share: summed over the tp ranks once per step, when read (an all-reduce of the rank holding the most
        # attention layers).
        attention_layers = max(_count_layers(k, lambda kind: kind[2] != "mlp" and _attends(spec, kind[1])) for k in kinds)
        bw_tp, lat_tp = cluster.link(t, 1)
        tp_s += all_reduce_time(e * attention_layers * _replicated_kv_weights(spec) * spec.trainable_fraction, t, bw_tp,
                                lat_tp)
    bubble_s = _bubble(pp, v, stage_time, every_stage)
    pp_s = 0.0
    if pp > 1:
        bw_pp, lat_pp = cluster.link(2, t * dp)
        pp_s = 2 * (v * m + pp - 1) * p2p_time(c.p2p_bytes, bw_pp, lat_pp)
        if spec.tied_embeddings:  # the embedding's and the head's gradients summed between first and last stage
            bw_tie, lat_tie = cluster.link(2, (pp - 1) * t * dp)
            pp_s += all_reduce_time(e * spec.vocab_size * spec.hidden_size / t * spec.trainable_fraction, 2, bw_tie,
                                    lat_tie)

    # Data parallel: gradients (and ZeRO's parameter gathers) of the device holding the most parameters; the
    # routed experts' over the dp / ep ranks holding the same experts (ep ranks are dp ranks tp apart).
    params, experts = max((_rank_parameters(spec, t, pp, rank, kinds[rank], s.ep, _expert_tp(cluster, t))
                           for rank in _peak_ranks(kinds)),
                          key=sum)
    level = s.sharding_level
    windows = (ranks[slowest].fwd, ranks[slowest].bwd, per_rank[slowest])
    trainable = spec.trainable_fraction
    if s.ep == 1:
        dp_s = _data_parallel_time(cluster, e * (params + experts), dp, t, level, m, *windows, trainable)
    else:
        dp_s = (_data_parallel_time(cluster, e * params, dp, t, level, m, *windows, trainable)
                + _data_parallel_time(cluster, e * experts, dp // s.ep, t * s.ep, level, m, *windows, trainable))
    sharded = level >= 1
    optimizer_s = (ADAM_BYTES_PER_PARAM * trainable
                   * (params / (dp if sharded else 1) + experts / (dp // s.ep if sharded else 1))
                   / (p.hbm_bandwidth * p.hbm_efficiency))

    # What runs on this device measured slower or faster than predicted (a measure=True search's factor).
    time = TimeBreakdown(*(p.step_time_scale * t for t in (compute_s, tp_s, dp_s, pp_s, bubble_s, optimizer_s, ep_s)))
    memory = _memory(spec, cluster, s, costs, kinds, per_rank)
    tokens = global_batch_size * spec.seq_len
    return Estimate(
        strategy=s, step_time_s=time.total_s, time=time, memory=memory,
        capacity_bytes=p.memory_bytes * USABLE_MEMORY_FRACTION,
        model_flops_per_step=model_flops_per_step(spec, global_batch_size),
        hardware_flops_per_step=hardware_flops_per_step(spec, global_batch_size, s.recompute),
        num_devices=cluster.num_devices, peak_flops=p.peak_fp32_flops if cluster.dtype == "fp32" else p.peak_bf16_flops,
        tokens_per_step=tokens,
    )


@functools.lru_cache(maxsize=65536)
def _peak_ranks(kinds: tuple[tuple[int, ...], ...], chunks: tuple[tuple[int, ...], ...] | None = None) -> list[int]:
    """The pipeline ranks that can hold the most, given each rank's layer counts per kind (and, for activations, the
    layers of each of its chunks: `chunks`): the first (embedding, most micro-batches in flight), the last (LM head,
    logits) and of the middle ones holding the same layers in the same chunks the earliest (the most in flight);
    middle ranks may hold more layers (uneven layouts), other kinds of layer, or other chunks (interleaved)."""
    pp = len(kinds)
    earliest = {}
    for rank in range(1, pp - 1):
        earliest.setdefault((kinds[rank], chunks[rank] if chunks else None), rank)
    return sorted({0, pp - 1, *earliest.values()})


def _memory(spec: ModelSpec, cluster: Cluster, s: Strategy, costs: dict, kinds: tuple[tuple[int, ...], ...],
            per_rank: tuple[int, ...]) -> MemoryBreakdown:
    """Peak memory of the pipeline ranks that can hold the most (`_peak_ranks`); the largest is the device's need. `costs` and `kinds`: each kind of layer's
    costs ({kind: _LayerCost}) and each rank's layer counts per kind (LAYER_KINDS)."""
    e = cluster.dtype_bytes
    t, pp = s.tp, s.pp
    c = costs[LAYER_KINDS[0]]
    etp = _expert_tp(cluster, t)
    # One layer's parameters of each kind, as stage_parameters counts them.
    layer_params = {kind: sum(_layer_parameters(spec, t, s.ep, kind[0], etp, kind[1], kind[2])) for kind in costs}
    stages = s.layers_per_stage or stage_layers(spec.num_layers, pp * s.virtual_pp)  # rank r holds stages r, r + pp, ...
    best = None
    for stage in _peak_ranks(kinds, tuple(tuple(stages[r::pp]) for r in range(pp))):
        params, experts = _rank_parameters(spec, t, pp, stage, kinds[stage], s.ep, etp)
        weights, grads, optimizer = model_state_bytes(params, s.dp, s.sharding_level, e, spec.trainable_fraction)
        if experts:
            states = model_state_bytes(experts, s.dp // s.ep, s.sharding_level, e, spec.trainable_fraction)
            weights, grads, optimizer = weights + states[0], grads + states[1], optimizer + states[2]
        present = [kind for n, kind in zip(kinds[stage], LAYER_KINDS) if n]
        counts = dict(zip(LAYER_KINDS, kinds[stage]))
        largest_layer = max(layer_params[kind] for kind in present)
        buffers = DDP_BUCKETS_IN_FLIGHT * DDP_BUCKET_BYTES if s.dp > 1 else 0.0
        if s.sharding_level == 2:
            buffers += e * largest_layer * spec.trainable_fraction  # a layer's full gradients before their reduce-scatter
        elif s.sharding_level == 3:  # gathered weights + full grads
            buffers += (ZERO3_PREFETCH_LAYERS + spec.trainable_fraction) * e * largest_layer
        if pp > 1:
            buffers += 2 * c.p2p_bytes  # send and receive buffers
        # Layer-micro-batches in flight, at the rank's mean activations per layer (over its kinds of layer).
        per_layer = sum(counts[kind] * costs[kind].activations[s.recompute] for kind in present) / per_rank[stage]
        in_flight = _in_flight_layers(stages[stage::pp], pp, s.num_micro_batches, stage)
        activations = in_flight * per_layer
        if s.recompute == "full":  # the layer being recomputed holds its full set
            activations += max(costs[kind].activations["none"] for kind in present)
        if stage == 0:
            activations += c.embedding_output_bytes * min(s.num_micro_batches, pp)
        if stage == pp - 1:
            activations += _loss_bytes(spec, cluster, s, c)
        candidate = MemoryBreakdown(weights, grads, optimizer, activations, buffers)
        if best is None or candidate.total > best.total:
            best = candidate
    return best
