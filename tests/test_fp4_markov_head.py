"""The FP4 Markov head plugin (DSpark): spec, torch reference semantics, Triton kernel against the
reference (TRITON_INTERPRET=1 on the CPU), the functional op eager vs its interpreted TensorRT network,
the network building with tensorrt_rtx, and the plugin-layer path's wiring against a stand-in for
``tensorrt.plugin`` (full TensorRT is not installable here)."""
import importlib.util
import contextlib
import inspect
import sys
import types

import pytest
import torch

from builder import functional as F
from builder.backends.trt_backend import NetworkRecorder
from builder.backends.trt_build import build_engine_bytes
from builder.backends.trt_import import FLAVOUR, HAS_PLUGIN_LAYERS
from builder.backends.trt_recorder import SymbolicTensor
from builder.errors import BuildError
from builder.interpreter import run_network
from builder.nvfp4_format import dequantize_nvfp4, quantize_nvfp4
from plugins import fp4_markov_head as mh
from tolerances import assert_within, sum_bound


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def head(vocab=80, prev_vocab=70, rank=32, seed=0, w1_dtype=torch.float32):
    """W1 [prev_vocab, rank] and NVFP4 W2 [vocab, rank] (packed, scales, global scale)."""
    w1 = randn(prev_vocab, rank, seed=seed).to(w1_dtype)
    w2 = randn(vocab, rank, seed=seed + 1) * torch.rand(vocab, 1, generator=torch.Generator().manual_seed(seed)) * 2
    return (w1, *quantize_nvfp4(w2))


def head_bound(logits, prev, w1, packed, scale, scale_2):
    """Two fp32 orders of logits + sum_j W1[prev, j] W2[v, j] (rank + 1 terms) differ by at most this."""
    rows, w2 = w1[prev.long()].double(), mh.dequantize_w2(packed, scale, scale_2).double()
    return sum_bound(logits.double().abs() + rows.abs() @ w2.abs().t(), w1.shape[-1] + 1)


@pytest.fixture
def interpret(monkeypatch):
    """Triton in interpreter mode for this test only (the kernel is jitted per mode, on first launch)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# --- spec --------------------------------------------------------------------------------------------
def test_spec():
    assert (mh.PLUGIN_NAME, mh.PLUGIN_VERSION, mh.PLUGIN_NAMESPACE) == ("nemospec_fp4_markov_head", "1", "nemospec")
    assert mh.PLUGIN_ID == "nemospec::nemospec_fp4_markov_head" and mh.OP_NAME == "fp4_markov_head"
    spec = mh.make_spec((-1, -1, 80), (-1, -1), (70, 32), (80, 16), (80, 2), 0.5)
    assert spec == mh.MarkovHeadSpec(vocab_size=80, rank=32, prev_vocab_size=70, scale_2=0.5)
    assert spec.attributes() == {"vocab_size": 80, "rank": 32, "prev_vocab_size": 70, "scale_2": 0.5}
    assert tuple(spec.attributes()) == mh.ATTRIBUTES
    assert mh.output_shapes((4, 80), (4,), (70, 32), (80, 16), (80, 2), 1.0) == (4, 80)
    dtypes = (torch.float32, torch.int32, torch.bfloat16, torch.uint8, torch.float8_e4m3fn)
    assert mh.output_dtypes(*dtypes) == torch.float32
    for bad, match in [(((4, 80), (4,), (70, 24), (80, 12), (80, 1), 1.0), "multiple of the NVFP4 block"),
                       (((4, 80), (4,), (70, 32), (80, 32), (80, 2), 1.0), "two FP4 values per byte"),
                       (((4, 80), (4,), (70, 32), (80, 16), (80, 4), 1.0), "W2 scales"),
                       (((4, 81), (4,), (70, 32), (80, 16), (80, 2), 1.0), "differs from W2"),
                       (((4, 80), (4, 1), (70, 32), (80, 16), (80, 2), 1.0), "leading dims"),
                       (((4, -1), (4,), (70, 32), (80, 16), (80, 2), 1.0), "static"),
                       (((4, 80), (4,), (70, 32), (80, 16), (80, 2), 0.0), "global scale")]:
        with pytest.raises(ValueError, match=match):
            mh.make_spec(*bad)
    for bad in [(torch.float16, torch.int32, torch.float32, torch.uint8, torch.float8_e4m3fn),
                (torch.float32, torch.float32, torch.float32, torch.uint8, torch.float8_e4m3fn),
                (torch.float32, torch.int64, torch.float32, torch.float32, torch.float8_e4m3fn)]:
        with pytest.raises(TypeError):
            mh.output_dtypes(*bad)


# --- torch reference ---------------------------------------------------------------------------------
def test_reference_semantics():
    w1, packed, scale, scale_2 = head()
    # the plugin decodes W2 exactly as builder.nvfp4_format (ModelOpt layout) does
    w2 = dequantize_nvfp4(packed, scale, scale_2, (80, 32))
    assert torch.equal(mh.dequantize_w2(packed, scale, scale_2), w2)
    assert torch.equal(mh.dequantize_w2(packed, scale.view(torch.uint8), scale_2), w2)
    logits, prev = randn(2, 3, 80, seed=5), torch.tensor([[0, 69, 5], [7, 7, 31]])
    copies = [t.clone() for t in (logits, prev, w1, packed)]
    out = mh.fp4_markov_head_reference(logits, prev, w1, packed, scale, scale_2)
    for t, c in zip((logits, prev, w1, packed), copies):
        assert torch.equal(t, c)
    # out[b, g, v] = logits[b, g, v] + sum_j W2[v, j] W1[prev[b, g], j]
    want = logits.double() + torch.einsum("vj,bgj->bgv", w2.double(), w1.double()[prev])
    assert out.dtype == torch.float32 and out.shape == logits.shape
    assert_within(out, want, head_bound(logits, prev, w1, packed, scale, scale_2), "fp32 reference vs exact")
    # int32 ids and a bf16 W1 (gathered, then computed in fp32)
    out32 = mh.fp4_markov_head_reference(logits, prev.int(), w1.bfloat16(), packed, scale, scale_2)
    want32 = logits + torch.matmul(w1.bfloat16()[prev].float(), w2.t())
    assert torch.equal(out32, want32)
    with pytest.raises(TypeError):
        mh.fp4_markov_head_reference(logits.half(), prev, w1, packed, scale, scale_2)


# --- Triton kernel -------------------------------------------------------------------------------------
CASES = [  # logits leading dims, V, V_prev, rank, W1 dtype, ids dtype
    ((5,), 80, 70, 32, torch.float32, torch.int32),
    ((1,), 33, 40, 16, torch.float32, torch.int64),     # V not a multiple of the vocab block, rank 16
    ((2, 3), 130, 50, 96, torch.bfloat16, torch.int64),  # two rank chunks (the second masked), leading dims
    ((17,), 64, 64, 64, torch.float16, torch.int32),     # rows past one row block
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_triton_kernel_matches_reference(interpret, case):
    lead, vocab, prev_vocab, rank, w1_dtype, ids_dtype = CASES[case]
    w1, packed, scale, scale_2 = head(vocab, prev_vocab, rank, seed=case, w1_dtype=w1_dtype)
    logits = randn(*lead, vocab, seed=10 + case, scale=3.0)
    prev = torch.randint(0, prev_vocab, lead, generator=torch.Generator().manual_seed(case)).to(ids_dtype)
    got = mh.fp4_markov_head_triton(logits, prev, w1, packed, scale, scale_2)
    want = mh.fp4_markov_head_reference(logits, prev, w1, packed, scale, scale_2)
    assert got.dtype == torch.float32 and got.shape == logits.shape
    assert_within(got, want, head_bound(logits, prev, w1, packed, scale, scale_2))


def test_triton_kernel_decodes_subnormal_and_negative_codes(interpret):
    """Rows 1e-6 of the tensor's amax get FP8 block scales in E4M3's subnormal range. The bound follows
    from fp32 rounding of the summed terms, and is tight enough that one wrongly decoded FP4 code or
    one subnormal scale off by one step fails it."""
    w2 = randn(32, 16, seed=3)
    w2[1:4] *= 1e-6
    packed, scale, scale_2 = quantize_nvfp4(w2)
    subnormal = (scale.view(torch.uint8) & 0x78) == 0  # exponent field 0
    assert subnormal[1:4].any()
    w1, logits, prev = randn(10, 16, seed=4), torch.zeros(3, 32), torch.tensor([1, 2, 9])
    got = mh.fp4_markov_head_triton(logits, prev, w1, packed, scale, scale_2)
    want = mh.fp4_markov_head_reference(logits, prev, w1, packed, scale, scale_2)
    bound = head_bound(logits, prev, w1, packed, scale, scale_2)
    assert_within(got, want, bound)
    assert (got[:, 1:4] != 0).all()
    # a decode that differs in one FP4 magnitude bit (row 2, the subnormal-scaled range) is caught
    wrong_code = packed.clone()
    wrong_code[2, 3] ^= 0x01
    with pytest.raises(AssertionError, match="exceeds its bound"):
        assert_within(got, mh.fp4_markov_head_reference(logits, prev, w1, wrong_code, scale, scale_2), bound)
    # so is a subnormal block scale decoded one step off
    row, block = (int(v) for v in subnormal[1:4].nonzero()[0])
    wrong_scale = scale.view(torch.uint8).clone()
    wrong_scale[1 + row, block] += 1
    wrong_scale = wrong_scale.view(torch.float8_e4m3fn)
    with pytest.raises(AssertionError, match="exceeds its bound"):
        assert_within(got, mh.fp4_markov_head_reference(logits, prev, w1, packed, wrong_scale, scale_2), bound)


def test_triton_kernel_gives_nan_rows_for_ids_outside_w1(interpret):
    """An id outside W1 cannot read another row: that row comes out NaN, the others as the reference."""
    w1, packed, scale, scale_2 = head()
    logits, prev = randn(4, 80, seed=2), torch.tensor([3, 70, -1, 69])
    got = mh.fp4_markov_head_triton(logits, prev, w1, packed, scale, scale_2)
    assert got[1:3].isnan().all() and not got[[0, 3]].isnan().any()
    ok = torch.tensor([0, 3])
    want = mh.fp4_markov_head_reference(logits[ok], prev[ok], w1, packed, scale, scale_2)
    assert_within(got[ok], want, head_bound(logits[ok], prev[ok], w1, packed, scale, scale_2))


def test_gpu_path_op_launches_the_kernel(interpret, monkeypatch):
    """On the GPU path (CPU tensors inside gpu.forced()) the functional op runs the shared NVFP4 row
    kernel, once per call, within the reference's bound."""
    from builder.backends import gpu

    launched = []
    real = mh._run
    monkeypatch.setattr(mh, "_run", lambda kernel, grid, *a, **m: (launched.append((kernel.__name__, grid)),
                                                                     real(kernel, grid, *a, **m)))
    w1, packed, scale, scale_2 = head(vocab=130, rank=64, w1_dtype=torch.bfloat16)
    logits, prev = randn(2, 9, 130, seed=5), torch.randint(0, 70, (2, 9), generator=torch.Generator().manual_seed(5))
    with gpu.forced():
        got = F.fp4_markov_head(logits, prev, w1, packed, scale, scale_2)
    assert launched == [("_nvfp4_kernel", (3, 2))]      # 130 / 64 vocabulary blocks, 18 / 16 row blocks
    assert_within(got, mh.fp4_markov_head_reference(logits, prev, w1, packed, scale, scale_2),
                  head_bound(logits, prev, w1, packed, scale, scale_2))
    # the block sizes a device run sweeps: the same result within the bound, the grid they imply
    swept = mh.fp4_markov_head_triton(logits, prev, w1, packed, scale, scale_2, blocks=(32, 32))
    assert launched[-1] == ("_nvfp4_kernel", (5, 2))     # 130 / 32 vocabulary blocks
    assert_within(swept, mh.fp4_markov_head_reference(logits, prev, w1, packed, scale, scale_2),
                  head_bound(logits, prev, w1, packed, scale, scale_2))


# --- functional op ----------------------------------------------------------------------------------------
def test_functional_torch_is_reference():
    w1, packed, scale, scale_2 = head()
    logits, prev = randn(4, 80, seed=1), torch.tensor([3, 1, 4, 1])
    assert torch.equal(F.fp4_markov_head(logits, prev, w1, packed, scale, scale_2),
                       mh.fp4_markov_head_reference(logits, prev, w1, packed, scale, scale_2))


def _record(w1, packed, scale, scale_2, lead_rank=2, vocab=80):
    rec = NetworkRecorder("markov_head")
    rec.native_plugins = True  # interpretable everywhere: where plugin layers exist, ask for native ones
    logits = rec.add_input("logits", torch.float32, (-1,) * lead_rank + (vocab,))
    prev = rec.add_input("prev_ids", torch.int32, (-1,) * lead_rank)
    out = F.fp4_markov_head(logits, prev, w1, packed, scale, scale_2)
    assert isinstance(out, SymbolicTensor) and out.dtype == torch.float32 and out.shape == (-1,) * lead_rank + (vocab,)
    rec.mark_output("out", out)
    return rec


@pytest.mark.parametrize("w1_dtype", [torch.float32, torch.bfloat16])
def test_recorded_network_matches_eager(w1_dtype):
    w1, packed, scale, scale_2 = head(w1_dtype=w1_dtype)
    rec = _record(w1, packed, scale, scale_2)
    for batch, rows in [(1, 1), (3, 4)]:
        logits = randn(batch, rows, 80, seed=batch)
        prev = torch.randint(0, 70, (batch, rows), generator=torch.Generator().manual_seed(rows), dtype=torch.int32)
        got = run_network(rec.network, {"logits": logits, "prev_ids": prev})["out"]
        want = F.fp4_markov_head(logits, prev, w1, packed, scale, scale_2)
        bound = head_bound(logits, prev, w1, packed, scale, scale_2)  # gather + dequantize + matmul: its own order
        assert_within(got, want, bound, f"network vs eager {batch}x{rows}")
        wrong = packed.clone()
        wrong[5, 0] ^= 0x01  # W2[5, 0] one FP4 magnitude step off
        with pytest.raises(AssertionError, match="exceeds its bound"):
            assert_within(got, F.fp4_markov_head(logits, prev, w1, wrong, scale, scale_2), bound)
    kinds = {rec.network.get_layer(i).type.name for i in range(rec.network.num_layers)}
    assert {"GATHER", "DEQUANTIZE", "MATRIX_MULTIPLY"} <= kinds
    lowering = rec.lowerings["fp4_markov_head"]
    assert lowering.startswith(mh.NATIVE_LOWERING) and "plugin" in lowering


def test_lowering_without_plugin_layers_is_native_and_says_why():
    w1, packed, scale, scale_2 = head()
    rec = NetworkRecorder()
    logits = rec.add_input("logits", torch.float32, (-1, 80))
    prev = rec.add_input("prev_ids", torch.int64, (-1,))
    rec.mark_output("out", F.fp4_markov_head(logits, prev, w1, packed, scale, scale_2))
    if HAS_PLUGIN_LAYERS and mh.plugin_layers_available(rec.network):  # pragma: no cover - full TensorRT
        assert rec.lowerings["fp4_markov_head"] == mh.PLUGIN_LOWERING
    else:
        assert not mh.plugin_layers_available(rec.network)
        assert rec.lowerings["fp4_markov_head"] == f"{mh.NATIVE_LOWERING} ({FLAVOUR} has no plugin layers)"


def test_lowering_errors_are_build_errors():
    w1, packed, scale, scale_2 = head()
    rec = NetworkRecorder()
    logits = rec.add_input("logits", torch.float32, (-1, 81))
    prev = rec.add_input("prev_ids", torch.int32, (-1,))
    with pytest.raises(BuildError, match="differs from W2"):
        F.fp4_markov_head(logits, prev, w1, packed, scale, scale_2)
    half = rec.add_input("half", torch.float16, (-1, 80))
    with pytest.raises(BuildError, match="float32"):
        F.fp4_markov_head(half, prev, w1, packed, scale, scale_2)


def test_network_builds_with_build_serialized_network():
    w1, packed, scale, scale_2 = head(vocab=256, prev_vocab=300, rank=64, w1_dtype=torch.bfloat16)
    rec = _record(w1, packed, scale, scale_2, lead_rank=2, vocab=256)
    shapes = {"logits": [(1, 1, 256), (2, 4, 256), (4, 8, 256)], "prev_ids": [(1, 1), (2, 4), (4, 8)]}
    engine = build_engine_bytes(rec, [shapes])
    assert isinstance(engine, bytes) and len(engine) > 1000


# --- plugin-layer path, against a stand-in for tensorrt.plugin ------------------------------------------
class _FakeTensor:
    def __init__(self, name, dtype, shape):
        self.name, self.dtype, self.shape = name, dtype, shape


class _FakeDesc:
    def __init__(self, tag):
        self.tag = tag

    def like(self):
        return _FakeDesc(self.tag + "'")


def _fake_tensorrt_plugin():
    """Just enough of ``tensorrt.plugin`` to record what our registration declares."""
    registry = {}
    trtp = types.ModuleType("tensorrt.plugin")
    trtp.TensorDesc = _FakeDesc
    trtp.op = types.SimpleNamespace()

    def register(plugin_id):
        def wrap(fn):
            ns, name = plugin_id.split("::")
            registry[plugin_id] = {"register": fn}

            def instantiate(*inputs, **attrs):
                return ("plugin", plugin_id, inputs, attrs)
            setattr(trtp.op, ns, types.SimpleNamespace(**{name: instantiate}))
            return fn
        return wrap

    def impl(plugin_id):
        def wrap(fn):
            registry[plugin_id]["impl"] = fn
            return fn
        return wrap

    trtp.register, trtp.impl = register, impl
    trt = types.ModuleType("tensorrt")
    trt.plugin = trtp
    trt.__name__ = "tensorrt"
    return trt, trtp, registry


class _FakeLayer:
    num_outputs = 1

    def __init__(self, call):
        self.call, self.outputs, self.name = call, [_FakeTensor("out", "f32", ())], None

    def get_output(self, i):
        return self.outputs[i]


class _FakeNetwork:
    def __init__(self):
        self.layers = []

    def add_plugin_v3(self, *args):  # pragma: no cover - presence is what matters
        raise AssertionError("the quickly deployable plugin goes through add_plugin")

    def add_plugin(self, call):
        self.layers.append(_FakeLayer(call))
        return self.layers[-1]


class _FakeRecorder:
    flavour = "tensorrt"

    def __init__(self):
        self.network, self.lowerings, self.constants = _FakeNetwork(), {}, {}

    @contextlib.contextmanager
    def op(self, name, description):
        self.lowerings[name] = description
        yield self

    def weight(self, tensor, what):
        self.constants[what] = tensor
        return ("constant", what)


def test_plugin_layer_path_wiring(monkeypatch):
    trt, trtp, registry = _fake_tensorrt_plugin()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(mh, "_REGISTERED", False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "tensorrt.plugin" else None)
    monkeypatch.delenv(mh.NATIVE_ENV, raising=False)

    w1, packed, scale, scale_2 = head()
    rec = _FakeRecorder()
    logits, prev = _FakeTensor("logits", torch.float32, (-1, 80)), _FakeTensor("prev", torch.int32, (-1,))
    out = mh.lower(rec, trt, logits, prev, w1, packed, scale, scale_2)
    assert rec.lowerings == {"fp4_markov_head": mh.PLUGIN_LOWERING}
    layer = rec.network.layers[0]
    assert out is layer.outputs[0]
    kind, plugin_id, inputs, attrs = layer.call
    assert plugin_id == mh.PLUGIN_ID
    assert inputs == (logits, prev, ("constant", "w1"), ("constant", "w2_fp4_bytes"),
                      ("constant", "w2_block_scale_bytes"))
    assert rec.constants["w1"] is w1 and rec.constants["w2_fp4_bytes"] is packed
    assert torch.equal(rec.constants["w2_block_scale_bytes"], scale.view(torch.uint8))
    assert attrs == {"vocab_size": 80, "rank": 32, "prev_vocab_size": 70, "scale_2": float(scale_2)}

    entry = registry[mh.PLUGIN_ID]
    reg, impl = entry["register"], entry["impl"]
    params = inspect.signature(reg).parameters
    inputs = ["logits", "prev_ids", "w1", "w2_packed", "w2_scale"]
    assert list(params) == inputs + list(mh.ATTRIBUTES)
    assert all(params[n].annotation is _FakeDesc for n in inputs)
    assert [params[n].annotation for n in mh.ATTRIBUTES] == [int, int, int, float]
    assert reg(*(_FakeDesc(n) for n in inputs), 80, 32, 70, 0.5).tag == "logits'"
    # TensorRT calls impl(*inputs, *attrs, outputs, stream=stream)
    assert list(inspect.signature(impl).parameters) == inputs + list(mh.ATTRIBUTES) + ["outputs", "stream"]
    monkeypatch.setenv(mh.NATIVE_ENV, "1")
    assert mh.native_requested(rec)
