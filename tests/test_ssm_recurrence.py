"""Short chunks' SSM (decode, verify, rollback) by the token-by-token recurrence, against the chunked
SSD form longer chunks use and a float64 recurrence: the same outputs within rounding, and a
rollback state equal to the verify's own state after the same rows."""
import pytest
import torch

from builder.backends import torch_backend as tb
from tests.tolerances import gamma


def _case(batch, seq, heads=4, head_dim=8, groups=2, state_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, heads, head_dim, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(batch, seq, heads, generator=g))
    A = -torch.rand(heads, generator=g) - 0.1
    B, C = (torch.randn(batch, seq, groups, state_size, generator=g) for _ in range(2))
    D = torch.randn(heads, generator=g)
    state = torch.randn(batch, heads, head_dim, state_size, generator=g)
    return x, dt, A, B, C, D, state


def _float64_recurrence(x, dt, A, B, C, D, state):
    x, dt, A, B, C, D, h = (t.double() for t in (x, dt, A, B, C, D, state))
    heads = x.shape[2]
    B, C = tb._heads(B, heads), tb._heads(C, heads)
    ys, sizes = [], []
    size = h.abs()
    for t in range(x.shape[1]):
        h = tb._ssm_update(h, x[:, t], dt[:, t], A, B[:, t])
        size = tb._ssm_update(size, x[:, t].abs(), dt[:, t], A, B[:, t].abs())   # the magnitudes summed
        ys.append((h * C[:, t, :, None, :]).sum(-1))
        sizes.append((size * C[:, t, :, None, :].abs()).sum(-1))
    return torch.stack(ys, 1) + x * D[:, None], h, torch.stack(sizes, 1) + (x * D[:, None]).abs(), size


@pytest.mark.parametrize("seq", [1, 2, 5, 8])
def test_short_chunk_recurrence_matches_the_chunked_form(seq, monkeypatch):
    case = _case(2, seq, seed=seq)
    want_y, want_h, y_size, h_size = _float64_recurrence(*case)
    n = case[4].shape[-1] + seq + 4        # terms of a y element's sums, and a few roundings per step
    y, h = tb.ssm_scan(*case, chunk_size=4)
    assert seq <= tb.RECURRENT_TOKENS
    monkeypatch.setattr(tb, "RECURRENT_TOKENS", 0)                        # every chunk through chunked SSD
    y_chunked, h_chunked = tb.ssm_scan(*case, chunk_size=4)
    for got, want, size, what in ((y, want_y, y_size, "recurrent y"), (y_chunked, want_y, y_size, "chunked y"),
                                  (h, want_h, h_size, "recurrent state"), (h_chunked, want_h, h_size, "chunked state")):
        bound = 2 * gamma(n) * size + 1e-30
        assert ((got.double() - want).abs() <= bound).all(), what
    assert not torch.equal(y, y_chunked) or seq == 1    # control: the two forms are different computations


def test_rollback_state_is_the_verify_state_after_the_same_rows():
    x, dt, A, B, C, D, state = _case(1, 5, seed=7)
    for rows in range(1, 6):
        _, h = tb.ssm_scan(x[:, :rows], dt[:, :rows], A, B[:, :rows], C[:, :rows], D, state, 4)
        kept = torch.arange(5)[None, :, None] < rows                       # rows past the accepted ones: dt 0
        assert torch.equal(tb.ssm_state(x, dt * kept, A, B, state), h), rows
