"""Token choice from logits: greedy, temperature and nucleus (top-p) sampling."""
from __future__ import annotations

import torch


def probabilities(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T) restricted to the top-p nucleus."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def choose(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """[..., V] logits -> [...] token ids. Temperature 0 is greedy (argmax)."""
    if not temperature:
        return logits.argmax(-1)
    probs = probabilities(logits, temperature, top_p)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat.cpu(), 1, generator=generator).reshape(probs.shape[:-1]).to(logits.device)
