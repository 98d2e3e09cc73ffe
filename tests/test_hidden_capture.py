"""The fused hidden-capture plugin: spec, torch reference, Triton kernel (TRITON_INTERPRET=1 on the
CPU), the functional op, its TensorRT lowering (interpreted == eager, builds with tensorrt_rtx), and the
plugin-layer path's wiring against a stand-in for ``tensorrt.plugin`` (full TensorRT is not installable
here)."""
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
from plugins import hidden_capture as hc

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randn(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.fixture
def interpret(monkeypatch):
    """Triton in interpreter mode for this test only (the kernel is jitted per mode, on first launch)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# --- spec --------------------------------------------------------------------------------------------
def test_spec():
    assert (hc.PLUGIN_NAME, hc.PLUGIN_VERSION, hc.PLUGIN_NAMESPACE) == ("nemospec_hidden_capture", "1", "nemospec")
    assert hc.PLUGIN_ID == "nemospec::nemospec_hidden_capture"
    spec = hc.make_spec((-1, -1, 8), (-1, -1, 8), (-1, -1, 24), 2)
    assert spec == hc.HiddenCaptureSpec(slot=2, n_slots=3, hidden_size=8, has_delta=True)
    assert spec.attributes() == {"slot": 2, "n_slots": 3, "hidden_size": 8, "has_delta": 1}
    assert tuple(spec.attributes()) == hc.ATTRIBUTES and spec.columns == (16, 24)
    assert hc.make_spec((2, 8), None, (2, 8), 0).has_delta is False
    assert hc.output_shapes((-1, 5, 8), None, (-1, 5, 32), 3) == ((-1, 5, 8), (-1, 5, 32))
    assert hc.output_dtypes(torch.bfloat16, torch.bfloat16, torch.bfloat16) == (torch.bfloat16, torch.bfloat16)
    with pytest.raises(TypeError, match="one dtype"):
        hc.output_dtypes(torch.float32, None, torch.float16)
    for bad, match in [(((2, 8), None, (2, 20), 0), "multiple"), (((2, 8), None, (2, 16), 2), "out of range"),
                       (((2, 8), (2, 4), (2, 16), 0), "delta"), (((2, 8), None, (3, 16), 0), "leading"),
                       (((2, -1), None, (2, 16), 0), "static"), (((2, 8), None, (2, 1, 16), 0), "rank")]:
        with pytest.raises(ValueError, match=match):
            hc.make_spec(*bad)


# --- torch reference ---------------------------------------------------------------------------------
def test_reference_semantics():
    res, delta, buf = randn(2, 3, 4, seed=1), randn(2, 3, 4, seed=2), randn(2, 3, 12, seed=3)
    copies = [t.clone() for t in (res, delta, buf)]
    x, new = hc.hidden_capture_reference(res, delta, buf, 1)
    for t, c in zip((res, delta, buf), copies):  # functional: inputs untouched
        assert torch.equal(t, c)
    assert torch.equal(x, res + delta)
    assert torch.equal(new[..., 4:8], x)
    assert torch.equal(new[..., :4], buf[..., :4]) and torch.equal(new[..., 8:], buf[..., 8:])
    x0, new0 = hc.hidden_capture_reference(res, None, buf, 2)  # pure capture
    assert x0 is res and torch.equal(new0[..., 8:], res) and torch.equal(new0[..., :8], buf[..., :8])
    with pytest.raises(TypeError):
        hc.hidden_capture_reference(res, delta, buf.half(), 0)


# --- Triton kernel -------------------------------------------------------------------------------------
CASES = [  # leading dims, H, n_slots, slot, has delta
    ((2, 5), 24, 3, 1, True),
    ((1, 1), 100, 3, 0, False),   # H not a power of two, pure capture
    ((3, 2), 1100, 2, 1, True),   # H above one column block (1024): two blocks, masked tail
    ((4,), 17, 1, 0, True),       # one slot, rank 2
    ((2, 3), 40, 4, 3, False),    # last slot
]


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernel_matches_reference(interpret, dtype):
    for n, (lead, hidden, slots, slot, has_delta) in enumerate(CASES):
        res = randn(*lead, hidden, seed=n, dtype=dtype, scale=30.0)
        delta = randn(*lead, hidden, seed=n + 10, dtype=dtype) if has_delta else None
        buf = randn(*lead, slots * hidden, seed=n + 20, dtype=dtype)
        want_x, want_buf = hc.hidden_capture_reference(res, delta, buf, slot)
        inplace = buf.clone()  # the launcher writes into its buffer
        x = hc.hidden_capture_triton(res, delta, inplace, slot)
        assert torch.equal(x, want_x) and torch.equal(inplace, want_buf), (dtype, lead, hidden)
        # the out-of-place form the TensorRT plugin runs: other slots copied through
        spec = hc.make_spec(res.shape, None if delta is None else delta.shape, buf.shape, slot)
        x_out, buf_out = torch.full_like(res, float("nan")), torch.full_like(buf, float("nan"))
        hc._launch(res, delta, buf, x_out, buf_out, spec, write_x=True, copy_buffer=True)
        assert torch.equal(x_out, want_x) and torch.equal(buf_out, want_buf), (dtype, lead, hidden)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, in the interpreter
def test_triton_kernel_rounding_and_specials(interpret):
    """Half types round once, to nearest even, like torch's add; inf and nan pass through."""
    eps = 2.0 ** -8  # bf16: half an ulp of 1.0 (ties go to the even neighbour)
    res = torch.tensor([[1.0, 1.0 + 2 * eps, 3.0e38, float("inf"), float("nan"), -1.0, 1.0, 0.0]])
    delta = torch.tensor([[eps, eps, 3.0e38, 1.0, 1.0, -eps, 1e-3, -0.0]])
    for dtype in DTYPES:
        r, d = res.to(dtype), delta.to(dtype)
        want, _ = hc.hidden_capture_reference(r, d, torch.zeros(1, 16, dtype=dtype), 1)
        buf = torch.zeros(1, 16, dtype=dtype)
        got = hc.hidden_capture_triton(r, d, buf, 1)
        assert torch.equal(got.isnan(), want.isnan()), dtype
        ok = ~want.isnan()
        assert torch.equal(got[ok], want[ok]) and torch.equal(buf[..., 8:][ok], want[ok]), (dtype, got, want)


def test_triton_launcher_rejects_strided_buffer(interpret):
    buf = torch.zeros(2, 16)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        hc.hidden_capture_triton(torch.zeros(2, 4), None, buf, 0)


# --- functional op (torch) ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_functional_torch_is_reference(dtype):
    x, h = randn(2, 3, 6, seed=1, dtype=dtype), randn(2, 3, 6, seed=2, dtype=dtype)
    buf = F.capture_buffer(x, 3)
    assert buf.shape == (2, 3, 18) and buf.dtype == dtype and not buf.any()
    x1, buf1 = F.hidden_capture(x, None, buf, 0)
    x2, buf2 = F.hidden_capture(x1, h, buf1, 2)
    want1 = hc.hidden_capture_reference(x, None, buf, 0)
    want2 = hc.hidden_capture_reference(want1[0], h, want1[1], 2)
    assert torch.equal(x2, want2[0]) and torch.equal(buf2, want2[1])
    assert not buf.any() and not buf1[..., 12:].any()  # functional


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_path_capture_is_the_residual_add_in_one_launch(interpret, monkeypatch, dtype):
    """On the GPU path (CPU tensors inside gpu.forced()) the functional op is one kernel launch per
    capture: the residual add, the slot and the copy of the other slots; bit-identical to the reference,
    and still functional (the input buffer is untouched)."""
    from builder.backends import gpu

    launches = []
    real = hc._launch
    monkeypatch.setattr(hc, "_launch", lambda *a, **k: (launches.append(k), real(*a, **k)))
    x, h = randn(2, 3, 40, seed=1, dtype=dtype, scale=30.0), randn(2, 3, 40, seed=2, dtype=dtype)
    buf = F.capture_buffer(x, 3)
    want1 = hc.hidden_capture_reference(x, None, buf, 0)
    want2 = hc.hidden_capture_reference(want1[0], h, want1[1], 2)
    with gpu.forced():
        x1, buf1 = F.hidden_capture(x, None, buf, 0)
        x2, buf2 = F.hidden_capture(x1, h, buf1, 2)
    assert len(launches) == 2 and all(k["copy_buffer"] for k in launches)
    assert torch.equal(x2, want2[0]) and torch.equal(buf2, want2[1]) and torch.equal(buf1, want1[1])
    assert not buf.any() and not buf1[..., 80:].any()


# --- TensorRT lowering ------------------------------------------------------------------------------------
def _capture_net(x, h1, h2):
    """Three capture points: the embeddings (no delta) into slot 0, then two residual adds into slots
    2 and 1 (out of order on purpose)."""
    buf = F.capture_buffer(x, 3)
    x, buf = F.hidden_capture(x, None, buf, 0)
    x, buf = F.hidden_capture(x, h1, buf, 2)
    x, buf = F.hidden_capture(x, h2, buf, 1)
    return x, buf


def _record(dtype, hidden=10):
    rec = NetworkRecorder("hidden_capture")
    rec.native_plugins = True  # interpretable everywhere: where plugin layers exist, ask for native ones
    ins = [rec.add_input(n, dtype, (-1, -1, hidden)) for n in ("x", "h1", "h2")]
    x, buf = _capture_net(*ins)
    assert isinstance(x, SymbolicTensor) and isinstance(buf, SymbolicTensor)
    assert buf.shape == (-1, -1, 3 * hidden) and buf.dtype == dtype
    rec.mark_output("hidden", x)
    rec.mark_output("aux_hidden", buf)
    return rec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recorded_network_matches_eager(dtype):
    rec = _record(dtype)
    for batch, seq in [(1, 1), (3, 5)]:
        ins = {n: randn(batch, seq, 10, seed=s, dtype=dtype) for s, n in enumerate(("x", "h1", "h2"))}
        got = run_network(rec.network, ins)
        want_x, want_buf = _capture_net(ins["x"], ins["h1"], ins["h2"])
        assert torch.equal(got["hidden"], want_x) and torch.equal(got["aux_hidden"], want_buf)
    native = rec.lowerings["hidden_capture"]
    assert native.startswith(hc.NATIVE_LOWERING) and "plugin" in native
    assert rec.lowerings["capture_buffer"].startswith("native")


def test_lowering_without_plugin_layers_is_native_and_says_why():
    rec = NetworkRecorder()
    x = rec.add_input("x", torch.float32, (-1, 4))
    _, buf = F.hidden_capture(x, x, F.capture_buffer(x, 2), 1)
    rec.mark_output("buf", buf)
    if HAS_PLUGIN_LAYERS and hc.plugin_layers_available(rec.network):  # pragma: no cover - full TensorRT
        assert rec.lowerings["hidden_capture"] == hc.PLUGIN_LOWERING
    else:
        assert not hc.plugin_layers_available(rec.network)
        assert rec.lowerings["hidden_capture"] == f"{hc.NATIVE_LOWERING} ({FLAVOUR} has no plugin layers)"


def test_lowering_errors_are_build_errors():
    rec = NetworkRecorder()
    x = rec.add_input("x", torch.float32, (-1, 4))
    with pytest.raises(BuildError, match="out of range"):
        F.hidden_capture(x, None, F.capture_buffer(x, 2), 2)
    y = rec.add_input("y", torch.float16, (-1, 4))
    with pytest.raises(BuildError, match="one dtype"):
        F.hidden_capture(x, y, F.capture_buffer(x, 2), 0)


def test_network_builds_with_build_serialized_network():
    rec = _record(torch.bfloat16, hidden=16)
    shapes = [(1, 1, 16), (2, 4, 16), (4, 8, 16)]
    engine = build_engine_bytes(rec, [{n: shapes for n in ("x", "h1", "h2")}])
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
    """Just enough of ``tensorrt.plugin`` to record what our registration declares, and to check the
    impl signature against the schema TensorRT's validator demands (inputs, attrs, outputs, stream)."""
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
    return trt, trtp, registry


class _FakeLayer:
    num_outputs = 2

    def __init__(self, call):
        self.call = call
        self.outputs = [_FakeTensor(f"out{i}", "f32", ()) for i in range(2)]
        self.name = None

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
        self.network = _FakeNetwork()
        self.lowerings = {}

    @contextlib.contextmanager
    def op(self, name, description):
        self.lowerings[name] = description
        yield self


def test_plugin_layer_path_wiring(monkeypatch):
    trt, trtp, registry = _fake_tensorrt_plugin()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(hc, "_REGISTERED", False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "tensorrt.plugin" else None)
    monkeypatch.delenv(hc.NATIVE_ENV, raising=False)

    rec = _FakeRecorder()
    res, delta, buf = (_FakeTensor(n, "bf16", s) for n, s in
                       [("res", (-1, -1, 8)), ("delta", (-1, -1, 8)), ("buf", (-1, -1, 24))])
    x, new = hc.lower(rec, trt, res, None, buf, 2)
    assert rec.lowerings == {"hidden_capture": hc.PLUGIN_LOWERING}
    layer = rec.network.layers[0]
    assert (x, new) == tuple(layer.outputs)
    kind, plugin_id, inputs, attrs = layer.call
    assert plugin_id == hc.PLUGIN_ID and inputs == (res, res, buf)  # residual stands in for delta
    assert attrs == {"slot": 2, "n_slots": 3, "hidden_size": 8, "has_delta": 0}
    hc.lower(rec, trt, res, delta, buf, 0)
    assert rec.network.layers[1].call[2] == (res, delta, buf) and rec.network.layers[1].call[3]["has_delta"] == 1

    entry = registry[hc.PLUGIN_ID]
    reg, impl = entry["register"], entry["impl"]
    # register: typed tensor descs, then int attributes in ATTRIBUTES order, two outputs
    params = inspect.signature(reg).parameters
    assert list(params) == ["residual", "delta", "buffer", *hc.ATTRIBUTES]
    assert all(params[n].annotation is _FakeDesc for n in ("residual", "delta", "buffer"))
    assert all(params[n].annotation is int for n in hc.ATTRIBUTES)
    assert [d.tag for d in reg(_FakeDesc("r"), _FakeDesc("d"), _FakeDesc("b"), 2, 3, 8, 0)] == ["r'", "b'"]
    # impl: TensorRT calls impl(*inputs, *attrs, outputs, stream=stream)
    assert list(inspect.signature(impl).parameters) == ["residual", "delta", "buffer", *hc.ATTRIBUTES,
                                                         "outputs", "stream"]
    # native layers are still available on request
    monkeypatch.setenv(hc.NATIVE_ENV, "1")
    assert hc.native_requested(rec)
