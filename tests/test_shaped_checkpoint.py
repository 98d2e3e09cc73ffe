"""Random checkpoints at the shapes NVIDIA ships (`python -m builder.random_checkpoint --config ...`):
written for every config in benchmarks/configs at 2..4 layers with a reduced vocabulary, then loaded and
validated by our loaders. The names and shapes are checked against transformers' own NemotronH built
on the meta device (no memory), the ``mtp.*`` names against vLLM's layout written out by hand, and the
NVFP4 bytes against ModelOpt's packing decoded here nibble by nibble."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from builder.checkpoint import INDEX_FILE, load_checkpoint
from builder.checkpoint import load_nvfp4_checkpoint
from builder.nvfp4_format import NVFP4Weight
from builder.safetensors_io import mmap_tensors, read_header
from builder.shaped_checkpoint import init_tensor, write_shaped_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "benchmarks" / "configs").glob("*.json"))
VOCAB = 1024


def _transformers_shapes(config_json: Path) -> dict[str, tuple[int, ...]]:
    """backbone.* / lm_head names and shapes of transformers' model for this config.json (meta device)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM
    raw = json.loads(config_json.read_text())
    raw.pop("quantization_config", None)
    with torch.device("meta"):
        model = NemotronHForCausalLM(NemotronHConfig.from_dict(raw))
    out = {}
    for name, t in model.state_dict().items():
        name = "backbone." + name[len("model."):] if name.startswith("model.") else name
        if name.endswith(("experts.up_proj", "experts.down_proj")):
            base, proj = name.rsplit(".", 1)
            out.update({f"{base}.{e}.{proj}.weight": tuple(t.shape[1:]) for e in range(t.shape[0])})
        else:
            out[name] = tuple(t.shape)
    return out


def _stored(directory: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    index = json.loads((directory / INDEX_FILE).read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        header, _ = read_header(directory / shard)
        out.update({n: (e["dtype"], tuple(e["shape"])) for n, e in header.items()})
    assert set(out) == set(index["weight_map"])
    return out


@pytest.mark.parametrize("num_layers", [2, 3, 4])
@pytest.mark.parametrize("config_path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_writes_and_loads(config_path, num_layers, tmp_path):
    quantize = "nvfp4_w4a16" if "nvfp4" in config_path.name else None
    out = tmp_path / "ckpt"
    summary = write_shaped_checkpoint(config_path, out, num_layers, "bfloat16", quantize, VOCAB, fill="zeros",
                                      log=lambda m: None)
    raw = json.loads((out / "config.json").read_text())
    source = {k: v for k, v in json.loads(config_path.read_text()).items() if not k.startswith("_")}
    assert raw["num_hidden_layers"] == num_layers and raw["vocab_size"] == VOCAB
    assert summary["pattern"] == raw["hybrid_override_pattern"]
    full = source.get("hybrid_override_pattern") or "".join(
        {"mamba": "M", "moe": "E", "attention": "*", "mlp": "-"}[k] for k in source["layers_block_type"])
    assert raw["hybrid_override_pattern"] == full[:num_layers]
    stored = _stored(out)
    logical = _transformers_shapes(out / "config.json")
    mtp = {n for n in stored if n.startswith("mtp.")}
    assert bool(mtp) == bool(source.get("num_nextn_predict_layers"))
    if quantize is None:
        assert {n: s for n, (_, s) in stored.items() if n not in mtp} == logical
        assert {d for n, (d, _) in stored.items()} == {"BF16"}
        config, weights = load_checkpoint(out)
        assert {n: tuple(w.shape) for n, w in weights.items() if not n.startswith("mtp.")} == logical
    else:
        packed = {n for n, (d, _) in stored.items() if d == "U8"}
        assert packed and all(n.endswith("_proj.weight") and not n.startswith("mtp.") for n in packed)
        for name in packed:  # ModelOpt's layout: [out, in/2] bytes, [out, in/16] fp8 scales, fp32 scalar
            o, i = logical[name]
            assert stored[name] == ("U8", (o, i // 2))
            assert stored[name + "_scale"] == ("F8_E4M3", (o, i // 16))
            assert stored[name + "_scale_2"] == ("F32", ())
        assert not any("conv1d" in n or "lm_head" in n or "embeddings" in n for n in packed)
        config, weights = load_nvfp4_checkpoint(out, keep_quantized=True)
        assert {n: tuple(w.shape) for n, w in weights.items() if not n.startswith("mtp.")} == logical
        assert {n for n, w in weights.items() if isinstance(w, NVFP4Weight)} == packed
        hf = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
        assert hf["quant_algo"] == "W4A16_NVFP4" and hf["group_size"] == 16
    if mtp:
        H = raw["hidden_size"]
        assert stored["mtp.layers.0.eh_proj.weight"][1] == (H, 2 * H)
        assert stored["mtp.layers.0.enorm.weight"][1] == stored["mtp.layers.0.hnorm.weight"][1] == (H,)
        assert stored["mtp.layers.0.mixer.q_proj.weight"][1] == (raw["num_attention_heads"] * raw["head_dim"], H)
        E = raw["n_routed_experts"] - 1
        inner = raw.get("moe_latent_size") or H
        assert stored[f"mtp.layers.1.mixer.experts.{E}.up_proj.weight"][1] == (raw["moe_intermediate_size"], inner)
        assert stored["mtp.layers.1.final_layernorm.weight"][1] == (H,)
        assert all(d == "BF16" for n, (d, _) in stored.items() if n.startswith("mtp."))  # ModelOpt keeps mtp.* high
        assert {n for n in weights if n.startswith("mtp.")} == mtp


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_random_nvfp4_bytes_decode_to_the_drawn_weights(tmp_path):
    """A random (not structure-only) NVFP4 Mamba layer of the 3-Nano-30B: decoding the bytes as ModelOpt packs them
    (element 2i in the low nibble, sign bit 8, E2M1 magnitudes, times fp8 scale times scale_2) gives the
    bf16 weight the writer drew, within E2M1's rounding (half a step of the block scale) plus fp8's."""
    out = tmp_path / "q"
    write_shaped_checkpoint(ROOT / "benchmarks/configs/nemotron-3-nano-30b-a3b-bf16.json", out, 1,
                            "bfloat16", "nvfp4_w4a16", VOCAB, log=lambda m: None)
    name = "backbone.layers.0.mixer.out_proj.weight"
    shard = json.loads((out / INDEX_FILE).read_text())["weight_map"][name]
    t = mmap_tensors(out / shard, [name, name + "_scale", name + "_scale_2"])
    rows = slice(0, 256)
    packed = t[name][rows].long()
    codes = torch.stack([packed & 15, packed >> 4], -1).flatten(-2)
    mag = torch.tensor(E2M1)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    s = t[name + "_scale"][rows].float().repeat_interleave(16, -1) * t[name + "_scale_2"].float()
    decoded = mag * s
    drawn = init_tensor(name, (2688, 4096), torch.bfloat16)[rows].float()
    err = (decoded - drawn).abs()
    assert float((err <= s + drawn.abs() / 16).float().mean()) == 1.0   # E2M1 half step <= 1 * s (in [4, 6])
    # a correct packing errs 0.2 s on average (a quarter step; Gaussian blocks fill the wide steps
    # near 6); swapped nibbles or a wrong sign bit err by about the spread of a block, ~3 s
    assert float((err / s).mean()) < 0.4
    # the checkpoint loader dequantizes the same way
    _, weights = load_checkpoint(out)
    assert torch.allclose(weights[name][rows].float(), decoded, rtol=2 ** -7, atol=0)


def test_bad_input_exits_2_and_leaves_nothing(tmp_path):
    config = ROOT / "benchmarks/configs/nemotron-h-8b-base-8k.json"
    run = subprocess.run([sys.executable, "-m", "builder.random_checkpoint", "--config", str(config),
                          "--output_dir", str(tmp_path / "x"), "--num_layers", "53"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2
    line = run.stderr.strip().splitlines()[-1]
    assert "nemotron-h-8b-base-8k.json" in line and "--num_layers 53" in line and "1..52" in line
    assert list(tmp_path.iterdir()) == []
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "nemotron_h", "hidden_size": "wide"}))
    run = subprocess.run([sys.executable, "-m", "builder.random_checkpoint", "--config", str(bad),
                          "--output_dir", str(tmp_path / "y")], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and "bad.json" in run.stderr and "'hidden_size'" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_routable_experts_leave_the_rest_as_holes_the_router_never_chooses(tmp_path):
    """``--routable_experts 24`` on the Nano's 128-expert layer: experts 24.. are all-zero holes (no
    disk blocks), the rest drawn as usual, and the router (our route op on the stored weights, over
    random inputs) only ever picks among the first 24; fewer than top-k routable experts is refused."""
    import os
    from builder.backends.torch_backend import route
    config = ROOT / "benchmarks/configs/nemotron-3-nano-30b-a3b-bf16.json"
    out = tmp_path / "moe"
    write_shaped_checkpoint(config, out, vocab_size=VOCAB, pattern="E", mtp=False, log=lambda m: None,
                            routable_experts=24)
    cfg, weights = load_checkpoint(out)
    prefix = "backbone.layers.0.mixer."
    kept = weights[prefix + "experts.3.up_proj.weight"]
    assert torch.equal(kept, init_tensor(prefix + "experts.3.up_proj.weight", tuple(kept.shape), torch.bfloat16))
    assert not weights[prefix + "experts.24.down_proj.weight"].any() and not weights[prefix + "experts.127.up_proj.weight"].any()
    dense = cfg.n_routed_experts * 2 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    on_disk = sum(os.stat(p).st_blocks * 512 for p in out.glob("*.safetensors"))
    assert on_disk < dense * 0.3   # 24 of 128 experts' blocks, and the rest of the layer
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    index, _ = route(x, weights[prefix + "gate.weight"], weights[prefix + "gate.e_score_correction_bias"],
                     cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    assert index.max() < 24 and len(index.unique()) > cfg.num_experts_per_tok   # a choice among them, none beyond
    with pytest.raises(Exception, match=r"--routable_experts: expected 6\.\.128 .* got 4"):
        write_shaped_checkpoint(config, tmp_path / "few", pattern="E", mtp=False, log=lambda m: None, routable_experts=4)
    assert not (tmp_path / "few").exists()
