"""The draft-model ops (``rope``, ``where``): eager against transformers, TensorRT lowering against eager.

Same pattern as tests/test_trt_ops.py: record a tiny network with dynamic dims through
``builder.functional`` on symbolic tensors, evaluate it with the CPU interpreter at several shapes,
and compare with the same op on torch tensors.
"""
from __future__ import annotations

import pytest
import torch
from network_checks import F32, HALF, check, gen, randn

from builder import functional as F
from builder.rope_frequencies import rope_inv_freq

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 4.0}
SCALINGS = {"default": None, "linear": LINEAR, "llama3": LLAMA3}


def _positions(batch, seq, dtype=torch.int32, seed=0, high=20000):
    start = torch.randint(0, high, (batch, 1), generator=gen(seed))
    return (start + torch.arange(seq)).to(dtype)


# --- rope ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_rope_matches_transformers(scaling):
    """Full rotation equals transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb (fp32)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    params = {"rope_type": "default", "rope_theta": 500000.0, **(SCALINGS[scaling] or {})}
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=131072,
                         rope_parameters=params)
    q, k = randn(2, 5, 4, 16, seed=1), randn(2, 5, 2, 16, seed=2)
    pos = _positions(2, 5, torch.int64, seed=3)
    cos, sin = LlamaRotaryEmbedding(config)(q, pos)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    torch.testing.assert_close(F.rope(q, pos.int(), 500000.0, None, SCALINGS[scaling]), want_q.transpose(1, 2),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(F.rope(k, pos, 500000.0, None, SCALINGS[scaling]), want_k.transpose(1, 2),
                               rtol=1e-5, atol=1e-5)


def test_rope_partial_rotary_passes_the_tail_through():
    x, pos = randn(1, 3, 2, 12, seed=1), _positions(1, 3, seed=2)
    y = F.rope(x, pos, 10000.0, 8)
    torch.testing.assert_close(y[..., 8:], x[..., 8:])
    torch.testing.assert_close(y[..., :8], F.rope(x[..., :8].contiguous(), pos, 10000.0))
    # position 0 is the identity rotation
    torch.testing.assert_close(F.rope(x, torch.zeros(1, 3, dtype=torch.int32), 10000.0), x)


def test_rope_inv_freq_llama3_bands():
    """llama3 scaling: high frequencies kept, low ones divided by factor, the band between blended."""
    base = rope_inv_freq(500000.0, 128)
    scaled = rope_inv_freq(500000.0, 128, {**LLAMA3, "original_max_position_embeddings": 8192})
    wavelen = 2 * torch.pi / base
    assert torch.equal(scaled[wavelen < 8192 / 4], base[wavelen < 8192 / 4])
    torch.testing.assert_close(scaled[wavelen > 8192], base[wavelen > 8192] / 8)
    middle = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert middle.any() and ((scaled[middle] < base[middle]) & (scaled[middle] > base[middle] / 8)).all()


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])   # yarn is supported (tests/test_nemotron35_drafts.py)
def test_rope_rejects_unsupported_scaling(kind):
    with pytest.raises(ValueError, match=f"unsupported rope_scaling type '{kind}'"):
        F.rope(randn(1, 1, 1, 8), torch.zeros(1, 1, dtype=torch.int32), 10000.0, None, {"rope_type": kind, "factor": 2.0})


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_rope(scaling, rotary_dim):
    rec = check(lambda x, p: F.rope(x, p, 10000.0, rotary_dim, SCALINGS[scaling]),
                [("x", torch.float32, (-1, -1, 3, 16)), ("p", torch.int32, (-1, -1))],
                [[randn(bt, t, 3, 16, seed=t), _positions(bt, t, seed=bt)] for bt, t in [(1, 1), (3, 7)]])
    assert "rotate_half" in rec.lowerings["rope"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_half(dtype):
    check(lambda x, p: F.rope(x, p, 10000.0, None, LLAMA3),
          [("x", dtype, (-1, -1, 2, 8)), ("p", torch.int64, (-1, -1))],
          [[randn(bt, t, 2, 8, seed=t, dtype=dtype), _positions(bt, t, torch.int64, seed=bt, high=500)]
           for bt, t in [(1, 1), (2, 5)]], HALF[dtype])


# --- where ---------------------------------------------------------------------------------------------
def test_where_int_condition_broadcast():
    check(lambda c, a, b: F.where(F.reshape(c, [0, 0, 1]), a, b),
          [("c", torch.int32, (-1, -1)), ("a", torch.float32, (-1, -1, 4)), ("b", torch.float32, (-1, -1, 4))],
          [[torch.randint(0, 3, (bt, t), generator=gen(t), dtype=torch.int32), randn(bt, t, 4, seed=1),
            randn(bt, t, 4, seed=2)] for bt, t in [(1, 1), (3, 5)]])


def test_where_bool_condition_scalars_and_promotion():
    w = randn(4, seed=3)

    def fn(c, a):
        return F.where(c, a, 0.5), F.where(c, -1.0, a), F.where(c, a, w)
    check(fn, [("c", torch.bool, (-1, 4)), ("a", torch.bfloat16, (-1, 4))],
          [[torch.rand(t, 4, generator=gen(t)) > 0.5, randn(t, 4, seed=t, dtype=torch.bfloat16)] for t in (1, 6)], F32)
