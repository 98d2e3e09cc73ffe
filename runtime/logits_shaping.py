"""What each sequence's settings do to the target's logits before a token is chosen or verified.

Banned tokens, and bad words of several tokens (the last banned where the history ends with the
rest, as TensorRT-LLM's bad_words and transformers' bad_words_ids do); TensorRT-LLM's repetition,
presence and frequency penalties (over the prompt and every token before the position scored, less
the first ``prompt_ignore_length`` prompt tokens for presence and frequency; presence and frequency
after the temperature, as its sampling kernel applies them);
``min_length`` (end ids banned while fewer tokens were generated).
A verify chunk's row j is shaped with the history that row continues: the sequence so far plus the
first j drafts, so speculation samples from exactly the distribution target-only decoding would, and
greedy speculation stays equal to greedy target-only decoding. Log-probabilities of chosen tokens
are taken from the same shaped distribution.
"""
from __future__ import annotations

import torch

from runtime.sampling import SamplingParams, probabilities


def _penalise(row: torch.Tensor, counts: torch.Tensor, p: SamplingParams, ignored: torch.Tensor | None = None):
    """TensorRT-LLM's order: the additive penalties come off the temperature-scaled logits (l/T - p),
    so on these unscaled logits, which the sampler divides by T later, they count T times (greedy:
    once). The repetition penalty scales, so its place in the order makes no difference. ``ignored``:
    the counts of the prompt tokens the additive penalties leave out (``prompt_ignore_length``)."""
    if p.repetition_penalty != 1.0:
        scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row = torch.where(counts > 0, scaled, row)
    if ignored is not None:
        counts = counts - ignored
    scale = p.temperature or 1.0
    # where(), not a product with the 0/1 mask: a penalty scaled past fp32's range (temperature 1e38)
    # made inf * 0 = NaN on every unseen token, and the NaN row failed the whole batch's draw
    if p.presence_penalty:
        row = torch.where(counts > 0, row - scale * p.presence_penalty, row)
    if p.frequency_penalty:
        row = torch.where(counts > 0, row - (scale * p.frequency_penalty) * counts, row)
    return row


def _ignored(s, vocab: int, like: torch.Tensor) -> torch.Tensor | None:
    """Counts of the prompt tokens ``s``'s presence and frequency penalties leave out, None for none."""
    n = min(s.params.prompt_ignore_length, len(s.prompt))
    return torch.bincount(torch.tensor(s.prompt[:n], dtype=torch.long), minlength=vocab).to(like) if n else None


def _ban_bad_sequences(row: torch.Tensor, history: list, p: SamplingParams) -> None:
    """Bans each bad sequence's last token in ``row`` [V] where ``history`` ends with the rest."""
    for word in p.bad_sequences:
        head = list(word[:-1])
        if len(history) >= len(head) and history[len(history) - len(head):] == head:
            row[word[-1]] = float("-inf")


def shape(logits: torch.Tensor, seqs, drafts: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, T, V] for the next T positions of each sequence (T = 1 for a decode step; a verify
    chunk's rows follow ``drafts`` [B, T-1]) -> shaped logits (a copy only when something applies)."""
    params = [s.params for s in seqs]
    if not any(p.banned or p.uses_history for p in params):
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for b, s in enumerate(seqs):
        p = s.params
        if p.banned:
            logits[b, :, list(p.banned)] = float("-inf")
        if not p.uses_history:
            continue
        following = [] if drafts is None else drafts[b].tolist()
        counts = torch.bincount(torch.tensor(s.prompt + s.outputs, dtype=torch.long), minlength=vocab).to(logits)
        ignored = _ignored(s, vocab, logits)
        for t in range(logits.shape[1]):
            if t:
                counts[following[t - 1]] += 1
            logits[b, t] = _penalise(logits[b, t], counts, p, ignored)
            if len(s.outputs) + t < p.min_length and s.end_ids:
                logits[b, t, list(s.end_ids)] = float("-inf")
            if p.bad_sequences:
                _ban_bad_sequences(logits[b, t], s.prompt + s.outputs + following[:t], p)
    return logits


def shape_tree(logits: torch.Tensor, seqs, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor):
    """A tree verify's logits [B, T, V]: row r is shaped with the history its root path continues
    (the sequence so far plus the drafted tokens from the root's child down to r)."""
    from runtime.tree.paths import ancestors
    params = [s.params for s in seqs]
    if not any(p.banned or p.uses_history for p in params):
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    drafted = ancestors(parents)
    drafted[:, :, 0] = False                                     # the root's token is already in the history
    for b, s in enumerate(seqs):
        p = s.params
        if p.banned:
            logits[b, :, list(p.banned)] = float("-inf")
        if not p.uses_history:
            continue
        history = torch.bincount(torch.tensor(s.prompt + s.outputs, dtype=torch.long), minlength=vocab).to(logits)
        ignored = _ignored(s, vocab, logits)
        for r in range(logits.shape[1]):
            path = tokens[b][drafted[b, r]]                       # root's child .. r (parents come first)
            counts = history + torch.bincount(path.long(), minlength=vocab).to(logits)
            logits[b, r] = _penalise(logits[b, r], counts, p, ignored)
            if len(s.outputs) + int(depth[b, r]) < p.min_length and s.end_ids:
                logits[b, r, list(s.end_ids)] = float("-inf")
            if p.bad_sequences:
                _ban_bad_sequences(logits[b, r], s.prompt + s.outputs + path.tolist(), p)
    return logits


def _log_distribution(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[T, V] shaped logits -> the log of the distribution a row's tokens are drawn from (temperature,
    top-k, top-p for sampled rows; the softmax for greedy ones); with ``raw_logprobs`` the rows are the
    model's own logits and this is their log-softmax."""
    row = row.float()
    if p.raw_logprobs:
        return torch.log_softmax(row, -1)
    probs = probabilities(row, p.temperature, p.top_p, p.top_k) if p.temperature else torch.softmax(row, -1)
    return torch.log(probs)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> list[list[float]]:
    """logits [B, T, V] (shaped), tokens [B, T] -> each row's log-probabilities of its tokens under
    the distribution they were chosen from. Rows that did not ask get an empty list."""
    out = []
    for b, p in enumerate(params):
        if not p.logprobs:
            out.append([])
            continue
        logp = _log_distribution(logits[b], p)
        out.append(logp.gather(-1, tokens[b].long()[:, None].to(logp.device))[:, 0].tolist())
    return out


def top_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> list[list[list[tuple[int, float]]] | None]:
    """logits [B, T, V] (shaped) -> per row that asked (``top_logprobs`` > 0), each position's most
    probable tokens under that same distribution, as (id, log-probability), most probable first (those
    it gives probability 0, past a top-k or top-p cut, left out); None for the other rows."""
    out = []
    for b, p in enumerate(params):
        if not (p.logprobs and p.top_logprobs):
            out.append(None)
            continue
        top = _log_distribution(logits[b], p).topk(min(p.top_logprobs, logits.shape[-1]), dim=-1)
        out.append([[(t, v) for t, v in zip(ids, values) if v > float("-inf")]
                    for ids, values in zip(top.indices.tolist(), top.values.tolist())])
    return out
