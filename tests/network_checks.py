"""What the TensorRT lowering tests share: ``check`` records a function on symbolic inputs, runs the
network on the CPU interpreter at each case and compares with the same function on torch tensors;
seeded inputs and ragged lengths."""
import torch

from builder.backends.trt_backend import NetworkRecorder
from builder.backends.trt_recorder import SymbolicTensor
from builder.interpreter import run_network

F32 = dict(rtol=1e-5, atol=1e-5)
HALF = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=3e-3, atol=3e-3)}


def _list(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


def check(fn, specs, cases, tol=F32, rec=None):
    """Record ``fn`` on inputs ``specs`` [(name, dtype, shape with -1)], compare at every case."""
    rec = rec or NetworkRecorder()
    syms = [rec.add_input(name, dtype, shape) for name, dtype, shape in specs]
    outs = _list(fn(*syms))
    for i, o in enumerate(outs):
        assert isinstance(o, SymbolicTensor)
        rec.mark_output(f"out{i}", o)
    for case in cases:
        got = run_network(rec.network, {name: v for (name, _, _), v in zip(specs, case)})
        want = _list(fn(*[v.clone() for v in case]))
        assert len(want) == len(outs)
        for i, w in enumerate(want):
            g = got[f"out{i}"]
            assert g.dtype == w.dtype, (i, g.dtype, w.dtype)
            assert g.shape == w.shape, (i, g.shape, w.shape)
            torch.testing.assert_close(g, w, **tol)
    return rec


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype)


def lengths_for(batch, seq, seed=0):
    if batch == 1:
        return torch.tensor([seq], dtype=torch.int32)
    return torch.randint(1, seq + 1, (batch,), generator=gen(seed), dtype=torch.int32).index_fill_(0, torch.tensor([0]), seq)
