"""The TensorRT lowering of every op computes what the eager op computes.

Each test records a tiny network with dynamic dims through ``builder.functional`` on symbolic
tensors, evaluates it with the CPU interpreter at two or more shapes, and compares with the same
functional op on torch tensors (the spec). No GPU needed. The recorder, engine builds and the whole
target's network: test_trt_network.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as tf

from builder import functional as F
from builder.backends.trt_backend import NetworkRecorder
from builder.backends.trt_import import FLAVOUR, HAS_PLUGIN_LAYERS, VERSION, trt
from builder.interpreter import run_network
from network_checks import F32, HALF, check, gen, lengths_for, randn

SHAPES = [(1, 1), (3, 13)]


# --- import -----------------------------------------------------------------------------------------
def test_trt_import():
    assert FLAVOUR in ("tensorrt", "tensorrt_rtx")
    assert trt.__name__ == FLAVOUR and VERSION
    assert HAS_PLUGIN_LAYERS == hasattr(trt.INetworkDefinition, "add_plugin_v3")


def test_backend_mirrors_torch_backend_signatures():
    import inspect

    from builder.backends import torch_backend, torch_tree, trt_backend, trt_tree
    ops = [n for n, f in vars(F).items() if callable(f) and getattr(f, "__module__", "") == F.__name__
           and not n.startswith("_")]
    assert len(ops) >= 18
    for name in ops:
        tree = name.startswith("tree_") or name == "masked_attention"     # lowered by the tree backends
        eager, symbolic = (torch_tree, trt_tree) if tree else (torch_backend, trt_backend)
        assert inspect.signature(getattr(symbolic, name)) == inspect.signature(getattr(eager, name)), name


# --- dense algebra -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
def test_linear(bias):
    w, b = randn(6, 8, seed=1), (randn(6, seed=2) if bias else None)
    rec = check(lambda x: F.linear(x, w, b), [("x", torch.float32, (-1, -1, 8))],
                [[randn(bt, t, 8, seed=3)] for bt, t in SHAPES])
    assert "matmul" in rec.lowerings["linear"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_half(dtype):
    w, b = randn(6, 8, seed=1, dtype=dtype), randn(6, seed=2, dtype=dtype)
    check(lambda x: F.linear(x, w, b), [("x", dtype, (-1, -1, 8))],
          [[randn(bt, t, 8, seed=3, dtype=dtype)] for bt, t in SHAPES], HALF[dtype])


def test_embedding():
    table = randn(11, 5, seed=1)
    check(lambda ids: F.embedding(ids, table), [("ids", torch.int32, (-1, -1))],
          [[torch.randint(0, 11, (bt, t), generator=gen(bt), dtype=torch.int32)] for bt, t in SHAPES])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm(dtype):
    w = randn(8, seed=1, dtype=dtype)
    check(lambda x: F.rms_norm(x, w, 1e-5), [("x", dtype, (-1, -1, 8))],
          [[randn(bt, t, 8, seed=2, dtype=dtype, scale=3.0)] for bt, t in SHAPES], HALF.get(dtype, F32))


def test_gated_rms_norm():
    w = randn(8, seed=1)
    check(lambda x, g: F.gated_rms_norm(x, g, w, 1e-5, 4),
          [("x", torch.float32, (-1, -1, 8)), ("g", torch.float32, (-1, -1, 8))],
          [[randn(bt, t, 8, seed=2), randn(bt, t, 8, seed=3)] for bt, t in SHAPES])


@pytest.mark.parametrize("name", ["relu2", "relu", "silu", "gelu", "softplus", "sigmoid"])
def test_activation(name):
    def data(bt, t):
        x = randn(bt, t, 9, seed=4, scale=4.0)
        x[0, 0, :4] = torch.tensor([-40.0, -19.5, 20.5, 60.0])  # softplus threshold and tails
        return [x]
    check(lambda x: F.activation(x, name), [("x", torch.float32, (-1, -1, 9))], [data(bt, t) for bt, t in SHAPES])


@pytest.mark.parametrize("name", ["silu", "softplus", "gelu"])
def test_activation_bf16(name):
    check(lambda x: F.activation(x, name), [("x", torch.bfloat16, (-1, -1, 9))],
          [[randn(bt, t, 9, seed=4, scale=4.0, dtype=torch.bfloat16)] for bt, t in SHAPES], HALF[torch.bfloat16])


@pytest.mark.parametrize("lo,hi", [(0.0, float("inf")), (-0.5, 0.25), (float("-inf"), float("inf")), (None, 1.0)])
def test_clamp(lo, hi):
    rec = check(lambda x: F.clamp(x, lo, hi), [("x", torch.float32, (-1, -1, 4))],
                [[randn(bt, t, 4, seed=5)] for bt, t in SHAPES])
    kinds = {rec.network.get_layer(i).type for i in range(rec.network.num_layers)}
    expected = (lo not in (None, float("-inf"))) + (hi not in (None, float("inf")))
    assert (trt.LayerType.ELEMENTWISE in kinds) == bool(expected)


def test_to_float32():
    check(lambda x: F.to_float32(x), [("x", torch.bfloat16, (-1, -1, 4))],
          [[randn(bt, t, 4, seed=5, dtype=torch.bfloat16)] for bt, t in SHAPES])


# --- shapes ------------------------------------------------------------------------------------------
def test_split_concat_reshape_permute():
    bias = randn(2, seed=9)

    def fn(x):
        a, b, c = F.split(x, [3, 2, 7], -1)
        d = F.concat([c, a, b + bias], dim=-1)
        e = F.reshape(d, [0, 0, 3, -1])
        return a, b, c, d, e, F.permute(e, [0, 2, 1, 3]), F.split(e, [1, 2], dim=2)[1]
    check(fn, [("x", torch.float32, (-1, -1, 12))], [[randn(bt, t, 12, seed=6)] for bt, t in SHAPES])


def test_concat_time_axis():
    check(lambda a, b: F.concat([a, b], dim=1),
          [("a", torch.float32, (-1, 3, 4)), ("b", torch.float32, (-1, -1, 4))],
          [[randn(bt, 3, 4, seed=1), randn(bt, t, 4, seed=2)] for bt, t in SHAPES])


def test_gather_rows():
    cases = []
    for bt, t, g in [(1, 1, 1), (3, 13, 4)]:
        cases.append([randn(bt, t, 2, 3, seed=7), torch.randint(0, t, (bt, g), generator=gen(g), dtype=torch.int32)])
    check(lambda x, i: F.gather_rows(x, i), [("x", torch.float32, (-1, -1, 2, 3)), ("i", torch.int32, (-1, -1))],
          cases)


@pytest.mark.parametrize("rank", [3, 4])
def test_mask_padding(rank):
    tail = (4,) if rank == 3 else (2, 3)
    check(lambda x, n: F.mask_padding(x, n), [("x", torch.float32, (-1, -1) + tail), ("n", torch.int32, (-1,))],
          [[randn(bt, t, *tail, seed=8), lengths_for(bt, t, seed=t)] for bt, t in SHAPES])


def test_operators():
    w = randn(4, seed=3)

    def fn(x, y):
        return (x + y, x - w, w - x, x * 2.0, 3.0 * y, x / (y * y + 1.0), 1.0 / (x * x + 2.0), -x, 2 - x + w * y)
    check(fn, [("x", torch.float32, (-1, -1, 4)), ("y", torch.float32, (-1, 4))],
          [[randn(bt, t, 4, seed=1), randn(t, 4, seed=2)] for bt, t in SHAPES])


def test_operator_promotion():
    w = randn(4, seed=3)  # fp32 weight + bf16 activation -> fp32, as torch promotes

    def fn(x):
        return x + w, x * 0.5
    rec = check(fn, [("x", torch.bfloat16, (-1, 4))], [[randn(t, 4, seed=1, dtype=torch.bfloat16)] for t in (1, 5)])
    kinds = [rec.network.get_layer(i).type for i in range(rec.network.num_layers)]
    assert trt.LayerType.CAST in kinds


@pytest.mark.parametrize("limits", [(0.0, float("inf")), (1e-3, 0.1)])
def test_mamba_dt(limits):
    bias = randn(4, seed=2)

    def cases():
        out = []
        for bt, t in SHAPES:
            dt = 4 * randn(bt, t, 4, seed=1)
            dt[0, 0] = torch.tensor([-40.0, -19.5, 20.5, 60.0])   # softplus's threshold and tails
            out.append([dt, lengths_for(bt, t, seed=t)])
        return out
    check(lambda x, n: F.mamba_dt(x, bias, *limits, n), [("x", torch.float32, (-1, -1, 4)), ("n", torch.int32, (-1,))],
          cases())


# --- sequence mixers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bias,act", [(False, None), (True, None), (True, "silu")])
def test_causal_conv1d(bias, act):
    C, K = 6, 4
    w, b = randn(C, K, seed=1), (randn(C, seed=2) if bias else None)
    cases = [[randn(bt, t, C, seed=3), randn(bt, K - 1, C, seed=4), lengths_for(bt, t, seed=5)]
             for bt, t in SHAPES + [(2, 2)]]
    check(lambda x, s, n: F.causal_conv1d(x, s, w, b, n, act),
          [("x", torch.float32, (-1, -1, C)), ("s", torch.float32, (-1, K - 1, C)), ("n", torch.int32, (-1,))],
          cases)


def test_causal_conv1d_bf16():
    C, K = 6, 4
    w, b = randn(C, K, seed=1, dtype=torch.bfloat16), randn(C, seed=2, dtype=torch.bfloat16)
    cases = [[randn(bt, t, C, seed=3, dtype=torch.bfloat16), randn(bt, K - 1, C, seed=4, dtype=torch.bfloat16),
              lengths_for(bt, t, seed=5)] for bt, t in SHAPES]
    check(lambda x, s, n: F.causal_conv1d(x, s, w, b, n),
          [("x", torch.bfloat16, (-1, -1, C)), ("s", torch.bfloat16, (-1, K - 1, C)), ("n", torch.int32, (-1,))],
          cases, HALF[torch.bfloat16])


def test_conv_window_is_the_state_after_the_first_rows():
    """conv_window(state, chunk, n) = the conv state causal_conv1d leaves after the chunk's first n
    rows (the rollback of a verify chunk to an accepted length); interpreted == eager."""
    C, K = 6, 4
    w = randn(C, K, seed=1)
    x, s = randn(2, 5, C, seed=3), randn(2, K - 1, C, seed=4)
    for n in ([5, 5], [1, 3], [4, 2]):
        n = torch.tensor(n, dtype=torch.int32)
        for b in range(2):
            want = F.causal_conv1d(x[b:b + 1, :int(n[b])], s[b:b + 1], w, None, n[b:b + 1])[1]
            assert torch.equal(F.conv_window(s, x, n)[b:b + 1], want)  # pure data movement: exact
    check(lambda s, x, n: F.conv_window(s, x, n),
          [("s", torch.float32, (-1, K - 1, C)), ("x", torch.float32, (-1, -1, C)), ("n", torch.int32, (-1,))],
          [[randn(bt, K - 1, C, seed=4), randn(bt, t, C, seed=3), lengths_for(bt, t, seed=5)] for bt, t in SHAPES])


def _ssm_case(batch, seq, H=4, P=3, G=2, N=5, seed=0, dtype=torch.float32):
    x = randn(batch, seq, H, P, seed=seed, dtype=dtype)
    dt = tf.softplus(randn(batch, seq, H, seed=seed + 1) - 0.5)
    lengths = lengths_for(batch, seq, seed=seed + 2)
    dt = F.mask_padding(dt, lengths).to(dtype)  # 0 at padding: the state must not move there
    B, C = randn(batch, seq, G, N, seed=seed + 3, dtype=dtype), randn(batch, seq, G, N, seed=seed + 4, dtype=dtype)
    state = randn(batch, H, P, N, seed=seed + 5)
    return [x, dt, B, C, state]


def _ssm_specs(H=4, P=3, G=2, N=5, dtype=torch.float32):
    return [("x", dtype, (-1, -1, H, P)), ("dt", dtype, (-1, -1, H)), ("B", dtype, (-1, -1, G, N)),
            ("C", dtype, (-1, -1, G, N)), ("state", torch.float32, (-1, H, P, N))]


A_LOG = torch.tensor([0.1, -0.7, 0.5, -0.2])
D_SKIP = torch.tensor([1.0, 0.5, -0.3, 0.0])


def test_ssm_scan():
    A = -torch.exp(A_LOG)
    shapes = [(1, 1), (3, 13), (2, 8), (2, 4), (3, 3)]  # (3, 3): shorter than the chunk (eager: one chunk)
    rec = check(lambda x, dt, B, C, s: F.ssm_scan(x, dt, A, B, C, D_SKIP, s, 4), _ssm_specs(),
                [_ssm_case(bt, t, seed=bt * 10 + t) for bt, t in shapes], dict(rtol=2e-5, atol=2e-5))
    kinds = {rec.network.get_layer(i).type for i in range(rec.network.num_layers)}
    assert trt.LayerType.LOOP_OUTPUT not in kinds and trt.LayerType.CUMULATIVE in kinds
    assert "chunked SSD" in rec.lowerings["ssm_scan"]


def test_ssm_state():
    A = -torch.exp(A_LOG)
    specs = [s for s in _ssm_specs() if s[0] != "C"]
    rec = check(lambda x, dt, B, s: F.ssm_state(x, dt, A, B, s), specs,
                [[v for i, v in enumerate(_ssm_case(bt, t, seed=bt * 10 + t)) if i != 3]
                 for bt, t in [(1, 1), (3, 5), (2, 13)]], dict(rtol=2e-5, atol=2e-5))
    kinds = {rec.network.get_layer(i).type for i in range(rec.network.num_layers)}
    assert trt.LayerType.LOOP_OUTPUT not in kinds


def test_ssm_scan_without_cumulative_layer():
    """TensorRT versions without ICumulativeLayer get cumulative sums as triangular matmuls."""
    A = -torch.exp(A_LOG)
    rec = NetworkRecorder()
    rec.has_cumulative = False
    rec = check(lambda x, dt, B, C, s: F.ssm_scan(x, dt, A, B, C, D_SKIP, s, 4), _ssm_specs(),
                [_ssm_case(bt, t, seed=bt * 10 + t) for bt, t in [(1, 1), (3, 13)]], dict(rtol=2e-5, atol=2e-5),
                rec=rec)
    kinds = {rec.network.get_layer(i).type for i in range(rec.network.num_layers)}
    assert trt.LayerType.CUMULATIVE not in kinds


def test_static_shapes():
    """Networks whose dims are all known at build time take the constant-folded paths."""
    A = -torch.exp(A_LOG)
    case = _ssm_case(2, 6, seed=7)
    specs = [(n, d, tuple(v.shape)) for (n, d, _), v in zip(_ssm_specs(), case)]
    check(lambda x, dt, B, C, s: F.ssm_scan(x, dt, A, B, C, D_SKIP, s, 4), specs, [case],
          dict(rtol=2e-5, atol=2e-5))
    check(lambda x, dt, B, s: F.ssm_state(x, dt, A, B, s), specs[:2] + specs[3:4] + specs[4:5],
          [case[:2] + case[2:3] + case[4:5]], dict(rtol=2e-5, atol=2e-5))
    w = randn(6, 4, seed=1)
    conv = [randn(2, 5, 6, seed=3), randn(2, 3, 6, seed=4), torch.tensor([5, 2], dtype=torch.int32)]
    check(lambda x, s, n: F.causal_conv1d(x, s, w, None, n),
          [(n, v.dtype, tuple(v.shape)) for n, v in zip("xsn", conv)], [conv])
    check(lambda s, x, n: F.conv_window(s, x, n),
          [(n, v.dtype, tuple(v.shape)) for n, v in zip("sxn", [conv[1], conv[0], conv[2]])], [[conv[1], conv[0], conv[2]]])
    att = _attention_case(2, 3, S=7)
    check(lambda q, k, v, p: F.attention(q, k, v, p, 0.3), [(n, v.dtype, tuple(v.shape)) for n, v in zip("qkvp", att)],
          [att])
    kv = [att[1], att[2][:, :3].contiguous(), att[3]]
    check(lambda c, n, p: F.kv_cache_update(c, n, p), [(n, v.dtype, tuple(v.shape)) for n, v in zip("cnp", kv)], [kv])


def _ssm_recurrence(x, dt, A, B, C, h):
    """The token-by-token SSM recurrence (the oracle): (y, last state)."""
    ys = []
    for t in range(x.shape[1]):
        h = h * torch.exp(dt[:, t] * A)[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]))
    return torch.stack(ys, 1), h


def test_ssm_scan_long_prefill_matches_sequential():
    """A prefill of several hundred tokens (many chunks) against the token-by-token recurrence."""
    from builder.backends import torch_backend as tb
    A = -torch.exp(A_LOG)
    case = _ssm_case(1, 300, seed=3)
    rec = NetworkRecorder()
    syms = [rec.add_input(n, d, s) for n, d, s in _ssm_specs()]
    y, h = F.ssm_scan(*syms[:2], A, *syms[2:4], D_SKIP, syms[4], 16)
    rec.mark_output("y", y)
    rec.mark_output("h", h)
    got = run_network(rec.network, dict(zip(["x", "dt", "B", "C", "state"], case)))
    x, dt, B, C, s = case
    ys, hs = _ssm_recurrence(x, dt, A, tb._heads(B, 4), tb._heads(C, 4), s)
    torch.testing.assert_close(got["y"], ys + x * D_SKIP[:, None], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["h"], hs, rtol=1e-4, atol=1e-4)


def test_ssm_state_and_short_chunks_match_the_recurrence():
    """What a verify keeps is enough: the state after any first t rows of a chunk (ssm_state with dt
    masked past t) and the outputs of a chunk shorter than the SSD chunk equal the recurrence's."""
    from builder.backends import torch_backend as tb
    A = -torch.exp(A_LOG)
    x, dt, B, C, s = _ssm_case(2, 7, seed=5)
    Bh, Ch = tb._heads(B, 4), tb._heads(C, 4)
    y, last = F.ssm_scan(x, dt, A, B, C, D_SKIP, s, 64)
    yt, ht = _ssm_recurrence(x, dt, A, Bh, Ch, s)
    torch.testing.assert_close(y, yt + x * D_SKIP[:, None], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, ht, rtol=1e-5, atol=1e-5)
    for t in range(1, 8):
        _, ht = _ssm_recurrence(x[:, :t], dt[:, :t], A, Bh[:, :t], Ch[:, :t], s)
        kept = F.mask_padding(dt, torch.tensor([t, t]))
        torch.testing.assert_close(F.ssm_state(x, kept, A, B, s), ht, rtol=1e-5, atol=1e-5)
        if t < 7:  # a state that ignores the mask would be the full chunk's
            assert not torch.allclose(F.ssm_state(x, dt, A, B, s), ht, rtol=1e-3, atol=1e-3)


def test_ssm_scan_bf16():
    A = -torch.exp(A_LOG)
    check(lambda x, dt, B, C, s: F.ssm_scan(x, dt, A, B, C, D_SKIP, s, 4),
          _ssm_specs(dtype=torch.bfloat16),
          [_ssm_case(bt, t, seed=1, dtype=torch.bfloat16) for bt, t in SHAPES], HALF[torch.bfloat16])


def test_kv_cache_update():
    S, Hkv, D = 16, 2, 3
    cases = []
    for bt, t in SHAPES:
        past = torch.randint(0, S - t + 1, (bt, 1), generator=gen(t), dtype=torch.int32)
        cases.append([randn(bt, S, Hkv, D, seed=1), randn(bt, t, Hkv, D, seed=2),
                      past + torch.arange(t, dtype=torch.int32)])
    check(lambda c, n, p: F.kv_cache_update(c, n, p),
          [("cache", torch.float32, (-1, -1, Hkv, D)), ("new", torch.float32, (-1, -1, Hkv, D)),
           ("pos", torch.int32, (-1, -1))], cases)


def _attention_case(batch, seq, S=12, Hq=4, Hkv=2, D=8, dtype=torch.float32, seed=0):
    past = torch.randint(0, S - seq + 1, (batch, 1), generator=gen(seed), dtype=torch.int32)
    positions = past + torch.arange(seq, dtype=torch.int32)
    return [randn(batch, seq, Hq, D, seed=seed + 1, dtype=dtype), randn(batch, S, Hkv, D, seed=seed + 2, dtype=dtype),
            randn(batch, S, Hkv, D, seed=seed + 3, dtype=dtype), positions]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention(dtype):
    specs = [("q", dtype, (-1, -1, 4, 8)), ("k", dtype, (-1, -1, 2, 8)), ("v", dtype, (-1, -1, 2, 8)),
             ("pos", torch.int32, (-1, -1))]
    cases = [_attention_case(bt, t, S=s, dtype=dtype, seed=bt + t) for bt, t, s in [(1, 1, 5), (3, 4, 12), (2, 7, 9)]]
    check(lambda q, k, v, p: F.attention(q, k, v, p, 8 ** -0.5), specs, cases, HALF.get(dtype, F32))


@pytest.mark.parametrize("norm,latent", [(True, False), (False, True)])
def test_moe(norm, latent):
    E, H, I, k = 8, 6, 5, 2
    Hin = 4 if latent else H
    router = randn(E, H, seed=1)
    bias = randn(E, seed=2, scale=0.1)
    up, down = randn(E, I, Hin, seed=3), randn(E, Hin, I, seed=4)

    def fn(h, x):
        return F.moe(h, x, router, bias, up, down, k, 2, 1, norm, 2.5, "relu2")
    rec = check(fn, [("h", torch.float32, (-1, -1, H)), ("x", torch.float32, (-1, -1, Hin))],
                [[randn(bt, t, H, seed=5), randn(bt, t, Hin, seed=6)] for bt, t in SHAPES])
    assert "topk" in rec.lowerings["moe"]


def test_moe_group_limit_changes_choice():
    """With n_group 2, topk_group 1 the best expert of the losing group must not be chosen."""
    E, H = 4, 2
    router = torch.tensor([[4.0, 0.0], [-4.0, 0.0], [0.0, 3.0], [0.0, 2.9]])
    zero = torch.zeros(E)
    up = torch.eye(2).repeat(E, 1, 1)
    down = torch.stack([torch.eye(2) * (e + 1) for e in range(E)])
    h = torch.tensor([[[1.0, 1.0]]])
    fn = lambda a, b: F.moe(a, b, router, zero, up, down, 2, 2, 1, False, 1.0, "relu")  # noqa: E731
    check(fn, [("h", torch.float32, (-1, -1, H)), ("x", torch.float32, (-1, -1, H))], [[h, h]])
