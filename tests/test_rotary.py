"""Rotary position embedding (q and k in one launch) against the plain PyTorch reference."""

from __future__ import annotations

import math

import pytest
import torch

from tridist import kernels
from tridist.kernels.reference import rotary_reference
from tridist.kernels.testing import assert_matches_reference, assert_rounded_once, converts_toward_zero, upcast

U32 = torch.finfo(torch.float32).eps / 2  # fp32 unit roundoff: one fp32 operation's relative error
# How features pair: (j, j + D/2) (Llama), (2j, 2j + 1) (GPT-J), and DeepSeek-V3's interleaved pairs written
# as halves (its backward reads halves and writes interleaved pairs: another index map per direction).
PAIRINGS = {
    "rotate_half": {},
    "interleaved": {"interleaved": True},
    "deinterleave": {"interleaved": True, "deinterleave": True},
}


def llama_tables(length: int, rotary_dim: int, *, half: bool = False, interleaved: bool = False):
    """cos/sin as Llama builds them (duplicated), or one entry per pair (`half`)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    if not half:
        freqs = freqs.repeat_interleave(2, -1) if interleaved else torch.cat([freqs, freqs], -1)
    return freqs.cos(), freqs.sin()


def shape_table(table: torch.Tensor, form: str, *, layout: str, batch: int, seq_len: int):
    """Lay a [T, D] table out as the seed ([1, T, 1, D]), HF ([B, S, D]) or flat ([T, D]) form."""
    if form == "seed":
        return table[None, :, None, :] if layout == "bshd" else table[None, None]
    if form == "hf":
        return table[:seq_len].expand(batch, seq_len, -1).contiguous()
    return table


def qk(batch, seq_len, q_heads, k_heads, head_dim, *, layout, dtype):
    def make(heads):
        shape = (batch, seq_len, heads, head_dim) if layout == "bshd" else (batch, heads, seq_len, head_dim)
        return torch.randn(shape, dtype=dtype, requires_grad=True)

    return make(q_heads), make(k_heads)


def check(q, k, cos, sin, position_ids=None, *, grads=None, **options):
    """Outputs and gradients against the eager reference and fp64 gold (kernels.testing's criterion), and
    as the documented fp32 computation rounded once to the input dtype."""

    def fwd_bwd(fn, q, k, cos, sin, grads):
        outs = fn(q, k, cos, sin, position_ids, **options)
        return outs, torch.autograd.grad(outs, (q, k), grads)

    reference_outs = rotary_reference(q, k, cos, sin, position_ids, **options)
    grads = grads or [torch.randn_like(o) for o in reference_outs]
    outs, in_grads = fwd_bwd(kernels.apply_rotary_pos_emb, q, k, cos, sin, grads)
    ref_outs, ref_grads = fwd_bwd(rotary_reference, q, k, cos, sin, grads)
    gold_outs, gold_grads = fwd_bwd(
        rotary_reference, upcast(q), upcast(k), upcast(cos), upcast(sin), [g.double() for g in grads]
    )
    names = ("q_embed", "k_embed", "dq", "dk")
    for name, o, r, g in zip(names, outs + in_grads, ref_outs + ref_grads, gold_outs + gold_grads):
        assert_matches_reference(o, r, g, name=name)
    # Each output is x_a c - x_b s (or the transposed map for gradients): two fp32 products and a sum,
    # within 2 u (|x_a c| + |x_b s|) <= 2 u * 2 max|x| max|table| of exact; twice that for margin.
    table_max = max(cos.abs().max().item(), sin.abs().max().item()) if cos.numel() else 0.0
    truncates = converts_toward_zero(q.device, q.dtype)
    for name, o, g, x in zip(names, outs + in_grads, gold_outs + gold_grads, (q, k, *grads)):
        bound = 8 * U32 * x.detach().double().abs().amax(-1, keepdim=True) * table_max if x.numel() else 0.0
        assert_rounded_once(o, g, bound=bound, toward_zero=truncates, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize(
    "q_heads, k_heads, head_dim, rotary_dim",
    [(4, 4, 16, None), (6, 2, 18, None), (3, 1, 24, 8)],  # MHA, GQA with head_dim 18, partial rotary
    ids=["mha", "gqa", "partial"],
)
def test_matches_reference(backend, dtype, layout, q_heads, k_heads, head_dim, rotary_dim):
    batch, seq_len = 2, 5
    cos, sin = llama_tables(seq_len + 3, rotary_dim or head_dim)
    cos, sin = (shape_table(t, "seed", layout=layout, batch=batch, seq_len=seq_len) for t in (cos, sin))
    q, k = qk(batch, seq_len, q_heads, k_heads, head_dim, layout=layout, dtype=dtype)
    check(q, k, cos, sin, layout=layout, rotary_dim=rotary_dim)


@pytest.mark.parametrize("pairing", list(PAIRINGS))
@pytest.mark.parametrize("form", ["seed", "hf", "flat"])
@pytest.mark.parametrize("positions", [None, "batch", "shared"])
def test_table_forms_pairing_and_positions(backend, pairing, form, positions):
    batch, seq_len, head_dim, layout = 3, 4, 12, "bhsd" if form == "hf" else "bshd"
    table_len = seq_len if form == "hf" else 11
    cos, sin = llama_tables(table_len, head_dim, interleaved=bool(PAIRINGS[pairing]))
    cos, sin = (shape_table(t, form, layout=layout, batch=batch, seq_len=seq_len) for t in (cos, sin))
    position_ids = {
        None: None,
        "batch": torch.randint(0, table_len, (batch, seq_len)),
        "shared": torch.randperm(table_len)[:seq_len],  # [S], shared by every sequence
    }[positions]
    q, k = qk(batch, seq_len, 4, 2, head_dim, layout=layout, dtype=torch.float32)
    check(q, k, cos, sin, position_ids, layout=layout, **PAIRINGS[pairing])


@pytest.mark.parametrize("pairing", list(PAIRINGS))
def test_half_width_tables_equal_full_tables(backend, pairing):
    """A [T, rotary_dim/2] table (one entry per pair) gives exactly what the duplicated table gives."""
    options = PAIRINGS[pairing]
    q, k = qk(2, 6, 4, 2, 16, layout="bshd", dtype=torch.float32)
    full = llama_tables(6, 8, interleaved=bool(options))
    half = llama_tables(6, 8, half=True)
    out_full = kernels.apply_rotary_pos_emb(q, k, *full, rotary_dim=8, **options)
    out_half = kernels.apply_rotary_pos_emb(q, k, *half, rotary_dim=8, **options)
    for a, b in zip(out_full, out_half):
        torch.testing.assert_close(a, b)
    check(q, k, *half, rotary_dim=8, **options)


def unlike_q(shape, dtype):
    """A random tensor of `shape` whose dims are stored in the order (D, B, H, S) / (D, B, S, H): none of
    its strides equals a contiguous tensor's, so a stride taken from q (or from 1) reads wrong values."""
    storage = torch.randn(shape[3], shape[0], shape[2], shape[1], dtype=dtype)
    return storage.permute(1, 3, 2, 0).requires_grad_()


def per_sequence_tables(batch: int, length: int, dim: int, *, layout: str):
    """cos/sin of arbitrary values, different for every sequence, position and feature: the two halves
    (a and b entries) differ, so a table entry read for the wrong feature, pair or sequence shows. The
    formula is exact for any table; the backward is its transpose. Stored feature-major (feature stride
    T) and handed over as [B, T, D] (bhsd) or [B, T, 1, D] (bshd)."""

    def table():
        t = (2 * torch.rand(batch, dim, length) - 1).transpose(1, 2)
        return t.unsqueeze(2) if layout == "bshd" else t

    return table(), table()


@pytest.mark.parametrize("positions", [None, "batch"])
@pytest.mark.parametrize("table_width", ["full", "half"])
@pytest.mark.parametrize("pairing", list(PAIRINGS))
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_gqa_k_layout_partial_rotary_and_per_sequence_tables(backend, layout, pairing, table_width, positions):
    """Where table and stride bugs hide: k (fewer heads) strided unlike q, partial rotary with a
    pass-through width that is not a power of two (head_dim 18, rotary_dim 8: 10 features pass),
    per-sequence tables whose entries all differ, per-sequence position_ids."""
    batch, seq_len, q_heads, k_heads, head_dim, rotary_dim, table_len = 2, 5, 3, 2, 18, 8, 7
    q, _ = qk(batch, seq_len, q_heads, k_heads, head_dim, layout=layout, dtype=torch.float32)
    k_shape = (batch, seq_len, k_heads, head_dim) if layout == "bshd" else (batch, k_heads, seq_len, head_dim)
    k = unlike_q(k_shape, torch.float32)
    cos, sin = per_sequence_tables(batch, table_len, rotary_dim // (2 if table_width == "half" else 1), layout=layout)
    position_ids = torch.randint(0, table_len, (batch, seq_len)) if positions else None
    grads = [unlike_q(t.shape, t.dtype).detach() for t in (q, k)]  # gradients strided unlike q too
    check(q, k, cos, sin, position_ids, grads=grads, layout=layout, rotary_dim=rotary_dim, **PAIRINGS[pairing])


@pytest.mark.parametrize("pairing", list(PAIRINGS))
@pytest.mark.parametrize("q_heads, k_heads", [(6, 2), (2, 3)])  # grouped-query; more key heads than query heads
@pytest.mark.parametrize("block_h, tokens", [(1, 1), (2, 4), (4, 1), (8, 4)])
def test_every_tiling_of_heads_and_tokens(pairing, q_heads, k_heads, block_h, tokens):
    """The kernel's two paths, forward and backward (the conjugate rotation): tiles of fewer heads than q or k has
    (a loop over tiles of heads) and tiles of all q heads with k's in a tile of its own count (every load before
    the first store), 1 or 4 tokens per program (7 tokens: the last program's are partly masked), strided
    inputs, partial rotary with pass-through features, per-sequence positions."""
    from tridist.kernels.ops import rotary as rotary_ops

    batch, seq_len, head_dim, rotary_dim, table_len = 1, 7, 18, 8, 9
    q, k = (unlike_q((batch, seq_len, heads, head_dim), torch.float32).detach() for heads in (q_heads, k_heads))
    cos, sin = per_sequence_tables(batch, table_len, rotary_dim, layout="bshd")
    positions = torch.randint(0, table_len, (batch, seq_len))
    options = dict(interleaved=False, deinterleave=False) | PAIRINGS[pairing]
    config = {"BLOCK_H": block_h, "TOKENS_PER_PROGRAM": tokens, "num_warps": 1}
    for conjugate in (False, True):
        outs = rotary_ops._rotary(q, k, cos, sin, positions, False, options["interleaved"], options["deinterleave"],
                                  rotary_dim, conjugate, config)
        # Exact: the reference in fp64; the backward (conjugate) rotates gradients: the reference's vector-Jacobian
        # product with q and k as the outputs' gradients (the map is linear: any point will do).
        at = [torch.zeros(t.shape, dtype=torch.float64, requires_grad=True) for t in (q, k)]
        reference = rotary_reference(*(at if conjugate else (q.double(), k.double())), cos.double(), sin.double(),
                                     positions, rotary_dim=rotary_dim, **PAIRINGS[pairing])
        exact = torch.autograd.grad(reference, at, (q.double(), k.double())) if conjugate else reference
        for name, ours, gold, x in zip(("q", "k"), outs, exact, (q, k)):
            # Two fp32 products and a sum per output, |table| <= 1: within 2 u (|x_a c| + |x_b s|) <= 4 u max|x|;
            # twice that for margin.
            bound = 8 * U32 * x.double().abs().amax(-1, keepdim=True)
            assert_rounded_once(ours, gold, bound=bound, name=f"{name} {'backward' if conjugate else 'forward'}")


@pytest.mark.parametrize("q_heads, k_heads", [(4, 4), (32, 8), (6, 2), (64, 16)])
def test_the_plan_loads_every_head_before_storing_wherever_one_tile_holds_them(q_heads, k_heads):
    """The launch plan under the heuristic's configuration (what a GPU without a tuned table runs): where one
    tile of BLOCK_H heads holds every head of q and of k, ONE_HEAD_TILE (q and k loaded before any store:
    tests/test_gpu_codegen.py), and k's tile sized to its own heads (BLOCK_HK: 8 key heads do not take 32 heads'
    registers); above one tile (64 heads of 128 features), the loop over tiles. Both are speed only: every
    tiling computes the same (`test_every_tiling_of_heads_and_tokens`), so only the plan itself shows them."""
    from tridist.kernels.ops import rotary as rotary_ops
    from triton import next_power_of_2

    head_dim = 128
    q, k = torch.empty(2, 8, q_heads, head_dim), torch.empty(2, 8, k_heads, head_dim)
    cos = torch.empty(8, head_dim)
    config = rotary_ops.heuristic_config(head_dim // 2, max(q_heads, k_heads))
    launch = rotary_ops._plan.__wrapped__(
        q.shape, q.stride(), k.shape, k.stride(), q.stride(), k.stride(), cos.shape, cos.stride(), cos.stride(),
        None, None, torch.bfloat16, q.device, False, False, False, head_dim, False, config)
    one_tile = config["BLOCK_H"] >= max(q_heads, k_heads)
    assert one_tile == (q_heads <= 32), config  # 32 heads x 64 pairs fill one tile
    assert launch.kwargs["ONE_HEAD_TILE"] == one_tile, (config, launch.kwargs)
    assert launch.kwargs["BLOCK_HK"] == min(config["BLOCK_H"], next_power_of_2(k_heads)), (config, launch.kwargs)


def test_expanded_gradient_and_partial_rotary(backend):
    """`loss = q_out.sum() + k_out.sum()` hands the backward stride-0 gradients, whose outputs are laid
    out unlike them: the pass-through features too."""
    q, k = qk(2, 3, 2, 1, 18, layout="bshd", dtype=torch.float32)
    cos, sin = per_sequence_tables(2, 3, 8, layout="bshd")
    check(q, k, cos, sin, grads=[torch.randn(()).expand(t.shape) for t in (q, k)], rotary_dim=8)


def test_views_of_a_fused_qkv_projection_need_no_copy(backend):
    """q, k sliced out of one [B, S, H + 2*Hk, D] projection output: strided views, checked as is."""
    batch, seq_len, heads, kv_heads, head_dim = 2, 5, 4, 2, 16
    qkv = torch.randn(batch, seq_len, heads + 2 * kv_heads, head_dim, requires_grad=True)
    q, k = qkv[:, :, :heads], qkv[:, :, heads : heads + kv_heads]
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = llama_tables(seq_len, head_dim)
    out = kernels.apply_rotary_pos_emb(q, k, cos, sin)
    ref = rotary_reference(q, k, cos, sin)
    grads = [torch.randn_like(o).transpose(1, 2).contiguous().transpose(1, 2) for o in out]  # strided grads
    for a, b in zip(torch.autograd.grad(out, qkv, grads), torch.autograd.grad(ref, qkv, grads)):
        torch.testing.assert_close(a, b)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b)


def test_rotation_preserves_norms_and_backward_inverts(backend):
    """Each pair is rotated: norms are kept, and the backward of a rotation is its inverse."""
    q, k = qk(1, 7, 2, 2, 8, layout="bshd", dtype=torch.float32)
    cos, sin = llama_tables(7, 8)
    q_out, k_out = kernels.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(q_out.norm(dim=-1), q.norm(dim=-1))
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (q_out.detach(), k_out.detach()))
    torch.testing.assert_close(dq, q.detach())
    torch.testing.assert_close(dk, k.detach())


def test_no_mutation_and_second_backward(backend):
    q, k = qk(2, 3, 4, 2, 8, layout="bshd", dtype=torch.bfloat16)
    cos, sin = llama_tables(3, 8)
    inputs = [t.detach().clone() for t in (q, k, cos, sin)]
    outs = kernels.apply_rotary_pos_emb(q, k, cos, sin)
    grads = [torch.randn_like(o) for o in outs]
    saved_grads = [g.clone() for g in grads]
    first = torch.autograd.grad(outs, (q, k), grads, retain_graph=True)
    second = torch.autograd.grad(outs, (q, k), grads)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(torch.equal(a, b.detach()) for a, b in zip(inputs, (q, k, cos, sin)))
    assert all(torch.equal(a, b) for a, b in zip(saved_grads, grads))


def test_layer_matches_seed_rotary_embedding(backend):
    """FusedRotaryEmbedding equals the seed model's RotaryEmbedding + apply_rotary_pos_emb."""
    head_dim, seq_len = 16, 9
    layer = kernels.FusedRotaryEmbedding(head_dim, max_position_embeddings=4)  # grows to 9 on demand
    q, k = qk(2, seq_len, 4, 4, head_dim, layout="bshd", dtype=torch.float32)
    cos, sin = llama_tables(seq_len, head_dim)
    position_ids = torch.arange(seq_len).flip(0)[None]
    for pos in (None, position_ids):
        out = layer(q, k, pos)
        ref = rotary_reference(q, k, cos[None, :, None], sin[None, :, None], pos)
        for a, b in zip(out, ref):  # the same fp32 tables: a few fp32 roundings apart (u = 6e-8)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_layer_beyond_its_table_and_after_a_bf16_cast(backend):
    """Positions past max_position_embeddings (decoding) and a model cast to bf16 stay exact."""
    head_dim = 16
    layer = kernels.FusedRotaryEmbedding(head_dim, max_position_embeddings=8).to(torch.bfloat16)
    q, k = qk(1, 3, 2, 2, head_dim, layout="bshd", dtype=torch.float32)
    position_ids = torch.tensor([[4000, 4001, 4002]])
    cos, sin = llama_tables(4003, head_dim)
    out = layer(q, k, position_ids)
    ref = rotary_reference(q, k, cos, sin, position_ids)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-4)  # fp32 sin/cos of angles ~4000 rad
    long_q, long_k = qk(1, 20, 2, 2, head_dim, layout="bshd", dtype=torch.float32)  # grows the table
    out = layer(long_q, long_k)
    cos, sin = llama_tables(20, head_dim)
    for a, b in zip(out, rotary_reference(long_q, long_k, cos, sin)):  # a few fp32 roundings apart
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_tables_with_different_strides(backend):
    """cos contiguous and sin a transposed copy: one set of table strides serves both in the kernel, so the
    launcher copies them (the rare case of tables built apart). Strides of size-1 dims differ freely (torch's
    contiguous() keeps them): a [1, T, D] view of a [T, 1, D] table, and one with stride 0 on its batch."""
    cos, sin = llama_tables(6, 8)
    q, k = qk(2, 5, 4, 2, 8, layout="bshd", dtype=torch.float32)
    check(q, k, cos, sin.t().contiguous().t())
    check(q, k, cos[None], sin[:, None].transpose(0, 1))
    check(q, k, cos[None], sin.as_strided((1, 6, 8), (0, 8, 1)))


def test_empty_batch(backend):
    q, k = qk(0, 4, 2, 2, 8, layout="bshd", dtype=torch.float32)
    check(q, k, *llama_tables(4, 8))


def _errors_cases():
    q, k = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    cos, sin = llama_tables(5, 8)
    odd_q = torch.randn(2, 5, 4, 7)
    return [
        (dict(q=odd_q, k=odd_q, cos=torch.ones(5, 7), sin=torch.ones(5, 7)), "head_dim = 7 must be even"),
        (dict(q=q, k=k, cos=cos[:3], sin=sin[:3]), "cos/sin have 3 positions but the sequence has 5"),
        (dict(q=q, k=k, cos=cos, sin=sin, position_ids=torch.full((2, 5), 5)), r"position_ids must lie in \[0, 5\)"),
        (dict(q=q, k=k, cos=cos, sin=sin, position_ids=torch.zeros(3, 5, dtype=torch.long)), "position_ids must be"),
        (dict(q=q, k=k, cos=cos, sin=sin, position_ids=torch.zeros(2, 5)), "integer tensor"),
        (dict(q=q, k=k.double(), cos=cos, sin=sin), "float64"),
        (dict(q=q, k=k.half(), cos=cos, sin=sin), "one dtype"),
        (dict(q=q, k=torch.randn(2, 6, 2, 8), cos=cos, sin=sin), "must agree on batch, sequence and head_dim"),
        (dict(q=q, k=k, cos=cos.to("meta"), sin=sin.to("meta")), "one device"),
        (dict(q=q, k=k, cos=cos, sin=sin, layout="sbhd"), "layout must be one of"),
        (dict(q=q, k=k, cos=cos[None, None], sin=sin[None, None]), r"4-D cos/sin must be \[1 or B, T, 1, D\]"),
        (dict(q=q, k=k, cos=torch.ones(5, 6), sin=torch.ones(5, 6), rotary_dim=8), "cos/sin last dim is 6"),
        (dict(q=q, k=k, cos=cos, sin=sin[:4]), "must have the same shape"),
        (dict(q=q, k=k, cos=cos.clone().requires_grad_(), sin=sin), "detach"),
        (dict(q=q, k=k, cos=cos, sin=sin, rotary_dim=10), "rotary_dim = 10 must be even, positive and <= head_dim"),
        (dict(q=q, k=k, cos=cos, sin=sin, deinterleave=True), "needs interleaved=True"),
    ]


@pytest.mark.parametrize("kwargs, message", _errors_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_input_errors(kwargs, message):
    kwargs = dict(kwargs)
    args = [kwargs.pop(name) for name in ("q", "k", "cos", "sin")]
    with pytest.raises((ValueError, TypeError), match=message):
        kernels.apply_rotary_pos_emb(*args, **kwargs)


def test_deinterleave_is_deepseeks_rotary(backend):
    """`interleaved=True, deinterleave=True` computes transformers' DeepSeek-V3 `apply_rotary_pos_emb_interleave`
    (written out here as transformers 5 writes it: pairs (2j, 2j + 1) by the [freqs | freqs] table's entry j,
    results as halves), forward and backward. Both compute each output as two fp32 products and a sum, each
    within 2 u (|x_a| + |x_b|) of exact (|table| <= 1): 4 u * 2 max|x| apart at most."""

    def deepseek_rotary(q, k, cos, sin, unsqueeze_dim=1):
        cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
        sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
        q1, q2, k1, k2 = q[..., 0::2], q[..., 1::2], k[..., 0::2], k[..., 1::2]
        return (torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1),
                torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1))

    q, k = qk(2, 5, 4, 1, 8, layout="bhsd", dtype=torch.float32)
    cos, sin = (t[torch.arange(5).flip(0)].expand(2, 5, 8) for t in llama_tables(5, 8))  # [B, S, D] per position
    out = kernels.apply_rotary_pos_emb(q, k, cos[..., :4], sin[..., :4], layout="bhsd", interleaved=True,
                                       deinterleave=True, rotary_dim=8)
    expected = deepseek_rotary(q, k, cos, sin)
    grads = [torch.randn_like(o) for o in out]
    ours = out + torch.autograd.grad(out, (q, k), grads)
    for a, b, x in zip(ours, expected + torch.autograd.grad(expected, (q, k), grads), (q, k, *grads)):
        torch.testing.assert_close(a, b, atol=8 * U32 * x.detach().abs().max().item(), rtol=0)


def test_table_values_are_the_seed_formula():
    """Our test tables match the seed's RotaryEmbedding construction (guards the test itself)."""
    cos, _ = llama_tables(3, 4)
    expected = math.cos(2 * 1.0 / (10000 ** (2 / 4)))  # position 2, second frequency; fp32 within a few u
    assert cos[2, 1].item() == pytest.approx(expected, rel=1e-6)
    assert cos[2, 3].item() == pytest.approx(expected, rel=1e-6)
