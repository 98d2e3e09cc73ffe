"""NVFP4 drafts end to end: --quantization nvfp4_w4a16 at build, pre-quantized ModelOpt drafts,
logits close to the unquantized draft, exit code 2 on bad NVFP4 tensors."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from builder.checkpoint import load_checkpoint
from builder.drafts import load_draft
from builder.engine import BuildOptions, build
from nemospec import cli
from runtime.generation import generate
from runtime.loading import open_engine_dir
from runtime.speculative import speculative_generate
from speculative_fixtures import FEATURE_DRAFTS, assert_greedy_margin
from test_block_drafts import _nvfp4_dspark


@pytest.mark.parametrize("mode", ["dflash", "dspark", "peagle"])
def test_nvfp4_draft_logits_stay_close_to_the_unquantized_draft(mode, checkpoints):
    """Same inputs through the fp32 draft and its NVFP4 copy: relative RMS error within the NVFP4
    budget 2 * sqrt(L) * eps (eps ~ 9.5% per-weight error, L ~ 6 quantized linears on the path: 0.47)
    and mostly the same argmax."""
    config, weights = load_checkpoint(checkpoints["moe"])
    plain = load_draft(mode, config, weights, FEATURE_DRAFTS[mode], torch.float32, log=lambda m: None)
    quant = load_draft(mode, config, weights, FEATURE_DRAFTS[mode], torch.float32, log=lambda m: None,
                       quantization="nvfp4_w4a16")
    assert getattr(quant.module.fc, "is_nvfp4", False) and not getattr(plain.module.fc, "is_nvfp4", False)
    g = torch.Generator().manual_seed(0)
    m_p, m_q = plain.module, quant.module
    batch, rows = 4, 6
    aux = torch.randn(batch, rows, m_p.aux_width, generator=g)
    positions = torch.arange(rows, dtype=torch.int32).repeat(batch, 1)
    lengths = torch.full((batch,), rows, dtype=torch.int32)
    ids = torch.randint(3, 90, (batch, rows), generator=g, dtype=torch.int32)
    index = torch.arange(rows, dtype=torch.int32).repeat(batch, 1)

    def run(m):
        state = {k: torch.zeros(s, dtype=d) for k, (s, d) in m.state_spec(batch, 16).items()}
        if mode == "peagle":
            return m.forward(ids, aux, torch.zeros_like(ids), positions, lengths, index, state)[0]
        block = m.block_inputs(ids[:, 0], torch.full((batch,), rows, dtype=torch.int32), 3)
        return m.forward(aux, positions, lengths, *block, state)[0]

    a, b = run(m_q), run(m_p)
    rel = ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert rel < 0.47 and agree >= 0.5, (rel, agree)  # chance agreement would be ~1/64
    assert rel > 1e-4  # really quantized


def test_prequantized_modelopt_draft_builds_and_speculates_exactly(checkpoints, tmp_path):
    draft = _nvfp4_dspark(tmp_path)
    engine = tmp_path / "engine"
    build(checkpoints["moe"], engine, BuildOptions(max_batch_size=2, max_input_len=16, max_seq_len=64, max_draft_len=3,
                                                   speculative_decoding_mode="dspark"), log=lambda m: None, draft_dir=draft)
    meta = json.loads((engine / "config.json").read_text())
    assert meta["speculative"]["quantization"] == "nvfp4_w4a16"
    report = json.loads((engine / "build_report.json").read_text())
    assert "fp4_markov_head" in report["engines"]["markov"]["lowerings"]  # rank-16 W2 is FP4 here
    eager = open_engine_dir(engine, backend="torch")
    want = generate(eager.runner, [[5, 9, 17], [7]], 16).output_ids
    assert_greedy_margin(eager.runner, [[5, 9, 17], [7]], want, 3)
    assert speculative_generate(eager.runner, eager.proposer(), [[5, 9, 17], [7]], 16, 3).output_ids == want
    interp = open_engine_dir(engine, backend="interpreter")
    assert speculative_generate(interp.runner, interp.proposer(), [[5, 9, 17]], 8, 3).output_ids == [want[0][:8]]


def test_bad_nvfp4_draft_and_quantization_flags_exit_2(checkpoints, tmp_path, capsys):
    draft = _nvfp4_dspark(tmp_path)
    t = load_file(str(draft / "model.safetensors"))
    del t["layers.0.self_attn.q_proj.weight_scale_2"]
    save_file(t, str(draft / "model.safetensors"))
    base = ["build", "--checkpoint_dir", str(checkpoints["moe"]), "--output_dir", str(tmp_path / "e"),
            "--max_draft_len", "3"]
    assert cli.main(base + ["--speculative_decoding_mode", "dspark", "--draft_dir", str(draft)]) == 2
    assert "layers.0.self_attn.q_proj.weight_scale_2" in capsys.readouterr().err
    assert cli.main(base + ["--quantization", "nvfp4_w4a16"]) == 2
    assert "--quantization" in capsys.readouterr().err
    assert cli.main(base + ["--speculative_decoding_mode", "draft_target", "--draft_dir", str(checkpoints["moe"]),
                            "--quantization", "nvfp4_w4a16"]) == 2
    assert "--quantization" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("mode", ["dflash", "dspark", "peagle"])
def test_bfloat16_target_and_draft_speculate_exactly(mode, checkpoints):
    """A bf16 build: target and draft in bf16; speculative greedy == the bf16 target's greedy, up to
    rounding-level ties: bf16 logits near 5 are multiples of 2^-5 and this trajectory has top-2 gaps of
    one such step, so no input keeps a margin over bf16 rounding (assert_greedy_margin cannot hold);
    where a verify pass rounds apart from decode steps, either answer of such a tie is greedy."""
    from builder.models.nemotron_h import NemotronH
    from runtime.drafts import EagerDraft
    from runtime.runner import TorchRunner
    from speculative_fixtures import PROPOSERS, assert_greedy_up_to_ties
    config, weights = load_checkpoint(checkpoints["moe"])
    bf16 = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in weights.items()}
    draft = load_draft(mode, config, bf16, FEATURE_DRAFTS[mode], torch.bfloat16, log=lambda m: None)
    target = TorchRunner(NemotronH(config, bf16, torch.bfloat16, **draft.target_features))
    prompts = [[5, 9, 17, 33, 4], [7], [12, 13, 14]]
    want = generate(target, prompts, 24).output_ids
    proposer = PROPOSERS[mode](EagerDraft(draft.module, config.vocab_size))
    got = speculative_generate(target, proposer, prompts, 24, 3).output_ids
    assert_greedy_up_to_ties(target, prompts, got, f"{mode} bf16")  # (on the CPUs seen so far: got == want)
    wrong = [list(o) for o in want]
    wrong[0][6] = want[0][7]  # a token that is not greedy there: caught
    with pytest.raises(AssertionError, match="more than the rounding bound"):
        assert_greedy_up_to_ties(target, prompts, wrong)
