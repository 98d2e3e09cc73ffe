"""Full width checked: one block of each kind at the shapes NVIDIA ships, its TensorRT network evaluated
by the CPU interpreter against the eager path (bf16, reduced vocabulary).

Blocks: Mamba-2 at Nemotron-H-8B widths (128 heads x 64, state 128, 8 groups), its GQA attention
(32 query / 8 KV heads) and its MLP (21504), Nemotron-3-Nano's 128-expert MoE (top-6, shared expert)
and Nemotron-3-Super's latent MoE (512 experts through a 1024-wide latent, top-22). Each is a one-layer
random checkpoint (``builder.random_checkpoint --config ... --pattern``). The dense blocks are also
built into engines (the MoE ones would need more host memory than a test may take: see
``benchmarks/scale.py``). Slow (~2 min in all, ~6 GB RSS at the Super's MoE) but part of ``make test``.

Bounds (tests/tolerances.py): the final hidden state within SPREAD_FACTOR bf16 ulps per element (the
two paths round the same tensors at the same points), then the LM head on the interpreter's hidden
state within its fp32 dot-product rounding plus one bf16 rounding of the logit. (A worst-case bound
carried from the hidden state through a 4096-wide head would be as large as the logits themselves.)
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from builder.backends.trt_build import build_engine_file
from builder.checkpoint import load_checkpoint
from builder.engine import BuildOptions, record, target_component
from builder.interpreter import run_network
from builder.models.nemotron_h import NemotronH
from builder.shaped_checkpoint import write_shaped_checkpoint
from tolerances import SPREAD_FACTOR, assert_within, min_top2_gaps, sum_bound, unit_roundoff

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "benchmarks" / "configs"
OPTIONS = BuildOptions(max_batch_size=1, max_input_len=8, max_seq_len=16)
PROMPT = [[3, 141, 59, 265]]
CASES = {  # kind -> (config, one-layer pattern, also build the engine, experts the router may choose)
    "mamba2_8b": ("nemotron-h-8b-base-8k.json", "M", True, None),
    "gqa_attention_8b": ("nemotron-h-8b-base-8k.json", "*", True, None),
    "mlp_8b": ("nemotron-h-8b-base-8k.json", "-", True, None),
    "moe_128_experts": ("nemotron-3-nano-30b-a3b-bf16.json", "E", False, None),
    # the Super's 512 experts at full width, the router steered to the first 64 (the other 448 are
    # sparse holes): 0.7 GB of weights to write and map instead of 5.6 GB
    "latent_moe_512_experts": ("nemotron-3-super-120b-a12b-nvfp4.json", "E", False, 64),
}


def _feeds(module, ids, past: int, state: dict):
    n = ids.shape[1]
    return {"input_ids": ids, "positions": (past + torch.arange(n, dtype=torch.int32))[None],
            "lengths": torch.tensor([n], dtype=torch.int32), "logit_index": torch.arange(n, dtype=torch.int32)[None],
            **{"past." + k: v for k, v in state.items()}}


def _zero_state(module):
    return {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in module.state_spec(1, 16).items()}


@pytest.mark.parametrize("kind", list(CASES))
def test_full_width_block_interprets_like_eager(kind, tmp_path):
    config_file, pattern, build_it, routable = CASES[kind]
    ckpt = tmp_path / "ckpt"
    try:
        write_shaped_checkpoint(CONFIGS / config_file, ckpt, vocab_size=512, dtype="bfloat16", pattern=pattern,
                                mtp=False, log=lambda m: None, routable_experts=routable)
        config, weights = load_checkpoint(ckpt)
        module = NemotronH(config, weights, torch.bfloat16, final_hidden=True)
        component = target_component(module, OPTIONS)
        recorder, _ = record(component)
        ids = torch.tensor(PROMPT, dtype=torch.int32)
        eager = component.call(_feeds(module, ids, 0, _zero_state(module)))
        interp = run_network(recorder.network, _feeds(module, ids, 0, _zero_state(module)))
        # 1. the block, at full width: the final (normed) hidden state, element by element. Both paths
        # round the same intermediate tensors to bf16 at the same points and accumulate in fp32; where
        # an fp32 sum lands on a bf16 rounding boundary the two may round apart by one ulp, and that
        # ulp travels on through the residual add and the norm: SPREAD_FACTOR ulps of the element's own
        # magnitude, or of the row's RMS for an element whose residual sum cancels towards 0.
        h, h_want = interp["features.hidden"].double(), eager["features.hidden"].double()
        rms = h_want.pow(2).mean(-1, keepdim=True).sqrt()
        ulp = 2 * unit_roundoff(torch.bfloat16)
        assert_within(h, h_want, SPREAD_FACTOR * ulp * (h_want.abs() + rms), f"{kind} hidden")
        # 2. the LM head on the interpreter's own hidden state: its dot products in fp32 (2 gamma_H of
        # the summed magnitudes) and the logit rounded to bf16 once (an ulp each side)
        head = module.lm_head.double()
        logits = (h.to(torch.bfloat16).double() @ head.T)
        bound = sum_bound(h.abs() @ head.abs().T, config.hidden_size) + 2 * ulp * logits.abs()
        assert eager["logits"].abs().max() > 1.0  # not a degenerate (all-zero) block
        assert_within(interp["logits"], logits, bound, f"{kind} logits")
        # and the eager logits agree on the greedy token wherever it is not a near-tie
        gap, need = min_top2_gaps(eager["logits"], bound + (interp["logits"] - eager["logits"]).abs())
        assert torch.equal(interp["logits"].argmax(-1)[gap > need], eager["logits"].argmax(-1)[gap > need])
        if build_it:
            size = build_engine_file(recorder, [p["shapes"] for p in component.contract(OPTIONS, {})["profiles"]],
                                     tmp_path / "target.engine")
            weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())
            assert size >= weight_bytes  # the plan holds the full-width weights
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)  # (GBs: pytest keeps the last runs' tmp dirs)
