"""Token choice from logits: greedy, temperature, top-k and nucleus (top-p) sampling, per sequence."""
from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5     # vLLM's _SAMPLING_EPS
_M64 = (1 << 64) - 1


def seeded_generator(seed: int | None) -> torch.Generator | None:
    """The CPU generator of a 64-bit seed (``random_seed`` is UINT64, as in TensorRT-LLM). torch's CPU
    generator (mt19937) keeps a seed's low 32 bits, so S and S + 2^32 drew one stream: the high half
    is mixed in (splitmix64's finalizer) and folded onto the low half. A seed under 2^32 keeps its
    stream; two seeds still share one with chance 2^-32, not by construction."""
    if seed is None:
        return None
    low, high = seed & 0xFFFFFFFF, seed >> 32
    if high:
        h = (high * 0x9E3779B97F4A7C15) & _M64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M64
        h ^= h >> 31
        low ^= (h ^ (h >> 32)) & 0xFFFFFFFF
    return torch.Generator().manual_seed(low)


# vLLM's --logprobs-mode names: the distribution a token was drawn from (after penalties, temperature,
# top-k and top-p; TensorRT-LLM's values, the default), or the model's own log-softmax (vLLM's default)
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


@dataclass
class SamplingParams:
    """How one sequence chooses tokens. Rows may share a generator (offline batches draw in order)."""
    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    banned: tuple[int, ...] = ()        # token ids whose logits are forced to -inf
    top_k: int = 0                      # 0: no top-k cut
    repetition_penalty: float = 1.0     # TensorRT-LLM's three penalties over prompt + generated tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_length: int = 0                 # end ids are banned until this many tokens were generated
    logprobs: bool = False              # record each generated token's log-probability
    bad_sequences: tuple[tuple[int, ...], ...] = ()   # a sequence's last token is banned after the rest
    top_logprobs: int = 0               # with logprobs: also each position's most probable tokens
    raw_logprobs: bool = False          # log-probabilities of the model's own distribution (the log-softmax of
                                        # its logits: vLLM's raw_logprobs), not of the one a token is drawn from
    prompt_ignore_length: int = 0       # the first prompt tokens presence and frequency leave out (TensorRT-LLM's
                                        # field; OpenAI's and vLLM's penalties count generated tokens only)

    def __post_init__(self):
        # as vLLM: a temperature below GREEDY_BELOW is greedy, the limit it tends to (logits / 1e-38
        # overflow fp32 and the softmax turns NaN)
        if 0 < self.temperature < GREEDY_BELOW:
            self.temperature = 0.0

    @property
    def uses_history(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_length > 0 or bool(self.bad_sequences))

    @property
    def argmax(self) -> bool:
        """Its draft tokens are the argmax of the draft's logits (greedy, nothing banned): what the
        fused proposal graphs compute."""
        return not self.temperature and not self.banned

    @property
    def plain_greedy(self) -> bool:
        """Its next token is the argmax of the target's raw logits (nothing shapes them): what the
        fused verify + accept graph computes."""
        return self.argmax and not self.uses_history


def top_probability(logits: torch.Tensor) -> torch.Tensor:
    """The probability of each row's argmax token [...] (a greedy draft's confidence in its token)."""
    return torch.softmax(logits.float(), -1).amax(-1)


def probabilities(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T) restricted to the top-k tokens, then
    to the top-p nucleus."""
    logits = logits.float()
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def choose(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """[..., V] logits -> [...] token ids, one setting for every row. Temperature 0 is greedy."""
    if not temperature:
        return logits.argmax(-1)
    probs = probabilities(logits, temperature, top_p)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat.cpu(), 1, generator=generator).reshape(probs.shape[:-1]).to(logits.device)


def ban(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [B, ..., V] with each row's banned tokens at -inf (a copy only when something is banned)."""
    if not any(p.banned for p in params):
        return logits
    logits = logits.clone()
    for row, p in enumerate(params):
        if p.banned:
            logits[row, ..., list(p.banned)] = float("-inf")
    return logits


def draw(logits: torch.Tensor, params: list[SamplingParams]):
    """[B, V] -> (tokens [B], q [B, V] or None): each row greedy or sampled by its own settings;
    q holds, for sampled rows, the distribution the token was drawn from (rejection sampling's q)."""
    logits = ban(logits, params)
    tokens = logits.argmax(-1)
    q = None
    for row, p in enumerate(params):
        if p.temperature:
            if q is None:
                q = torch.zeros(logits.shape, dtype=torch.float32)
            q[row] = probabilities(logits[row], p.temperature, p.top_p, p.top_k).cpu()
            tokens[row] = torch.multinomial(q[row], 1, generator=p.generator)[0].to(tokens.device)
    return tokens, q
