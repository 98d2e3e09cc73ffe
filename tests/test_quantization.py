"""NVFP4 W4A16 in ModelOpt's layout: the number format (bit-exact against ModelOpt 0.47.0), the
round-trip error bound, tensor-dict helpers for drafts, NVFP4 NemotronH checkpoints (quantize CLI,
loading, logits against the unquantized model), the FP4 TensorRT lowering (builds with tensorrt_rtx,
interpreted == eager) and one-line errors (exit code 2) naming the bad tensor."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from builder import functional as F
from builder import nvfp4_format as fmt
from builder import quantization as q
from builder.quantize_checkpoint import quantize_checkpoint
from builder.backends.trt_dense import NVFP4_LOWERING
from builder.checkpoint import load_checkpoint, load_nvfp4_checkpoint
from builder.engine import BuildOptions, build, record, target_component
from builder.errors import CheckpointError
from builder.interpreter import run_network
from builder.models.nemotron_h import NemotronH
from nemospec import cli
from runtime.loading import open_engine_dir
from runtime.state import allocate, chunk_inputs

# ModelOpt 0.47.0's NVFP4QTensor.quantize(w, 16) of GOLDEN_W (run once, outside the test suite):
# packed bytes, FP8 block-scale bytes, FP32 global scale.
GOLDEN_PACKED = [255, 255, 238, 238, 222, 221, 204, 188, 188, 154, 16, 50, 84, 101, 102, 119,
                 221, 13, 237, 238, 238, 238, 255, 255, 238, 238, 238, 238, 255, 255, 255, 255]
GOLDEN_SCALE = [98, 91, 121, 126]
GOLDEN_SCALE_2 = float.fromhex("0x1.f1fb1e0000000p-6")


def golden_w():
    w = (torch.arange(64, dtype=torch.float32).reshape(2, 32) - 20.0) * torch.tensor([[0.37], [-1.9]])
    w[1, 3] = 0.0
    return w


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# --- the number format ------------------------------------------------------------------------------
def test_bit_exact_with_modelopt():
    packed, scale, scale_2 = fmt.quantize_nvfp4(golden_w())
    assert packed.dtype == torch.uint8 and packed.shape == (2, 16)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (2, 2)
    assert scale_2.dtype == torch.float32 and scale_2.dim() == 0
    assert packed.flatten().tolist() == GOLDEN_PACKED
    assert scale.view(torch.uint8).flatten().tolist() == GOLDEN_SCALE
    assert scale_2.item() == GOLDEN_SCALE_2


def test_codes_nibble_order_ties_and_saturation():
    # element 2i in the low nibble (ModelOpt's (q[1::2] << 4) | q[0::2]; TensorRT's FP4 byte order)
    assert fmt.pack_fp4(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    assert fmt.unpack_fp4(torch.tensor([0x21, 0x0F], dtype=torch.uint8)).tolist() == [1, 2, 15, 0]
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 7.0, 1e9, -0.1, -6.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, 6.0, -0.0, -6.0]  # ties to the even code
    got = fmt.fp4_decode(fmt.fp4_encode(x))
    assert got.tolist() == want and torch.signbit(got[10])
    assert fmt.fp4_decode(torch.arange(16, dtype=torch.uint8)).tolist() == fmt.E2M1_VALUES.tolist()


@pytest.mark.parametrize("case", ["normal", "heavy_tail", "experts_3d", "zero_blocks", "tiny", "outlier"])
def test_round_trip_within_the_error_bound(case):
    w = {"normal": lambda: randn(64, 128, seed=1),
         "heavy_tail": lambda: randn(32, 64, seed=2) ** 3,
         "experts_3d": lambda: randn(4, 16, 32, seed=3) * torch.rand(4, 1, 1) * 5,
         "zero_blocks": lambda: randn(8, 64, seed=4) * (torch.arange(64) >= 32),
         "tiny": lambda: randn(8, 32, seed=5, scale=1e-7),  # block scales clamp at 2**-9 of the global scale
         "outlier": lambda: randn(16, 64, seed=6).index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(1e4)),
         }[case]()
    packed, scale, scale_2 = fmt.quantize_nvfp4(w)
    assert packed.shape == w.shape[:-1] + (w.shape[-1] // 2,) and scale.shape == w.shape[:-1] + (w.shape[-1] // 16,)
    dq = fmt.dequantize_nvfp4(packed, scale, scale_2, w.shape)
    err, bound = (w - dq).abs(), fmt.quantization_error_bound(w, scale, scale_2)
    assert bool((err <= bound).all()), (err - bound).max()
    # the bound is per block at most one effective block scale (the largest half step, 1 unit at 4..6,
    # saturation after FP8 rounding adds < 0.4): it is not vacuous, and it is reached
    s = (scale.float() * scale_2).repeat_interleave(16, -1)
    assert bool((bound <= 1.41 * s + w.abs() * 1e-6).all())
    if case == "normal":
        assert (err / bound).max() > 0.9
        assert ((w - dq).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()) < 0.11  # ~9.5% relative RMS on Gaussians


def test_values_on_the_grid_round_trip_exactly():
    """Blocks of E2M1 values (each holding a +-6) times block scales 448 * 2**-k of the global scale
    are exactly representable: quantize then dequantize returns them bit for bit."""
    g = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 16, (8, 64), generator=g, dtype=torch.uint8)
    codes[:, ::16] = 7  # +6 in every block
    block = 3.0 * 2.0 ** -torch.randint(0, 6, (8, 4), generator=g).float()
    w = fmt.fp4_decode(codes) * block.repeat_interleave(16, -1)
    packed, scale, scale_2 = fmt.quantize_nvfp4(w)
    assert torch.equal(fmt.dequantize_nvfp4(packed, scale, scale_2, w.shape), w)
    assert torch.equal(fmt.unpack_fp4(packed), torch.where(codes == 8, torch.zeros_like(codes), codes))


def test_dequantize_in_half_types_is_two_rounding_steps():
    w = randn(16, 48, seed=7)
    packed, scale, scale_2 = fmt.quantize_nvfp4(w)
    fp32 = fmt.dequantize_nvfp4(packed, scale, scale_2, w.shape)
    for dtype in (torch.bfloat16, torch.float16):
        got = fmt.dequantize_nvfp4(packed, scale, scale_2, w.shape, dtype)
        block = (scale.float() * scale_2).to(dtype).float().repeat_interleave(16, -1)
        want = (fmt.fp4_decode(fmt.unpack_fp4(packed)) * block).to(dtype)
        assert got.dtype == dtype and torch.equal(got, want)
        torch.testing.assert_close(got.float(), fp32, rtol=1e-2, atol=1e-6)


# --- tensor dicts (drafts) -------------------------------------------------------------------------------
def _draft_tensors():
    return {"embed_tokens.weight": randn(40, 32, seed=1), "layers.0.mlp.up_proj.weight": randn(64, 32, seed=2),
            "layers.0.mlp.down_proj.weight": randn(32, 64, seed=3), "layers.0.input_layernorm.weight": torch.ones(32),
            "markov_head.markov_w1.weight": randn(40, 16, seed=4),
            "markov_head.markov_w2.weight": randn(48, 16, seed=5)}


def test_quantize_and_dequantize_tensors_for_drafts():
    tensors = _draft_tensors()
    names = ["layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight", "markov_head.markov_w2.weight"]
    out = q.quantize_tensors(tensors, names)
    assert list(out)[:3] == ["embed_tokens.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.up_proj.weight_scale"]
    for name in names:
        rows, cols = tensors[name].shape
        assert (out[name].dtype, tuple(out[name].shape)) == (torch.uint8, (rows, cols // 2))
        scale = out[name + "_scale"]
        assert (scale.dtype, tuple(scale.shape)) == (torch.float8_e4m3fn, (rows, cols // 16))
        assert out[name + "_scale_2"].dtype == torch.float32 and out[name + "_scale_2"].dim() == 0
    assert out["embed_tokens.weight"] is tensors["embed_tokens.weight"]
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    qc = q.QuantConfig(exclude_modules=("embed_tokens", "markov_head.markov_w1"))
    for config in (qc, qc.hf_quant_config(), qc.quantization_config()):
        back = q.dequantize_tensors(out, config, shapes)
        assert list(back) == list(tensors)
        for name, t in tensors.items():
            if name in names:
                bound = fmt.quantization_error_bound(t, out[name + "_scale"], out[name + "_scale_2"])
                assert bool(((back[name] - t).abs() <= bound).all())
            else:
                assert back[name] is t
    # without shapes, the logical shape comes from the scales (group size 16), checked against the bytes
    assert q.dequantize_tensors(out)["markov_head.markov_w2.weight"].shape == (48, 16)
    kept = q.nvfp4_weights(out, qc, shapes, torch.bfloat16)
    w2 = kept["markov_head.markov_w2.weight"]
    assert isinstance(w2, fmt.NVFP4Weight) and w2.shape == (48, 16) and w2.dtype == torch.bfloat16


def test_tensor_dict_errors_name_the_tensor():
    out = q.quantize_tensors(_draft_tensors(), ["markov_head.markov_w2.weight"])
    shapes = {"markov_head.markov_w2.weight": (48, 16)}
    bad = dict(out)
    del bad["markov_head.markov_w2.weight_scale_2"]
    with pytest.raises(CheckpointError, match=r"markov_head\.markov_w2\.weight_scale_2: missing FP32 global scale"):
        q.dequantize_tensors(bad, None, shapes)
    with pytest.raises(CheckpointError, match=r"markov_head\.markov_w2\.weight: packed FP4 weight has shape \[48, 8\], "
                                              r"expected \[48, 16\]"):
        q.dequantize_tensors(out, None, {"markov_head.markov_w2.weight": (48, 32)})
    with pytest.raises(CheckpointError, match="excluded from quantization"):
        q.dequantize_tensors(out, q.QuantConfig(exclude_modules=("markov_head.*",)))
    with pytest.raises(CheckpointError, match=r"tensor nope\.weight to quantize"):
        q.quantize_tensors(out, ["nope.weight"])
    with pytest.raises(CheckpointError, match=r"input_layernorm\.weight: expected a floating weight of rank"):
        q.quantize_tensors(_draft_tensors(), ["layers.0.input_layernorm.weight"])
    with pytest.raises(CheckpointError, match=r"embed_tokens\.weight \[40, 30\]: NVFP4 needs the input dim"):
        q.quantize_tensors({"embed_tokens.weight": torch.ones(40, 30)}, ["embed_tokens.weight"])
    with pytest.raises(CheckpointError, match="quant_algo"):
        q.QuantConfig.from_dict({"quantization": {"quant_algo": "FP8"}}, "x.json")
    with pytest.raises(CheckpointError, match="group_size"):
        q.QuantConfig.from_dict({"quantization": {"quant_algo": "NVFP4", "group_size": 32}}, "x.json")


def test_bound_weight_computes_like_its_dequantized_tensor():
    w = fmt.NVFP4Weight.quantize(randn(24, 32, seed=8), "w")
    half = w.to(torch.bfloat16)
    assert half.packed is w.packed and half.dtype == torch.bfloat16 and half.shape == (24, 32)
    x = randn(2, 3, 32, seed=9)
    assert torch.equal(F.linear(x, w), torch.nn.functional.linear(x, w.dequantize()))
    xb = x.bfloat16()
    assert torch.equal(F.linear(xb, half), torch.nn.functional.linear(xb, w.dequantize(torch.bfloat16)))
    stacked = torch.stack([w, w])  # MoE expert stacks see the dequantized weights
    assert isinstance(stacked, torch.Tensor) and torch.equal(stacked[1], w.dequantize())


# --- NVFP4 NemotronH checkpoints ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quantized(checkpoints, tmp_path_factory):
    """kind -> NVFP4 checkpoint written by `nemospec quantize` from the tiny checkpoint of that kind."""
    root = tmp_path_factory.mktemp("nvfp4")

    class _Lazy(dict):
        def __missing__(self, kind):
            out = root / kind
            assert cli.main(["quantize", "--checkpoint_dir", str(checkpoints[kind]), "--output_dir", str(out),
                             "--format", "nvfp4_w4a16"]) == 0
            # readable by a server running as another user (safetensors' save_file wrote 0600)
            assert (out / "model.safetensors").stat().st_mode & 0o044 == (out / "config.json").stat().st_mode & 0o044
            self[kind] = out
            return out

    return _Lazy()


def _logits(model, prompts):
    ids, positions, lengths = chunk_inputs(prompts, [0] * len(prompts))
    index = torch.arange(ids.shape[1], dtype=torch.int32).repeat(len(prompts), 1)
    return model.forward(ids, positions, lengths, index, allocate(model.state_spec(len(prompts), ids.shape[1])))[0]


def _prompts(vocab, n=4, length=32):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _rel_rms(a, b):
    return ((a - b).pow(2).mean().sqrt() / a.std()).item()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_quantized_model_logits_close_to_the_original(kind, checkpoints, quantized):
    """The stated bound. NVFP4 errs by eps ~ 9.5-10% relative RMS per Gaussian weight; the errors of the
    L quantized linears a token passes through add up about in quadrature, so the logits' relative RMS
    error is about sqrt(L) * eps (0.39 for the dense model's 16 linears, measured 0.39). Bound: at most
    2 sqrt(L) eps_max, and at most 1.25x the error of the same model with i.i.d. Gaussian noise of each
    weight's own NVFP4 RMS error in place of the quantization (a bias or a layout bug would be far
    off). These random models have flat logits (median top-2 gap ~ 0.3 logit std), so at 4 bits a
    whole stack flips the argmax of about half the positions (as the noise control does); here the
    quantized argmax stays in the reference's top 5 on >= 70% of positions (dense 88%, MoE 75%) and
    no less often than under the noise control (minus 0.1). The argmax itself is checked on a
    one-layer model below."""
    config, ref = load_checkpoint(checkpoints[kind])
    config_q, deq = load_checkpoint(quantized[kind])
    assert config_q == config and list(deq) == list(ref)
    quantized_names = [n for n in ref if not torch.equal(ref[n], deq[n])]
    assert quantized_names == q.quantizable_weight_names(quantized_names) and "lm_head.weight" not in quantized_names
    eps = {n: ((ref[n] - deq[n]).pow(2).mean().sqrt() / ref[n].pow(2).mean().sqrt()).item() for n in quantized_names}
    prompts = _prompts(config.vocab_size)
    a, b = _logits(NemotronH(config, ref), prompts), _logits(NemotronH(config, deq), prompts)
    g = torch.Generator().manual_seed(1)
    noisy = {n: (w + torch.randn(w.shape, generator=g) * eps[n] * w.pow(2).mean().sqrt()) if n in eps else w
             for n, w in ref.items()}
    c = _logits(NemotronH(config, noisy), prompts)
    err, control = _rel_rms(a, b), _rel_rms(a, c)
    path = len([n for n in quantized_names if ".experts." not in n]) + \
        2 * config.num_experts_per_tok * config.layer_types.count("moe")
    assert err <= 2 * path ** 0.5 * max(eps.values()), (err, path)
    assert err <= 1.25 * control, (err, control)
    top5 = a.topk(5, dim=-1).indices
    in_top5 = (b.argmax(-1)[..., None] == top5).any(-1).float().mean()
    control_top5 = (c.argmax(-1)[..., None] == top5).any(-1).float().mean()
    assert in_top5 >= 0.7 and in_top5 >= control_top5 - 0.1, (in_top5, control_top5)


def test_one_layer_model_keeps_the_argmax(checkpoints, tmp_path_factory):
    """A one-block model (an MLP; draft-sized): logits within 2 sqrt(2) eps (relative RMS) and the same
    argmax on most positions."""
    from tiny_models import tiny_checkpoint
    src = tiny_checkpoint("dense", tmp_path_factory, hybrid_override_pattern="-")
    out = tmp_path_factory.mktemp("one_layer") / "nvfp4"
    quantize_checkpoint(src, out, log=lambda m: None)
    config, ref = load_checkpoint(src)
    _, deq = load_checkpoint(out)
    prompts = _prompts(config.vocab_size)
    a, b = _logits(NemotronH(config, ref), prompts), _logits(NemotronH(config, deq), prompts)
    assert _rel_rms(a, b) <= 2 * 2 ** 0.5 * 0.1
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.7


def test_quantize_cli_writes_modelopt_layout(checkpoints, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(checkpoints["moe"], src)
    (src / "tokenizer.json").write_text('{"model": {}}')
    out = tmp_path / "out"
    argv = ["quantize", "--checkpoint_dir", str(src), "--format", "nvfp4_w4a16", "--exclude_modules", "*shared_experts*"]
    # a directory that is not an earlier quantize output is never replaced: another one, or the one
    # holding the checkpoint (both were deleted)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    for target, named in ((tmp_path / "other", "holds other files"), (tmp_path, "holds the --checkpoint_dir")):
        assert cli.main([*argv, "--output_dir", str(target)]) == 2
        assert named in capsys.readouterr().err
    assert (tmp_path / "other" / "keep.txt").is_file() and (src / "config.json").is_file()
    shutil.rmtree(tmp_path / "other")
    assert cli.main([*argv, "--output_dir", str(out)]) == 0
    (out / "stale").write_text("x")    # an earlier output of this command: replaced as a whole
    assert cli.main([*argv, "--output_dir", str(out)]) == 0
    assert "linear weights in NVFP4" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no temporary directories left
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "hf_quant_config.json", "model.safetensors", "tokenizer.json"]
        + [p.name for p in src.iterdir() if p.name == "generation_config.json"])
    _, ref = load_checkpoint(src)
    hf = json.loads((out / "hf_quant_config.json").read_text())
    assert set(hf) == {"producer", "quantization"}
    quant = hf["quantization"]
    assert (quant["quant_algo"], quant["group_size"], quant["kv_cache_quant_algo"]) == ("W4A16_NVFP4", 16, None)
    conv = [n[:-len(".weight")] for n in ref if n.endswith("conv1d.weight")]
    shared = {n[:-len(".weight")] for n in ref if ".shared_experts." in n}
    assert quant["exclude_modules"] == sorted({"lm_head", *conv, *shared})
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "modelopt" and qcfg["quant_algo"] == "W4A16_NVFP4"
    assert qcfg["config_groups"]["group_0"]["weights"] == {"dynamic": False, "num_bits": 4, "type": "float",
                                                            "group_size": 16}
    assert "input_activations" not in qcfg["config_groups"]["group_0"] and qcfg["ignore"] == quant["exclude_modules"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = {n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape())) for n in f.keys()}
    quantized_modules = []
    for name, w in ref.items():
        module = name[:-len(".weight")]
        if name.endswith("_proj.weight") and "shared_experts" not in name:
            out_dim, in_dim = w.shape
            assert stored[name] == ("U8", (out_dim, in_dim // 2)), name
            assert stored[name + "_scale"] == ("F8_E4M3", (out_dim, in_dim // 16)), name
            assert stored[name + "_scale_2"] == ("F32", ()), name
            quantized_modules.append(module)
        else:
            assert stored[name] == ({torch.float32: "F32", torch.bfloat16: "BF16"}[w.dtype], tuple(w.shape)), name
    assert any(".experts.7.down_proj" in m for m in quantized_modules)
    assert len(stored) == len(ref) + 2 * len(quantized_modules) and not any(n.endswith("input_scale") for n in stored)
    config, weights = load_checkpoint(out)  # our builder reads it back
    assert list(weights) == list(ref)


def test_nvfp4_engine_builds_and_its_network_interprets_like_eager(checkpoints, quantized, tmp_path):
    config, weights = load_nvfp4_checkpoint(quantized["dense"], keep_quantized=True)
    assert sum(isinstance(w, fmt.NVFP4Weight) for w in weights.values()) == 16
    module = NemotronH(config, weights, torch.float32)
    options = BuildOptions(max_batch_size=2, max_input_len=8, max_seq_len=16, max_draft_len=7)  # one profile
    component = target_component(module, options)
    recorder, _ = record(component)
    assert recorder.lowerings["linear_nvfp4"] == NVFP4_LOWERING
    kinds = [recorder.network.get_layer(i).type.name for i in range(recorder.network.num_layers)]
    assert kinds.count("DEQUANTIZE") == 2 * 16  # block scales, then weights, per NVFP4 linear
    prompts = [[5, 9, 17, 33, 4, 8], [7, 3]]
    ids, positions, lengths = chunk_inputs(prompts, [0, 0])
    feeds = {"input_ids": ids, "positions": positions, "lengths": lengths,
             "logit_index": torch.tensor([[5], [1]], dtype=torch.int32)}
    for name, (shape, dtype) in module.state_spec(2, 16).items():
        feeds["past." + name] = torch.zeros(shape, dtype=dtype)
    got = run_network(recorder.network, feeds)
    want = component.call(feeds)
    for name, value in want.items():  # the whole network in the interpreter's order: 1e-4 as the other
        # whole-network comparisons (1e-5 was within 2x of what one CPU measured on these logits)
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-4, msg=name)
    # the eager NVFP4 module computes what the dequantized checkpoint computes
    _, deq = load_checkpoint(quantized["dense"])
    assert torch.equal(want["logits"], target_component(NemotronH(config, deq), options).call(feeds)["logits"])
    # `nemospec build` of the NVFP4 checkpoint: FP4 constants in the engine, dequantized weights for the
    # TorchRunner (which then computes what the eager NVFP4 module computes)
    report = build(quantized["dense"], tmp_path / "engine", options, log=lambda m: None)
    assert report["engines"]["target"]["lowerings"]["linear_nvfp4"] == NVFP4_LOWERING
    assert report["engines"]["target"]["engine_bytes"] > 10000
    runner = open_engine_dir(tmp_path / "engine", backend="torch").runner
    a, _, _ = runner.forward(ids, positions, lengths, feeds["logit_index"], runner.new_state(2, 16))
    assert torch.equal(a, want["logits"])


@pytest.mark.parametrize("damage, tensor, message", [
    ("scale_shape", "backbone.layers.1.mixer.up_proj.weight_scale", "does not match the block size"),
    ("no_global_scale", "backbone.layers.1.mixer.up_proj.weight_scale_2", "missing FP32 global scale"),
    ("odd_packed_length", "backbone.layers.1.mixer.up_proj.weight", "odd or wrong packed length"),
    ("scale_dtype", "backbone.layers.1.mixer.up_proj.weight_scale", "expected float8_e4m3fn"),
    ("orphan_scale", "backbone.layers.1.mixer.up_proj.weight", "expected uint8 (packed FP4)"),
])
def test_bad_nvfp4_checkpoint_exits_2_naming_the_tensor(damage, tensor, message, quantized, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(quantized["dense"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "backbone.layers.1.mixer.up_proj.weight"
    if damage == "scale_shape":
        tensors[name + "_scale"] = tensors[name + "_scale"][:, :2].contiguous()  # blocks of 32
    elif damage == "no_global_scale":
        del tensors[name + "_scale_2"]
    elif damage == "odd_packed_length":
        tensors[name] = tensors[name][:, :-1].contiguous()
    elif damage == "scale_dtype":
        tensors[name + "_scale"] = tensors[name + "_scale"].float()
    else:
        tensors[name] = fmt.dequantize_nvfp4(tensors[name], tensors[name + "_scale"], tensors[name + "_scale_2"],
                                           (128, 64))
    save_file(tensors, str(bad / "model.safetensors"))
    for argv in (["build", "--checkpoint_dir", str(bad), "--output_dir", str(tmp_path / "engine")],
                 ["generate", "--checkpoint_dir", str(bad), "--input_ids", "1,2", "--max_new_tokens", "1"]):
        assert cli.main(argv) == 2
        err = "".join(capsys.readouterr().err.split())  # rich wraps the one-line message to the console width
        line = err[err.index("error:"):]
        assert "".join(tensor.split()) in line and "".join(message.split()) in line, err
    assert not (tmp_path / "engine").exists()


def test_quantize_cli_bad_input_exits_2(quantized, tmp_path, capsys):
    def err():
        return " ".join(capsys.readouterr().err.split())
    assert cli.main(["quantize", "--checkpoint_dir", str(quantized["dense"]), "--output_dir", str(tmp_path / "x")]) == 2
    assert "already a quantized checkpoint" in err()
    assert cli.main(["quantize", "--checkpoint_dir", str(tmp_path / "none"), "--output_dir", str(tmp_path / "x")]) == 2
    assert "not found" in err()
    with pytest.raises(SystemExit) as exc:
        cli.main(["quantize", "--checkpoint_dir", str(quantized["dense"]), "--output_dir", "x", "--format", "int4"])
    assert exc.value.code == 2
    assert not (tmp_path / "x").exists()
