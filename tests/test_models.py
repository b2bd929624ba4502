"""Reference models in bench/models: shapes, loss definitions, causality, GQA, determinism, data."""

import math

import pytest
import torch
import torch.nn.functional as F

from tridist.bench.models import MODELS, build_model, make_seed_dataloader, tiny_hf_config, tiny_seed_config
from tridist.bench.models import hf_llama, seed_llama

BATCH, SEQ = 2, 16


def _tokens(vocab: int, *, seed: int = 0, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_backward_gives_finite_loss_and_grads(name):
    torch.manual_seed(0)
    model = build_model(name)
    vocab = model.config.vocab_size
    ids = _tokens(vocab)
    loss, logits = model(ids, labels=_tokens(vocab, seed=1))
    assert logits.shape == (BATCH, SEQ, vocab)
    assert loss.dim() == 0 and torch.isfinite(loss)
    # Random init over a small vocab: loss near log(vocab), not 0 or huge.
    assert abs(loss.item() - math.log(vocab)) < 1.5
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_seed_loss_is_masked_mean_of_per_token_ce():
    torch.manual_seed(0)
    model = seed_llama.Model(tiny_seed_config())
    ids = _tokens(128)
    labels = _tokens(128, seed=1)
    labels[0, :5] = -100  # ignored tokens must not count in the denominator
    loss, logits = model(ids, labels=labels)

    per_token = F.cross_entropy(logits.float().permute(0, 2, 1), labels, reduction="none", ignore_index=-100)
    keep = labels != -100
    expected = per_token[keep].sum() / keep.sum()
    torch.testing.assert_close(loss, expected)
    # Sanity check of the reference itself: the plain mean (dividing by all tokens) differs.
    assert not torch.isclose(loss, per_token.mean())


def test_seed_loss_all_ignored_is_zero_not_nan():
    torch.manual_seed(0)
    model = seed_llama.Model(tiny_seed_config())
    labels = torch.full((BATCH, SEQ), -100)
    loss, _ = model(_tokens(128), labels=labels)
    assert loss.item() == 0.0


def test_hf_loss_is_shifted_mean_ce():
    torch.manual_seed(0)
    model = hf_llama.LlamaForCausalLM(tiny_hf_config())
    ids = _tokens(128)
    loss, logits = model(ids, labels=ids)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 128).float(), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected)
    no_loss, _ = model(ids)
    assert no_loss is None


@pytest.mark.parametrize("name", sorted(MODELS))
def test_attention_is_causal(name):
    torch.manual_seed(0)
    model = build_model(name).eval()
    ids = _tokens(model.config.vocab_size)
    changed = ids.clone()
    t = 10
    changed[:, t] = (ids[:, t] + 1) % model.config.vocab_size
    with torch.no_grad():
        _, before = model(ids)
        _, after = model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t])
    assert not torch.allclose(after[:, t:], before[:, t:])


def test_seed_padding_mask_hides_masked_keys():
    torch.manual_seed(0)
    model = seed_llama.Model(tiny_seed_config()).eval()
    ids = _tokens(128)
    changed = ids.clone()
    changed[:, 3] = (ids[:, 3] + 1) % 128
    mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
    mask[:, 3] = False
    with torch.no_grad():
        _, before = model(ids, attention_mask=mask)
        _, after = model(changed, attention_mask=mask)
    # Position 3 is masked as a key, so no other position can see the changed token.
    keep = [i for i in range(SEQ) if i != 3]
    torch.testing.assert_close(after[:, keep], before[:, keep])


def test_hf_grouped_query_attention():
    cfg = tiny_hf_config()
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    torch.manual_seed(0)
    model = hf_llama.LlamaForCausalLM(cfg)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.out_features == cfg.num_key_value_heads * cfg.head_dim
    assert attn.num_key_value_groups == 2
    loss, logits = model(_tokens(128), labels=_tokens(128))
    assert torch.isfinite(loss) and logits.shape == (BATCH, SEQ, 128)

    # GQA equals MHA whose k/v weights repeat each kv head for its group of query heads.
    x = torch.randn(BATCH, SEQ, cfg.hidden_size)
    pos = torch.arange(SEQ)[None]
    rope = model.model.rotary_emb(x, pos)
    mha_cfg = tiny_hf_config(num_key_value_heads=cfg.num_attention_heads)
    mha = hf_llama.LlamaAttention(mha_cfg)
    with torch.no_grad():
        for proj in ("q_proj", "o_proj"):
            getattr(mha, proj).weight.copy_(getattr(attn, proj).weight)
        for proj in ("k_proj", "v_proj"):
            w = getattr(attn, proj).weight.view(cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size)
            getattr(mha, proj).weight.copy_(w.repeat_interleave(2, dim=0).reshape(-1, cfg.hidden_size))
        torch.testing.assert_close(mha(x, rope), attn(x, rope))


def _rope_seed(q, k, position_ids):
    """seed_llama rotary on bshd [1, S, 1, D] inputs, tables cached longer than S."""
    rope = seed_llama.RotaryEmbedding(q.shape[-1], max_position_embeddings=32)
    cos, sin = rope(q, seq_len=q.shape[1])
    return seed_llama.apply_rotary_pos_emb(q, k, cos, sin, position_ids)


def _rope_hf(q, k, position_ids):
    """hf_llama rotary on the same data transposed to bhsd [1, 1, S, D]."""
    rope = hf_llama.LlamaRotaryEmbedding(tiny_hf_config(head_dim=q.shape[-1]))
    cos, sin = rope(q, position_ids)
    q_rot, k_rot = hf_llama.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q_rot.transpose(1, 2), k_rot.transpose(1, 2)


@pytest.mark.parametrize("rope", [_rope_seed, _rope_hf], ids=["seed", "hf"])
def test_rotary_is_a_relative_position_rotation(rope):
    """RoPE rotates each vector (norm kept) so that <q_i, k_j> depends only on p_i - p_j."""
    torch.manual_seed(0)
    d = 16
    q = torch.randn(d).expand(1, SEQ, 1, d)  # the same q and k at every position
    k = torch.randn(d).expand(1, SEQ, 1, d)
    positions = torch.arange(SEQ).flip(0)[None]  # explicit, non-default positions
    q_rot, k_rot = rope(q, k, positions)
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm(dim=-1))
    scores = q_rot[0, :, 0] @ k_rot[0, :, 0].T  # [S, S]
    torch.testing.assert_close(scores[1:, 1:], scores[:-1, :-1])  # constant along diagonals
    assert not torch.allclose(scores[0, 0], scores[0, 1])


def test_seed_and_hf_rotary_agree():
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, SEQ, 4, 16).unbind(0)
    positions = torch.arange(SEQ)[None]
    for got, want in zip(_rope_seed(q, k, positions), _rope_hf(q, k, positions)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_same_seed_gives_identical_parameters(name):
    torch.manual_seed(123)
    a = build_model(name)
    torch.manual_seed(123)
    b = build_model(name)
    torch.manual_seed(124)
    c = build_model(name)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # Every randomly initialised weight differs under another seed (norm weights are all-ones).
    random_keys = [k for k in sa if "norm" not in k]
    assert random_keys and not any(torch.equal(sa[k], sc[k]) for k in random_keys)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_explicit_arange_position_ids_match_default(name):
    torch.manual_seed(0)
    model = build_model(name).eval()
    ids = _tokens(model.config.vocab_size)
    with torch.no_grad():
        _, default = model(ids)
        _, explicit = model(ids, position_ids=torch.arange(SEQ).expand(BATCH, SEQ))
        _, shifted = model(ids, position_ids=torch.arange(SEQ).flip(0).expand(BATCH, SEQ))
    torch.testing.assert_close(explicit, default)
    assert not torch.allclose(shifted, default)  # positions really reach the rotary embedding


def test_seed_config_and_module_structure():
    cfg = seed_llama.SeedLlamaConfig()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (8000, 2048, 4096)
    assert (cfg.num_attention_heads, cfg.num_hidden_layers, cfg.max_position_embeddings) == (32, 4, 1024)
    assert cfg.rms_norm_eps == 1.0
    model = seed_llama.Model(tiny_seed_config())
    tiny = model.config
    assert model.weight.shape == (tiny.hidden_size, tiny.vocab_size)
    layer = model.layers[0]
    assert layer.mlp.gate_proj.out_features == 176  # sizes passed down, not module defaults
    assert layer.input_layernorm.variance_epsilon == 1.0
    assert layer.self_attn.rotary_emb.cos_cached.shape == (1, 32, 1, tiny.head_dim)
    assert "layers.0.self_attn.rotary_emb.cos_cached" not in model.state_dict()


def test_rmsnorm_dtype_semantics_differ_as_in_sources():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    seed_norm = seed_llama.RMSNorm(8, eps=1.0)
    hf_norm = hf_llama.LlamaRMSNorm(8, eps=1e-6)
    assert seed_norm(x).dtype == torch.float32  # fp32 weight: no cast back
    assert hf_norm(x).dtype == torch.float32  # bf16 input * fp32 weight promotes
    xf = x.float()
    torch.testing.assert_close(seed_norm(xf), xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1.0))


def test_seed_dataloader_yields_in_order_batches():
    loader = make_seed_dataloader(batch_size=4, batch_num=3, seq_length=16, vocab_high=100, seed=0)
    batches = list(loader)
    assert len(batches) == 3
    dataset = loader.dataset
    for i, (inputs, labels) in enumerate(batches):
        assert inputs.shape == labels.shape == (4, 16)
        assert inputs.dtype == labels.dtype == torch.int64
        assert 0 <= inputs.min() and inputs.max() < 100
        torch.testing.assert_close(inputs, dataset.inputs[4 * i : 4 * i + 4])  # sequential, no shuffle
        torch.testing.assert_close(labels, dataset.labels[4 * i : 4 * i + 4])
    again = next(iter(make_seed_dataloader(batch_size=4, batch_num=3, seq_length=16, vocab_high=100, seed=0)))
    torch.testing.assert_close(again[0], batches[0][0])
    assert not torch.equal(batches[0][0], batches[0][1])  # inputs and labels are independent draws


def test_seed_training_loop_reduces_loss():
    torch.manual_seed(0)
    model = seed_llama.Model(tiny_seed_config())
    loader = make_seed_dataloader(batch_size=2, batch_num=1, seq_length=16, vocab_high=128)
    losses = seed_llama.train_seed_example(model, loader, epochs=5, learning_rate=0.1)
    assert len(losses) == 5
    assert losses[-1] < losses[0]


def test_build_model_errors_name_known_models_and_sizes():
    with pytest.raises(ValueError, match="seed-llama") as err:
        build_model("gpt2")
    assert "hf-llama" in str(err.value)
    with pytest.raises(ValueError, match="tiny"):
        build_model("hf-llama", size="huge")


def test_build_model_overrides_and_seed_size_config():
    model = build_model("hf-llama", num_hidden_layers=1, tie_word_embeddings=True)
    assert len(model.model.layers) == 1
    assert model.lm_head.weight is model.model.embed_tokens.weight
    seed_cfg = MODELS["seed-llama"].configs["seed"]()
    assert seed_cfg.hidden_size == 2048 and seed_cfg.rms_norm_eps == 1.0
    hf_seed_cfg = MODELS["hf-llama"].configs["seed"]()
    assert (hf_seed_cfg.hidden_size, hf_seed_cfg.head_dim, hf_seed_cfg.num_key_value_heads) == (2048, 64, 32)
