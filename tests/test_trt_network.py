"""The recorded network as a whole: the recorder's names, scopes and outputs, building an engine with
dynamic profiles, the whole NemotronH target's networks (prefill, decode, verify, half precision)
on the CPU interpreter against the eager module, and the interpreter apart from the backend."""
from __future__ import annotations

import time

import pytest
import torch

from builder import functional as F
from builder.backends.trt_backend import NetworkRecorder
from builder.backends.trt_build import build_engine_bytes
from builder.backends.trt_import import trt
from builder.interpreter import UnsupportedLayerError, run_network
from network_checks import gen, randn
from tolerances import assert_within, matmul_bound


# --- recorder behaviour ---------------------------------------------------------------------------------
def test_names_scopes_and_constant_cache():
    table = randn(7, 4, seed=1)
    rec = NetworkRecorder()
    ids = rec.add_input("ids", torch.int32, (-1, -1))
    with rec.scope("layers.3"):
        x = F.embedding(ids, table)
        y = F.linear(x, table)  # tied: same tensor object -> same constant layer
        z = F.linear(y, randn(4, 7, seed=2))
    rec.mark_output("z", z)
    names = [rec.network.get_layer(i).name for i in range(rec.network.num_layers)]
    assert len(set(names)) == len(names)
    assert any(n.startswith("layers.3.embedding/") for n in names)
    assert any(n.startswith("layers.3.linear/") for n in names) and any(n.startswith("layers.3.linear_1/") for n in names)
    consts = [i for i in range(rec.network.num_layers) if rec.network.get_layer(i).type == trt.LayerType.CONSTANT]
    assert len([i for i in consts if tuple(rec.network.get_layer(i).get_output(0).shape) == (7, 4)]) == 1
    assert set(rec.lowerings) == {"embedding", "linear"}


def test_mark_output_of_input_and_twice():
    rec = NetworkRecorder()
    x = rec.add_input("x", torch.float32, (-1, 3))
    rec.mark_output("same", x)
    y = x * 2.0
    rec.mark_output("a", y)
    rec.mark_output("b", y)
    v = randn(2, 3)
    out = run_network(rec.network, {"x": v})
    assert set(out) == {"same", "a", "b"}
    torch.testing.assert_close(out["same"], v)
    torch.testing.assert_close(out["b"], v * 2)


def test_interpreter_rejects_unknown_layers():
    rec = NetworkRecorder()
    x = rec.add_input("x", torch.float32, (1, 1, 4, 4))
    layer = rec.network.add_pooling_nd(x.tensor, trt.PoolingType.MAX, (2, 2))
    layer.name = "my_pool"
    rec.network.mark_output(layer.get_output(0))
    with pytest.raises(UnsupportedLayerError, match="my_pool.*POOLING"):
        run_network(rec.network, {"x": torch.zeros(1, 1, 4, 4)})


# --- building ----------------------------------------------------------------------------------------
def test_build_with_dynamic_profile():
    """Several ops (including the chunked scan, attention and MoE) build with dynamic B/T/S/G."""
    H, Hq, Hkv, D = 8, 2, 1, 4
    rec = NetworkRecorder()
    ids = rec.add_input("ids", torch.int32, (-1, -1))
    pos = rec.add_input("pos", torch.int32, (-1, -1))
    lengths = rec.add_input("lengths", torch.int32, (-1,))
    index = rec.add_input("index", torch.int32, (-1, -1))
    cache = rec.add_input("cache", torch.float32, (-1, -1, Hkv, D))
    state = rec.add_input("state", torch.float32, (-1, 2, 2, 3))
    table = randn(16, H, seed=1)
    x = F.embedding(ids, table)
    x = F.rms_norm(x, torch.ones(H), 1e-5)
    q = F.reshape(F.linear(x, randn(Hq * D, H, seed=2)), [0, 0, Hq, D])
    k = F.reshape(F.linear(x, randn(Hkv * D, H, seed=3)), [0, 0, Hkv, D])
    new_cache = F.kv_cache_update(cache, k, pos)
    a = F.reshape(F.attention(q, new_cache, new_cache, pos, 0.5), [0, 0, Hq * D])
    xs, dt, B = F.split(F.linear(x, randn(4 + 2 + 3, H, seed=4)), [4, 2, 3])
    dt = F.mask_padding(F.activation(dt, "softplus"), lengths)
    y, new_state = F.ssm_scan(F.reshape(xs, [0, 0, 2, 2]), dt, -torch.ones(2), F.reshape(B, [0, 0, 1, 3]),
                              F.reshape(B, [0, 0, 1, 3]), torch.ones(2), state, 4)
    m = F.moe(x, x, randn(4, H, seed=5), torch.zeros(4), randn(4, 3, H, seed=6), randn(4, H, 3, seed=7),
              2, 2, 1, True, 1.0, "silu")
    out = F.gather_rows(x + a + m, index)
    rec.mark_output("logits", F.to_float32(F.linear(out, table)))
    rec.mark_output("cache_out", new_cache)
    rec.mark_output("state_out", new_state)
    rec.mark_output("y", y)
    profile = {"ids": [(1, 1), (2, 8), (4, 64)], "pos": [(1, 1), (2, 8), (4, 64)], "lengths": [(1,), (2,), (4,)],
               "index": [(1, 1), (2, 4), (4, 64)], "cache": [(1, 1, Hkv, D), (2, 32, Hkv, D), (4, 128, Hkv, D)],
               "state": [(1, 2, 2, 3), (2, 2, 2, 3), (4, 2, 2, 3)]}
    decode = dict(profile, ids=[(1, 1), (2, 3), (4, 5)], pos=[(1, 1), (2, 3), (4, 5)])
    started = time.perf_counter()
    engine = build_engine_bytes(rec, [decode, profile])
    assert isinstance(engine, bytes) and len(engine) > 1000
    assert time.perf_counter() - started < 60


def test_build_reports_missing_profile_inputs():
    from builder.errors import BuildError
    rec = NetworkRecorder()
    x = rec.add_input("x", torch.float32, (-1, 4))
    rec.mark_output("y", x * 2.0)
    with pytest.raises(BuildError, match="x"):
        build_engine_bytes(rec, [{}])


# --- the whole target model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """The MoE tiny model (Mamba, attention, MLP and MoE layers), group-limited routing, tied head."""
    from tiny_models import tiny_checkpoint

    from builder.checkpoint import load_checkpoint
    from builder.models.nemotron_h import NemotronH
    path = tiny_checkpoint("moe", tmp_path_factory, tie_word_embeddings=True, n_group=2, topk_group=1)
    config, weights = load_checkpoint(path)
    module = NemotronH(config, weights, torch.float32)
    module.source = path
    return module


def _weights_of(module):
    from builder.checkpoint import load_checkpoint
    return load_checkpoint(module.source)[1]


def _record_model(module, verify=False):
    rec = NetworkRecorder()
    feeds = {n: rec.add_input(n, torch.int32, s) for n, s in
             [("input_ids", (-1, -1)), ("positions", (-1, -1)), ("lengths", (-1,)), ("logit_index", (-1, -1))]}
    state = {n: rec.add_input("past." + n, dtype, shape) for n, (shape, dtype) in module.state_spec(-1, -1).items()}
    logits, new_state, _ = module.forward(feeds["input_ids"], feeds["positions"], feeds["lengths"],
                                       feeds["logit_index"], state, verify)
    rec.mark_output("logits", logits)
    for n, t in new_state.items():
        rec.mark_output("present." + n, t)
    return rec


def _compare_model(rec, module, ids, positions, lengths, index, state, verify=False):
    feeds = dict(input_ids=ids, positions=positions, lengths=lengths, logit_index=index)
    feeds.update({"past." + n: v for n, v in state.items()})
    got = run_network(rec.network, feeds)
    logits, new_state, _ = module.forward(ids, positions, lengths, index, {n: v.clone() for n, v in state.items()},
                                       verify)
    torch.testing.assert_close(got["logits"], logits, rtol=1e-4, atol=1e-4)
    assert set(got) == {"logits"} | {"present." + n for n in new_state}
    for n, v in new_state.items():
        torch.testing.assert_close(got["present." + n], v, rtol=1e-4, atol=1e-4, msg=n)
    return new_state


def test_nemotron_h_prefill_and_decode(tiny_target):
    module = tiny_target
    rec = _record_model(module)
    assert {"linear", "embedding", "rms_norm", "gated_rms_norm", "activation", "clamp", "split", "reshape",
            "gather_rows", "mask_padding", "causal_conv1d", "ssm_scan", "kv_cache_update", "attention",
            "moe", "to_float32", "add"} <= set(rec.lowerings)
    vocab, capacity = module.cfg.vocab_size, 16
    state = {n: torch.randn(shape, generator=gen(1)).to(dtype) * 0 for n, (shape, dtype) in
             module.state_spec(2, capacity).items()}
    ids = torch.randint(3, vocab, (2, 5), generator=gen(2), dtype=torch.int32)
    positions = torch.arange(5, dtype=torch.int32).repeat(2, 1)
    lengths = torch.tensor([5, 3], dtype=torch.int32)
    index = torch.tensor([[4, 1], [2, 0]], dtype=torch.int32)  # G = 2 rows per sequence
    state = _compare_model(rec, module, ids, positions, lengths, index, state)
    decode = torch.randint(3, vocab, (2, 1), generator=gen(3), dtype=torch.int32)
    _compare_model(rec, module, decode, lengths[:, None].clone(), torch.ones(2, dtype=torch.int32),
                   torch.zeros(2, 1, dtype=torch.int32), state)


def test_nemotron_h_verify_keeps_what_rollback_needs(tiny_target):
    module = tiny_target
    rec = _record_model(module, verify=True)
    state = {n: torch.randn(shape, generator=gen(4)).to(dtype) for n, (shape, dtype) in
             module.state_spec(2, 12).items()}
    ids = torch.randint(3, module.cfg.vocab_size, (2, 3), generator=gen(5), dtype=torch.int32)
    positions = torch.tensor([[4, 5, 6], [7, 8, 9]], dtype=torch.int32)
    new_state = _compare_model(rec, module, ids, positions, torch.tensor([3, 2], dtype=torch.int32),
                               torch.tensor([[0, 1, 2], [0, 1, 1]], dtype=torch.int32), state, verify=True)
    kept = {n.rpartition(".")[2] for n in new_state}
    assert {"conv_inputs", "ssm_x", "ssm_B", "ssm_dt"} <= kept and not kept & {"ssm_state", "conv_state", "ssm_states"}


@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 5e-2), (torch.float16, 5e-3)])
def test_nemotron_h_half_precision(tiny_target, dtype, bound):
    from builder.models.nemotron_h import NemotronH
    module = NemotronH(tiny_target.cfg, _weights_of(tiny_target), dtype)
    rec = _record_model(module)
    state = {n: torch.zeros(shape, dtype=dt) for n, (shape, dt) in module.state_spec(2, 16).items()}
    # seed 14: each row's top-2 gap is over 3x the 2 * bound * max|logit| the argmax check needs (seed 6 had
    # a bf16 gap of 0.09 against an interpreter-vs-eager difference of 0.11: the argmax agreed by chance)
    ids = torch.randint(3, module.cfg.vocab_size, (2, 11), generator=gen(14), dtype=torch.int32)
    feeds = dict(input_ids=ids, positions=torch.arange(11, dtype=torch.int32).repeat(2, 1),
                 lengths=torch.tensor([11, 6], dtype=torch.int32), logit_index=torch.tensor([[10], [5]], dtype=torch.int32))
    got = run_network(rec.network, dict(feeds, **{"past." + n: v for n, v in state.items()}))
    want, _, _ = module.forward(*feeds.values(), {n: v.clone() for n, v in state.items()})
    assert ((got["logits"] - want).abs().max() / want.abs().max()).item() < bound
    # the argmax then agrees in any order within that bound, unless a top-2 gap is under twice it
    top2 = want.topk(2, -1).values
    assert ((top2[..., 0] - top2[..., 1]) > 2 * bound * want.abs().max()).all(), "a near-tie: choose other ids"
    assert torch.equal(got["logits"].argmax(-1), want.argmax(-1))


# --- the interpreter on its own ----------------------------------------------------------------------------
def test_interpreter_is_independent_of_the_backend():
    import subprocess
    import sys
    backend = ("trt_backend", "trt_recorder", "trt_layers", "trt_dense", "trt_mixers", "trt_plugin_ops", "trt_tree")
    code = (f"import sys, builder.interpreter; "
            f"sys.exit(any('builder.backends.' + m in sys.modules for m in {backend!r}))")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_interpreter_layers_not_emitted_by_the_backend():
    """Einsum, squeeze/unsqueeze, a bf16 constant, and a slice whose size tensor is made after it."""
    import numpy as np
    rec = NetworkRecorder()  # keeps the builder alive with its network
    net = rec.network
    x = net.add_input("x", trt.float32, (-1, 3, 4))
    y = net.add_input("y", trt.float32, (4, 5))
    e = net.add_einsum([x, y], "btk,kn->btn").get_output(0)
    sl = net.add_slice(e, (0, 1, 0), (1, 1, 1), (1, 1, 1))  # its size input comes later
    shape = net.add_shape(e).get_output(0)
    minus = net.add_constant((3,), np.array([0, 1, 0], dtype=np.int64)).get_output(0)
    sl.set_input(2, net.add_elementwise(shape, minus, trt.ElementWiseOperation.SUB).get_output(0))
    axes = net.add_constant((1,), np.array([1], dtype=np.int64)).get_output(0)
    sq = net.add_squeeze(net.add_slice(e, (0, 0, 0), (1, 1, 5), (1, 1, 1)).get_output(0), axes).get_output(0)
    unsq = net.add_unsqueeze(sq, axes).get_output(0)
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3).bfloat16()
    arr = w.view(torch.int16).numpy()
    c = net.add_constant((2, 3), trt.Weights(trt.bfloat16, arr.ctypes.data, arr.size)).get_output(0)
    cf = net.add_cast(c, trt.float32).get_output(0)
    for name, t in [("einsum", e), ("slice", sl.get_output(0)), ("unsqueeze", unsq), ("const", cf)]:
        t.name = name
        net.mark_output(t)
    xv, yv = randn(2, 3, 4, seed=1), randn(4, 5, seed=2)
    out = run_network(net, {"x": xv, "y": yv})
    ref = torch.einsum("btk,kn->btn", xv, yv)
    bound = matmul_bound(xv, yv)  # the interpreter's einsum may sum the 4 terms in its own order
    assert_within(out["einsum"], ref, bound, "einsum")
    assert_within(out["slice"], ref[:, 1:], bound[:, 1:], "slice")
    assert_within(out["unsqueeze"], ref[:1, :1], bound[:1, :1], "unsqueeze")
    torch.testing.assert_close(out["const"], w.float())
