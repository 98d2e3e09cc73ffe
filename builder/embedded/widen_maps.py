"""Index maps that widen a NemotronH checkpoint K times while keeping the function it computes.

Every widened unit is a copy of one trained unit: a wide tensor is the trained one indexed by a map
per dimension (``wide = trained[out_map][:, in_map]``), and a linear map's input side, which now sums
K copies of each input, is divided by K. Copies are laid out so the model's own grouping still holds:
hidden units, MLP and expert units tile (K copies of the trained vector side by side); attention heads
tile whole heads, so wide query head ``a*Hq + j`` falls in the group of wide KV head ``a*Hkv + j//r``,
copy ``a`` of its trained pair; Mamba heads tile within each B/C group, so a wide group's contiguous
channels (the gated norm's group) are copies of the trained group's heads. Means over a widened
dimension (RMSNorm, the gated norm) are unchanged; B/C groups, head dims and the vocabulary stay.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch


def tiled(n: int, k: int) -> torch.Tensor:
    """K copies of ``range(n)`` side by side."""
    return torch.arange(n).repeat(k)


def heads_to_units(heads: torch.Tensor, width: int) -> torch.Tensor:
    """Per-head map -> per-channel map for heads of ``width`` channels each."""
    return (heads[:, None] * width + torch.arange(width)).flatten()


def grouped_heads(heads: int, groups: int, k: int) -> torch.Tensor:
    """Heads tiled K times inside each of ``groups`` contiguous groups."""
    per = heads // groups
    return torch.cat([g * per + tiled(per, k) for g in range(groups)])


def segments(maps: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """Maps of consecutive segments of one dimension, each offset by the trained sizes before it."""
    out, offset = [], 0
    for m, size in zip(maps, sizes):
        out.append(m + offset)
        offset += size
    return torch.cat(out)


@dataclass(frozen=True)
class Rule:
    """How one tensor widens: maps for its first two dims (None: unchanged) and whether its input
    side (dim 1) sums widened inputs, so is divided by K."""
    out: torch.Tensor | None = None
    inp: torch.Tensor | None = None
    divide: bool = False


def apply(t: torch.Tensor, rule: Rule, k: int) -> torch.Tensor:
    if rule.out is not None:
        t = t.index_select(0, rule.out)
    if rule.inp is not None:
        t = t.index_select(1, rule.inp)
    if rule.divide:
        # K a power of two: exact in the tensor's own dtype; otherwise divided in fp32 and kept so
        t = t / k if (k & (k - 1)) == 0 else t.float() / k
    return t.contiguous()


class TargetMaps:
    """The maps of one NemotronH config (an HF config.json dict) widened K times."""

    def __init__(self, cfg: dict, k: int):
        self.k = k
        D, P = cfg["hidden_size"], cfg["mamba_head_dim"]
        H, G, N = cfg["mamba_num_heads"], cfg["n_groups"], cfg["ssm_state_size"]
        Hq, Hkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        if H % G:
            raise ValueError(f"mamba_num_heads {H} is not a multiple of n_groups {G}")
        self.D = D
        self.hidden = tiled(D, k)
        self.mamba_heads = grouped_heads(H, G, k)
        inner = heads_to_units(self.mamba_heads, P)
        di = H * P
        self.mamba_inner = inner
        self.conv = segments([inner, torch.arange(2 * G * N)], [di, 2 * G * N])
        self.in_proj = segments([inner, self.conv, self.mamba_heads], [di, di + 2 * G * N, H])
        self.q = heads_to_units(tiled(Hq, k), hd)
        self.kv = heads_to_units(tiled(Hkv, k), hd)
        self.mlp = tiled(cfg["intermediate_size"], k)
        self.expert = tiled(cfg["moe_intermediate_size"], k)
        self.shared = tiled(cfg.get("moe_shared_expert_intermediate_size") or 1, k)

    def features(self, count: int) -> torch.Tensor:
        """``count`` hidden states side by side (an EAGLE-3/DFlash fc input, an MTP eh_proj input)."""
        return segments([self.hidden] * count, [self.D] * count)

    def rule(self, name: str) -> Rule:
        """The rule of a target tensor name (backbone.*, lm_head, mtp.*); KeyError if none fits."""
        h = self.hidden
        if name == "backbone.embeddings.weight":
            return Rule(inp=h)
        if name == "lm_head.weight":
            return Rule(inp=h, divide=True)
        leaf = re.sub(r"^(backbone|mtp)\.layers\.\d+\.", "", name)
        if leaf in ("norm.weight", "enorm.weight", "hnorm.weight", "final_layernorm.weight") \
                or name == "backbone.norm_f.weight":
            return Rule(out=h)
        if leaf == "eh_proj.weight":
            return Rule(out=h, inp=self.features(2), divide=True)
        mixer = {
            "mixer.in_proj.weight": Rule(out=self.in_proj, inp=h, divide=True),
            "mixer.conv1d.weight": Rule(out=self.conv), "mixer.conv1d.bias": Rule(out=self.conv),
            "mixer.A_log": Rule(out=self.mamba_heads), "mixer.D": Rule(out=self.mamba_heads),
            "mixer.dt_bias": Rule(out=self.mamba_heads), "mixer.norm.weight": Rule(out=self.mamba_inner),
            "mixer.out_proj.weight": Rule(out=h, inp=self.mamba_inner, divide=True),
            "mixer.q_proj.weight": Rule(out=self.q, inp=h, divide=True),
            "mixer.k_proj.weight": Rule(out=self.kv, inp=h, divide=True),
            "mixer.v_proj.weight": Rule(out=self.kv, inp=h, divide=True),
            "mixer.o_proj.weight": Rule(out=h, inp=self.q, divide=True),
            "mixer.gate.weight": Rule(inp=h, divide=True),
            "mixer.gate.e_score_correction_bias": Rule(),
        }
        if leaf in mixer:
            return mixer[leaf]
        m = re.fullmatch(r"mixer\.(experts\.\d+\.|shared_experts\.|)(up|down)_proj\.weight", leaf)
        if m:
            units = {"": self.mlp, "shared_experts.": self.shared}.get(m.group(1), self.expert)
            return Rule(out=units, inp=h, divide=True) if m.group(2) == "up" else Rule(out=h, inp=units, divide=True)
        raise KeyError(name)


def widen_target_config(cfg: dict, k: int) -> dict:
    out = dict(cfg)
    for key in ("hidden_size", "intermediate_size", "mamba_num_heads", "num_attention_heads", "num_key_value_heads",
                "moe_intermediate_size", "moe_shared_expert_intermediate_size"):
        if out.get(key):
            out[key] = int(out[key]) * k
    return out
