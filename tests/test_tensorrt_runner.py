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
                                reason="needs a CUDA GPU: TensorRT engines cannot execute on this CPU-only machine")


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
