"""Distilling each draft kind from the target's greedy sequences and hidden states.

Every draft is trained through the very module the builder compiles (``builder.models.*``, run
eagerly with torch autograd): its weights are leaf tensors bound at construction, so what is
trained is exactly what is built and served. Labels are the target's own argmax choices (what greedy
speculation must reproduce); the loss is cross entropy on them.

* chain drafts (eagle, eagle3, mtp): step 1 reads the target's features; steps 2..S recycle the
  draft's own hidden state (training-time test), shifted one position per step.
* dflash / dspark: anchors inside the target's continuation; the context K/V of the whole sequence
  is written once and shared by every anchor's block; dspark adds its Markov bias on the previous
  (teacher-forced) token.
* peagle: the catch-up rows (EAGLE-3 loss) plus, per anchor, its K-1 placeholder rows.
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as tf

from runtime.state import allocate
from training.distill_data import DistillData

STEP_WEIGHTS = (1.0, 0.8, 0.6, 0.4)  # later positions matter less: acceptance stops at the first miss


def init_weights(shapes: dict, target_weights: dict, seed: int) -> dict:
    """Trainable fp32 leaves: LM head / embedding from the target, norms 1, biases 0, Markov W2 0,
    the rest N(0, 0.02)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        if name == "lm_head.weight" and "lm_head.weight" in target_weights:
            value = target_weights["lm_head.weight"].float().clone()
        elif name == "embed_tokens.weight":
            value = target_weights["backbone.embeddings.weight"].float().clone()
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            value = torch.ones(shape)
        elif name.endswith(".bias") or name == "markov_head.markov_w2.weight":
            value = torch.zeros(shape)
        elif name == "d2t":
            value = torch.zeros(shape, dtype=torch.long)
        else:
            value = torch.randn(shape, generator=g) * 0.02
        out[name] = value if not value.is_floating_point() else value.requires_grad_(True)
    return out


def _rows(batch: int, rows: int, start=0):
    return torch.arange(rows, dtype=torch.int32).repeat(batch, 1) + start


def _full(batch: int, value: int):
    return torch.full((batch,), value, dtype=torch.int32)


def chain_loss(module, kind: str, tokens, labels, features, steps: int = 4):
    """Training-time-test loss of a chain draft over sequences [B, T] and their features [B, T, F]."""
    batch, length = tokens.shape
    state = allocate(module.state_spec(batch, length))
    total, weight, hidden, first_acc = 0.0, 0.0, None, None
    for s in range(steps):
        rows = length - 1 - s
        ids = tokens[:, 1 + s:].to(torch.int32)
        positions = _rows(batch, rows, s)
        index = _rows(batch, rows)
        step_state = {n: v.clone() for n, v in state.items()} if s else state
        if kind == "eagle3":
            aux = features[:, :rows] if s == 0 else torch.zeros(batch, rows, features.shape[-1])
            own = torch.zeros(batch, rows, module.hidden_size) if s == 0 else hidden[:, :rows]
            flag = torch.full((batch, rows), 1 if s == 0 else 0, dtype=torch.int32)
            logits, out, new_state = module.forward(ids, aux, own, flag, positions, _full(batch, rows), index,
                                                    step_state)
        else:
            feed = features[:, :rows] if s == 0 else hidden[:, :rows]
            logits, out, new_state = module.forward(ids, feed, positions, _full(batch, rows), index, step_state)
        if s == 0:
            state = {n: v.detach() for n, v in new_state.items()}
        target = labels[:, 1 + s:]
        total = total + STEP_WEIGHTS[s] * tf.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        weight += STEP_WEIGHTS[s]
        if s == 0:
            first_acc = (logits.argmax(-1) == target).float().mean().item()
        hidden = out
    return total / weight, first_acc


def _anchors(batch: int, per_seq: int, low: int, high: int, g: torch.Generator):
    """[batch * per_seq] anchor positions in [low, high]."""
    return torch.randint(low, high + 1, (batch * per_seq,), generator=g)


def block_loss(module, tokens, aux, prompt_len: int, k: int, per_seq: int, g):
    """DFlash / DSpark loss: K block predictions per anchor, anchors in the target's continuation."""
    batch, length = tokens.shape
    state = allocate(module.state_spec(batch, length))
    context = module.append_context(aux, _rows(batch, length), _full(batch, length), state)
    anchors = _anchors(batch, per_seq, prompt_len - 1, length - 1 - k, g)
    seq = torch.arange(batch).repeat_interleave(per_seq)
    context = {n: v.repeat_interleave(per_seq, 0) for n, v in context.items()}
    ids, positions, lengths, index = module.block_inputs(tokens[seq, anchors], anchors, k)
    logits, _ = module.block(ids, positions, lengths, index, context)
    offsets = torch.arange(k)
    target = tokens[seq[:, None], anchors[:, None] + 1 + offsets]              # [N, K]: x_{a+1..a+K}
    if getattr(module, "has_markov", False):
        logits = module.markov_logits(logits, tokens[seq[:, None], anchors[:, None] + offsets])
    return _weighted_block_ce(logits, target)


def _weighted_block_ce(logits, target):
    k = target.shape[1]
    w = torch.tensor([0.85 ** j for j in range(k)])
    ce = tf.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none").view(-1, k)
    acc = (logits.argmax(-1) == target).float()[:, 0].mean().item()
    return (ce * w).sum(1).mean() / w.sum(), acc


def peagle_loss(module, tokens, labels, aux, prompt_len: int, k: int, per_seq: int, g):
    """P-EAGLE: catch-up rows (EAGLE-3's first step) + per anchor its K-1 placeholder rows."""
    batch, length = tokens.shape
    rows = length - 1
    state = allocate(module.state_spec(batch, rows))
    zeros = torch.zeros(batch, rows, dtype=torch.int32)
    logits, state = module.forward(tokens[:, 1:].to(torch.int32), aux[:, :rows], zeros, _rows(batch, rows),
                                   _full(batch, rows), _rows(batch, rows), state)
    first = tf.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    first_acc = (logits.argmax(-1) == labels[:, 1:]).float().mean().item()
    # anchor row n-1 (token x_n); placeholder d = 1..K-1 at position n-1+d predicts x_{n+1+d}
    last = _anchors(batch, per_seq, prompt_len - 1, length - 1 - k, g)      # n
    seq = torch.arange(batch).repeat_interleave(per_seq)
    n_items = seq.numel()
    shared = {name: v.repeat_interleave(per_seq, 0) for name, v in state.items()}
    places = k - 1
    positions = (last - 1)[:, None].to(torch.int32) + 1 + torch.arange(places, dtype=torch.int32)
    plogits, _ = module.forward(torch.zeros(n_items, places, dtype=torch.int32),
                                torch.zeros(n_items, places, aux.shape[-1]),
                                torch.ones(n_items, places, dtype=torch.int32), positions,
                                _full(n_items, places), _rows(n_items, places), shared)
    target = tokens[seq[:, None], last[:, None] + 2 + torch.arange(places)]
    rest, _ = _weighted_block_ce(plogits, target)
    return (first + rest) / 2, first_acc


def train_draft(loss_fn, params: list, steps: int, peak_lr: float, label: str, log=print, eval_fn=None,
                eval_every: int = 100) -> list[dict]:
    """AdamW + warmup/cosine over ``loss_fn(step) -> (loss, first-token accuracy)``."""
    opt = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.0)
    curve, start, running, acc_avg = [], time.time(), None, None
    warmup = max(1, steps // 20)
    for step in range(steps):
        lr = peak_lr * ((step + 1) / warmup if step < warmup else
                        0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))
        for group in opt.param_groups:
            group["lr"] = lr
        loss, acc = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        acc_avg = acc if acc_avg is None else 0.9 * acc_avg + 0.1 * acc
        if (step + 1) % eval_every == 0 or step == steps - 1:
            point = {"step": step + 1, "train_loss": round(running, 4), "train_first_token_accuracy": round(acc_avg, 4),
                     "seconds": round(time.time() - start, 1)}
            if eval_fn is not None:
                with torch.no_grad():
                    vloss, vacc = eval_fn()
                point.update(valid_loss=round(float(vloss), 4), valid_first_token_accuracy=round(vacc, 4))
            curve.append(point)
            log(f"{label} step {step + 1}/{steps} " + " ".join(f"{k} {v}" for k, v in point.items() if k != "step"))
    return curve


def batches(data: DistillData, batch: int, g: torch.Generator, limit: int):
    """Random sequence indices [batch] among the first ``limit`` sequences (the rest are validation)."""
    return torch.randint(0, limit, (batch,), generator=g)
