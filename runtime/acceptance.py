"""Which draft tokens the target keeps.

Greedy: the longest prefix of the draft that equals the target's argmax, plus the target's own
next token (exact: the output is the target's greedy output). Sampling: rejection sampling
(Leviathan et al. 2023): draft token d_i drawn from q_i is kept with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn from norm(max(p_i - q_i, 0));
if all are kept the bonus comes from p_{K+1}. The output is distributed exactly as target sampling.
"""
from __future__ import annotations

import torch

from runtime.sampling import SamplingParams, probabilities


def greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor, limit: torch.Tensor | None = None):
    """draft_tokens [B, K], target_logits [B, K+1, V] -> (accepted drafts m [B], next token [B]).
    ``limit`` [B]: at most this many drafts count (a chunk right-padded past its real drafts)."""
    best = target_logits.argmax(-1)                                   # [B, K+1]
    agree = (draft_tokens == best[:, :-1]).long()
    m = agree.cumprod(1).sum(1)
    if limit is not None:
        m = torch.minimum(m, limit.to(m.dtype))
    return m, best.gather(1, m[:, None])[:, 0]


def rejection(draft_tokens, draft_probs, target_logits, temperature, top_p, generator=None, top_k=0):
    """draft_probs [B, K, V] is q (the distribution each draft token was drawn from)."""
    p = probabilities(target_logits, temperature, top_p, top_k).cpu()  # [B, K+1, V]
    q = draft_probs.float().cpu()
    d = draft_tokens.long().cpu()
    batch, k = d.shape
    p_d = p[:, :k].gather(2, d[..., None])[..., 0]
    q_d = q.gather(2, d[..., None])[..., 0]
    u = torch.rand(batch, k, generator=generator)
    keep = (u * q_d < p_d).long()                                      # u < p/q without dividing by 0
    m = keep.cumprod(1).sum(1)
    rows = torch.arange(batch)
    target_row = p[rows, m]                                            # [B, V]
    residual = torch.clamp(target_row - torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, m], min=0)
    residual = torch.where(m[:, None] < k, residual, target_row)       # all kept: bonus from p_{K+1}
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_row)
    token = torch.multinomial(residual, 1, generator=generator)[:, 0]
    return m.to(draft_tokens.device), token.to(draft_tokens.device)


def accept(draft_tokens, draft_probs, target_logits, params: list[SamplingParams], lengths=None):
    """Per row: greedy acceptance, or rejection sampling with the row's own settings and generator.

    ``lengths`` [B] (optional): row b proposed only its first lengths[b] drafts (the rest of its
    chunk is padding): it accepts at most those, and if it keeps them all its bonus token comes from
    the target at row lengths[b], exactly as if the step had drafted lengths[b] tokens."""
    m, nxt = greedy(draft_tokens, target_logits)
    if lengths is not None:
        m = torch.minimum(m, lengths.to(m.device))
        nxt = target_logits.argmax(-1).gather(1, m[:, None])[:, 0]
    for row, prm in enumerate(params):
        if prm.temperature:
            n = draft_tokens.shape[1] if lengths is None else int(lengths[row])
            if n == 0:   # it proposed nothing (its own K = 0, or under the acceptance floor): a decode's draw
                p0 = probabilities(target_logits[row, 0], prm.temperature, prm.top_p, prm.top_k).cpu()
                m[row], nxt[row] = 0, torch.multinomial(p0, 1, generator=prm.generator)[0].to(nxt.device)
                continue
            r = slice(row, row + 1)
            m_r, t_r = rejection(draft_tokens[r, :n], draft_probs[r, :n], target_logits[r, :n + 1], prm.temperature,
                                 prm.top_p, prm.generator, prm.top_k)
            m[row], nxt[row] = m_r[0], t_r[0]
    return m, nxt
