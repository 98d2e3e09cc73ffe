"""How many tokens to draft, step by step: by batch size, by the draft's confidence, by acceptance.

Three controls, each exact whatever K it picks (acceptance only ever keeps verified tokens):

* ``draft_len_schedule`` (TensorRT-LLM's name and meaning): {max batch size: K}; a step with batch
  size b drafts the K of the smallest key >= b, and 0 (target-only) past the largest key. ``auto``:
  measured where it runs (``runtime.draft_len.calibrate_schedule``: each batch size's step costs and
  acceptance, K = 0 where no K is predicted to pay), by whoever loads the model (generate, serve).
* ``draft_confidence_threshold``: a sequence verifies its drafts up to the first whose draft
  probability is under it (greedy rows still draft K in one call and verify the confident prefix;
  sampled chain drafts stop running their draft).
* ``acceptance_rate_threshold`` over ``acceptance_rate_window_size`` speculative steps (TensorRT-LLM's
  names): once a sequence's rolling accepted / drafted ratio falls under it, that sequence decodes
  target-only for the rest of the request.
* ``draft_len_adaptive``: each sequence drafts, step by step, the K its own recent acceptance and the
  group's measured step costs predict fastest (``runtime.adaptive_draft_len``), up to the K above.
"""
from __future__ import annotations

from argparse import ArgumentTypeError
from collections import deque
from dataclasses import dataclass, field

import torch

from builder.errors import NemospecError
from runtime.adaptive_draft_len import SequenceRate


AUTO_SCHEDULE = "auto"


def parse_schedule(text: str | None) -> dict[int, int]:
    """'1:4,4:3,8:2,16:0' -> {1: 4, 4: 3, 8: 2, 16: 0} ('auto': {} until calibrated); a one-line error
    naming the flag otherwise."""
    if not text or text == AUTO_SCHEDULE:
        return {}
    out = {}
    for item in text.split(","):
        try:
            batch, k = (int(v) for v in item.split(":"))
        except ValueError:
            raise NemospecError(f"--draft_len_schedule: expected 'batch:K,batch:K,...', got {item!r}") from None
        if batch < 1 or k < 0:
            raise NemospecError(f"--draft_len_schedule: batch sizes must be >= 1 and K >= 0, got {item!r}")
        out[batch] = k
    return dict(sorted(out.items()))


@dataclass
class DraftPolicy:
    draft_len: int                                   # the most tokens a step drafts (the engine's K)
    schedule: dict[int, int] = field(default_factory=dict)
    confidence_threshold: float = 0.0
    acceptance_rate_threshold: float = 0.0
    acceptance_rate_window_size: int = 8
    auto_schedule: bool = False                      # --draft_len_schedule auto: the schedule is to be measured
    adaptive: bool = False                           # --draft_len_adaptive: each sequence's K from its acceptance

    def __post_init__(self):
        if not 0 <= self.confidence_threshold < 1:
            raise NemospecError(f"--draft_confidence_threshold: expected a value in [0, 1), got {self.confidence_threshold}")
        if not 0 <= self.acceptance_rate_threshold <= 1:
            raise NemospecError(f"--acceptance_rate_threshold: expected a value in [0, 1], got {self.acceptance_rate_threshold}")
        if self.acceptance_rate_window_size < 1:
            raise NemospecError(f"--acceptance_rate_window_size: expected >= 1, got {self.acceptance_rate_window_size}")
        too_long = {b: k for b, k in self.schedule.items() if k > self.draft_len}
        if too_long:
            raise NemospecError(f"--draft_len_schedule: K {max(too_long.values())} exceeds the engine's max_draft_len "
                                f"{self.draft_len}")

    def k_for_batch(self, batch: int) -> int:
        if not self.schedule:
            return self.draft_len
        for limit, k in self.schedule.items():
            if batch <= limit:
                return k
        return 0

    def confident_lengths(self, confidence: torch.Tensor) -> torch.Tensor:
        """confidence [B, K] (the draft's probability of each proposal) -> [B] proposals kept: the
        leading run at or above the threshold (at least one, so a step always drafts something)."""
        if not self.confidence_threshold:
            return torch.full((confidence.shape[0],), confidence.shape[1], dtype=torch.long)
        ok = (confidence >= self.confidence_threshold).long().cumprod(1).sum(1)
        return ok.clamp(min=1)


class AcceptanceTracker:
    """One sequence's rolling accepted/drafted ratio; ``speculating`` turns off for good under the floor.
    With an adaptive policy also its decayed acceptance rate (``rate``), which picks its K."""

    def __init__(self, policy: DraftPolicy):
        self.policy = policy
        self.window: deque = deque(maxlen=policy.acceptance_rate_window_size)
        self.speculating = True
        self.rate = SequenceRate() if policy.adaptive else None

    def record(self, accepted: int, drafted: int) -> None:
        if self.rate is not None:
            self.rate.record(accepted, drafted)
        if drafted <= 0 or not self.policy.acceptance_rate_threshold:
            return
        self.window.append((accepted, drafted))
        if len(self.window) == self.window.maxlen:
            rate = sum(a for a, _ in self.window) / sum(d for _, d in self.window)
            if rate < self.policy.acceptance_rate_threshold:
                self.speculating = False


# --- flags: recorded at build (BuildOptions), overridable by generate and serve -------------------
class SwitchValueError(ArgumentTypeError, ValueError):
    """A switch flag's value that is not on or off (argparse prints its message as it is)."""


def on_off(text) -> bool:
    """argparse type of a switch flag: on/off (true/false, 1/0, and a recorded bool as itself)."""
    if isinstance(text, bool):
        return text
    value = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}.get(str(text).lower())
    if value is None:
        raise SwitchValueError(f"expected on or off, got {text!r}")
    return value


POLICY_FLAGS = {  # flag -> (type, build default, help)
    "draft_len_schedule": (str, "", "K by batch size, TensorRT-LLM style: 'max_batch:K,...' (e.g. 1:4,4:3,8:2,16:0; "
                                    "past the largest batch size 0 = target-only); auto: measured at start "
                                    "for each batch size, 0 where speculation is not predicted to pay"),
    "draft_confidence_threshold": (float, 0.0, "verify a sequence's drafts only up to the first whose draft "
                                                "probability is under this (0 = always verify K)"),
    "acceptance_rate_threshold": (float, 0.0, "turn speculation off for a request whose accepted/drafted ratio over "
                                               "the last --acceptance_rate_window_size steps falls under this (0 = never)"),
    "acceptance_rate_window_size": (int, 8, "speculative steps in the acceptance-rate window"),
    "draft_len_adaptive": (on_off, False, "on: each sequence drafts, step by step, the K (up to the engine's, or "
                                          "generate's --num_draft_tokens, or a request's num_draft_tokens) that its recent acceptance and the measured step "
                                          "costs predict fastest (chains; trees keep their shape)"),
}


def add_policy_args(parser, build: bool) -> None:
    """The adaptive draft-length flags; at build they set the engine directory's defaults, at generate
    and serve they override them (default: the engine directory's)."""
    group = parser.add_argument_group("adaptive draft length")
    for flag, (kind, default, text) in POLICY_FLAGS.items():
        group.add_argument(f"--{flag}", type=kind, default=default if build else None,
                           metavar="{on,off}" if kind is on_off else None,
                           help=text + ("" if build else " (default: the engine directory's)"))


def policy_from(max_draft_len: int, recorded: dict, overrides=None) -> DraftPolicy:
    """The policy of an engine directory (``recorded``: its build options) with flags given on top."""
    values = {f: recorded.get(f, default) for f, (_, default, _) in POLICY_FLAGS.items()}
    for f in POLICY_FLAGS:
        given = getattr(overrides, f, None) if overrides is not None else None
        if given is not None:
            values[f] = given
    return DraftPolicy(max_draft_len, parse_schedule(values["draft_len_schedule"]),
                       float(values["draft_confidence_threshold"]), float(values["acceptance_rate_threshold"]),
                       int(values["acceptance_rate_window_size"]),
                       auto_schedule=values["draft_len_schedule"] == AUTO_SCHEDULE,
                       adaptive=on_off(values["draft_len_adaptive"]))
