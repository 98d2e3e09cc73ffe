"""TensorRTRunner executes a built engine on a GPU and must agree with the eager TorchRunner.

Engines cannot execute without a CUDA GPU and full TensorRT (tensorrt_rtx only builds here), so
these tests skip on CPU-only machines and say so; the CPU interpreter tests cover the network there.
"""
import pytest
import torch

from builder.engine import BuildOptions, build
from runtime.generation import generate
from runtime.loading import open_engine_dir, tensorrt_available

pytestmark = pytest.mark.skipif(not tensorrt_available(),
                                reason="needs a CUDA GPU with TensorRT: engines cannot execute on this machine")


@pytest.mark.parametrize("kind", ["dense", "moe", "two_attention"])
def test_tensorrt_runner_matches_torch_runner(kind, checkpoints, tmp_path):
    engine_dir = tmp_path / "engine"
    build(checkpoints[kind], engine_dir, BuildOptions(max_batch_size=4, max_input_len=64, max_seq_len=128,
                                                      max_draft_len=4), log=lambda m: None)
    trt_runner = open_engine_dir(engine_dir, backend="tensorrt").runner
    torch_runner = open_engine_dir(engine_dir, backend="torch", device="cuda").runner
    prompts = [[5, 9, 17, 33, 2, 8], [7], [11, 12, 13]]
    ours = generate(trt_runner, prompts, 24).output_ids
    ref = generate(torch_runner, prompts, 24).output_ids
    assert ours == ref
    ids = torch.tensor([[5, 9, 17, 33]], dtype=torch.int32, device="cuda")
    pos = torch.arange(4, dtype=torch.int32, device="cuda")[None]
    lengths = torch.tensor([4], dtype=torch.int32, device="cuda")
    index = pos.clone()
    a, _, _ = trt_runner.forward(ids, pos, lengths, index, trt_runner.new_state(1, 16))
    b, _, _ = torch_runner.forward(ids, pos, lengths, index, torch_runner.new_state(1, 16))
    assert torch.allclose(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("mode", ["draft_target", "mtp"])
def test_tensorrt_speculative_engines_match_target_greedy(mode, checkpoints, tmp_path):
    from speculative_fixtures import layer_subset_draft, target_with_mtp
    from runtime.speculative import speculative_generate
    target = target_with_mtp(checkpoints["dense"], tmp_path / "target")
    draft = layer_subset_draft(target, tmp_path / "draft")
    engine_dir = tmp_path / "engine"
    build(target, engine_dir, BuildOptions(max_batch_size=4, max_input_len=64, max_seq_len=128, max_draft_len=3,
                                           speculative_decoding_mode=mode),
          log=lambda m: None, draft_dir=draft if mode == "draft_target" else None)
    trt = open_engine_dir(engine_dir, backend="tensorrt")
    ref = generate(open_engine_dir(engine_dir, backend="torch", device="cuda").runner, [[5, 9, 17], [7]], 24).output_ids
    assert speculative_generate(trt.runner, trt.proposer(), [[5, 9, 17], [7]], 24, 3).output_ids == ref
