"""Float bounds derived from the dtype and the magnitudes summed, never from what one CPU printed.

Two computations of the same sum in different orders (a kernel and its reference, an interpreted
network and the eager path, a batched and a sequential pass) differ by rounding only. For a sum of n
terms in a dtype with unit roundoff u, each result lies within gamma_n * sum|terms| of the exact sum
(Higham, "Accuracy and Stability of Numerical Algorithms", 3.1), gamma_n = n u / (1 - n u), so two
orders differ by at most twice that. The bound scales with the size of the terms, not of the result:
a sum that cancels to ~0 may legitimately differ by far more than an ulp of itself."""
import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's gamma_n: the relative error bound of an n-term recursive sum or dot product."""
    nu = n * unit_roundoff(dtype)
    assert nu < 1, f"{n} terms are too many for {dtype}"
    return nu / (1 - nu)


def sum_bound(abs_terms: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elementwise bound on |order A - order B| for sums of n terms whose absolute values add up to
    ``abs_terms``: 2 gamma_n sum|terms|, plus n subnormal spacings for terms under the normal range."""
    return 2 * gamma(n, dtype) * abs_terms.double() + n * torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps


def matmul_bound(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bound on two orders of ``a @ b`` (inner dim k): from |a| @ |b|, computed in float64."""
    return sum_bound(a.double().abs() @ b.double().abs(), a.shape[-1], dtype)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound, what: str = "") -> None:
    """|got - want| <= bound elementwise (float64 comparison), naming the worst element on failure."""
    diff = (got.double() - want.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(diff)
    excess = diff - bound
    if not (excess <= 0).all():
        i = tuple(int(v) for v in torch.unravel_index(excess.argmax(), diff.shape))
        raise AssertionError(f"{what or 'tensor'}: |got - want| = {diff[i].item():.3e} exceeds its bound "
                             f"{bound[i].item():.3e} at {i} ({int((excess > 0).sum())} of {diff.numel()} elements)")


def lm_head_bound(norm_weight: torch.Tensor, lm_head: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[V] bound on two orders of the LM head's own dot products h . W_v, from the weights alone.

    h is RMS-normed then scaled by ``norm_weight``, so ||h||_2 <= sqrt(H) max|norm_weight|, and
    sum_i |h_i W_vi| <= ||h||_2 ||W_v||_2 =: S_v (Cauchy-Schwarz), which also bounds |logit_v|. The
    dot product accumulates in fp32 (2 gamma_H S_v between two orders); h and the logit are each rounded
    to ``dtype`` once more (what dominates in bf16), and two orders may round them apart: 2 u S_v each."""
    hidden = lm_head.shape[-1]
    abs_terms = hidden ** 0.5 * norm_weight.double().abs().max() * lm_head.double().norm(dim=-1)
    return sum_bound(abs_terms, hidden) + 4 * unit_roundoff(dtype) * abs_terms


# How far the measured spread between computation orders is inflated to stand for every order and CPU.
# The spread is measured where the check runs, between three orders of the same logits (decode steps,
# verify chunks, one whole-sequence chunk); another CPU's kernels (vector width, BLAS blocking, FMA or
# not) round the same sums otherwise by the same amount. Measured on the tiny targets: decode vs verify
# 0.9-1.2e-5 on an AMD EPYC (AVX2 kernels), 0.9-1.0e-5 with scalar ATen kernels and MKL's compatible
# path (ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE, standing for another CPU), and 0.9-1.7e-5 between
# the two setups: within 1.5x of one machine's spread, so 8x leaves room. No factor stands for a
# discontinuity upstream (an MoE router's top-k flipping on a near-tie of its own): that shows up as a
# large spread, failing the check.
SPREAD_FACTOR = 8.0


def logit_order_bound(head_bound: torch.Tensor, spread: float, factor: float = SPREAD_FACTOR) -> torch.Tensor:
    """[V] bound on |logit_v(order A) - logit_v(order B)|: the LM head's own rounding (rigorous, see
    lm_head_bound) plus ``factor`` times the measured spread of the upstream hidden state's rounding."""
    return head_bound.double() + factor * float(spread)


def min_top2_gaps(logits: torch.Tensor, bound: torch.Tensor):
    """Per row of ``logits`` [..., V]: (top1 - top2 gap, bound[top1] + bound[top2]) with ``bound`` the
    per-logit bound ([V] or logits' shape): what the gap must exceed for the argmax to be the same in
    every order the bound covers."""
    values, index = logits.double().topk(2, dim=-1)
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(logits)  # [V] or one per logit
    return values[..., 0] - values[..., 1], bound.gather(-1, index).sum(-1)


def assert_no_near_tie(logits: torch.Tensor, tokens: torch.Tensor, bound: torch.Tensor, what: str = "") -> float:
    """Each row's argmax is ``tokens`` and beats the runner-up by more than the two logits' bounds.

    Returns the smallest gap / needed ratio (> 1 when it passes), for reports."""
    gap, need = min_top2_gaps(logits, bound)
    if not torch.equal(logits.argmax(-1), tokens.to(logits.device).long()):
        bad = tuple(int(v) for v in (logits.argmax(-1) != tokens.long()).nonzero()[0])
        raise AssertionError(f"{what or 'logits'}: the argmax at {bad} is not the reference token "
                             f"(gap {gap[bad].item():.3e}, bound {need[bad].item():.3e})")
    ratio = gap / need
    if not (ratio > 1).all():
        i = tuple(int(v) for v in torch.unravel_index(ratio.argmin(), ratio.shape))
        raise AssertionError(f"{what or 'logits'}: a near-tie at {i}: top1 - top2 = {gap[i].item():.3e} is within "
                             f"the bound {need[i].item():.3e} on how far two computation orders may move them; "
                             f"choose other inputs")
    return float(ratio.min())
