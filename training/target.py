"""Pre-training the tiny NemotronH target with transformers' own implementation (the reference).

transformers builds, trains and writes the model, so the checkpoint is a plain Hugging Face
NemotronH directory. Every block kind is present: Mamba-2, attention, MLP and MoE.
"""
from __future__ import annotations

import math
import time

import torch

TARGET_CONFIG = dict(
    vocab_size=2048, hidden_size=192, num_hidden_layers=8, hybrid_override_pattern="M-M*MEM-",
    num_attention_heads=6, num_key_value_heads=2, head_dim=32, intermediate_size=768,
    mamba_num_heads=6, mamba_head_dim=64, ssm_state_size=32, n_groups=1, conv_kernel=4, chunk_size=64,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, n_shared_experts=1,
    moe_shared_expert_intermediate_size=384, n_group=1, topk_group=1, routed_scaling_factor=1.0,
    norm_topk_prob=True, layer_norm_epsilon=1e-5, max_position_embeddings=4096,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
)


def build_target(seed: int, **overrides):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    config = NemotronHConfig(**{**TARGET_CONFIG, **overrides}, dtype="float32")
    model = NemotronHForCausalLM(config).to(torch.float32)
    model.config.time_step_min = 0.0
    return model


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def evaluate(model, stream: torch.Tensor, length: int, windows: int = 16) -> float:
    """Mean next-token cross entropy over fixed, evenly spaced validation windows."""
    starts = torch.linspace(0, stream.numel() - length - 2, windows).long().tolist()
    x = torch.stack([stream[s:s + length + 1] for s in starts])
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=x[:, :-1]).logits
    model.train()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item()


def train(model, data, valid: torch.Tensor, steps: int, length: int, peak_lr: float = 3e-3,
          log=print, eval_every: int = 50) -> list[dict]:
    """AdamW with warmup + cosine decay; returns the loss curve [{step, train_loss, valid_loss, seconds}]."""
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.05)
    model.train()
    curve, start, running = [], time.time(), None
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup=max(1, steps // 20))
        x = next(data)
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        if (step + 1) % eval_every == 0 or step == steps - 1:
            point = {"step": step + 1, "train_loss": round(running, 4),
                     "valid_loss": round(evaluate(model, valid, length), 4),
                     "seconds": round(time.time() - start, 1)}
            curve.append(point)
            log(f"target step {point['step']}/{steps} train {point['train_loss']:.3f} "
                f"valid {point['valid_loss']:.3f} ({point['seconds']:.0f} s)")
    model.eval()
    return curve
