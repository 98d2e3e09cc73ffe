"""NVFP4 weights leave the plan under --strip_plan: the packed FP4 bytes, FP8 block scales and FP32
global scales of every FP4 linear and expert stack are engine inputs (tensorrt_rtx without a GPU) or
named refittable constants (full TensorRT), each viewing the engine directory's packed weights file.
Checked against the file's own tensors and the network's own constants; the stripped network, fed
the map's bytes, is evaluated by the CPU interpreter against the eager NVFP4 model."""
from __future__ import annotations

import json

import pytest
import torch

from runtime.loading import tensorrt_available

from builder import build_memory
from builder.backends.trt_import import trt
from builder.checkpoint import convert_weights, load_nvfp4_checkpoint
from builder.engine import BuildOptions, build, record, target_component, write_target_weights
from builder.interpreter import run_network
from builder.models.nemotron_h import NemotronH
from builder.nvfp4_format import NVFP4Weight
from builder.refit import Provenance, network_shape, read_refit_map, refit_tensors
from builder.safetensors_io import mmap_tensors
from runtime.state import chunk_inputs
from test_strip_plan import _constants
from tolerances import assert_within, lm_head_bound, logit_order_bound

OPTIONS = BuildOptions(max_batch_size=2, max_input_len=8, max_seq_len=16, max_draft_len=7)  # one profile
FILE = "weights/target.safetensors"


@pytest.fixture(scope="module")
def nvfp4_moe(checkpoints, tmp_path_factory):
    """The tiny MoE NemotronH (Mamba, MoE, attention, MoE) quantized to NVFP4 W4A16."""
    from builder.quantize_checkpoint import quantize_checkpoint
    out = tmp_path_factory.mktemp("nvfp4") / "q"
    quantize_checkpoint(checkpoints["moe"], out, log=lambda m: None)
    return out


def _directory(ckpt, directory, dtype=torch.float32):
    """What `build --strip_plan` does with an NVFP4 checkpoint before recording (the same function)."""
    config, weights = load_nvfp4_checkpoint(ckpt, keep_quantized=True)
    (directory / "weights").mkdir(parents=True)
    weights, mapped = write_target_weights(directory, convert_weights(weights, dtype), dtype, packed=True)
    return config, weights, mapped


def _feeds(module):
    ids, positions, lengths = chunk_inputs([[5, 9, 17, 33, 4, 8], [7, 3]], [0, 0])
    feeds = {"input_ids": ids, "positions": positions, "lengths": lengths,
             "logit_index": torch.tensor([[5], [1]], dtype=torch.int32)}
    for name, (shape, dtype) in module.state_spec(2, 16).items():
        feeds["past." + name] = torch.zeros(shape, dtype=dtype)
    return feeds


def _nvfp4_groups(weights, config):
    """(packed tensor names, logical shape) of every FP4 linear and expert stack the model binds."""
    groups = [([n], tuple(w.shape)) for n, w in weights.items() if isinstance(w, NVFP4Weight) and ".experts." not in n]
    for layer in config.layer_indices("moe"):
        for proj in ("up_proj", "down_proj"):
            names = [f"backbone.layers.{layer}.mixer.experts.{e}.{proj}.weight" for e in range(config.n_routed_experts)]
            groups.append((names, (len(names), *weights[names[0]].shape)))
    return groups


def _check_map(entries, values, mapped, groups):
    """Every FP4 linear and expert stack has its three entries, each the file's tensors' very bytes."""
    by_tensors = {tuple(e["tensors"]): n for n, e in entries.items()}
    for names, shape in groups:
        packed, scale, scale_2 = (by_tensors[tuple(n + suffix for n in names)] for suffix in ("", "_scale", "_scale_2"))
        e = entries[packed]
        assert (e["dtype"], e["network"]) == ("U8", {"dtype": "FP4", "shape": list(shape)}), names[0]
        assert e["shape"] == [*shape[:-1], shape[-1] // 2], names[0]
        e = entries[scale]
        assert (e["dtype"], e["network"]) == ("F8_E4M3", {"dtype": "FP8", "shape": [*shape[:-1], shape[-1] // 16]})
        e = entries[scale_2]
        assert e["dtype"] == "F32" and e["shape"] == list(shape[:-2]) and "network" not in e, names[0]
        for name in (packed, scale, scale_2):
            assert entries[name]["file"] == FILE
            want = torch.cat([mapped[n].reshape(-1).view(torch.uint8) for n in entries[name]["tensors"]])
            assert torch.equal(values[name].contiguous().reshape(-1).view(torch.uint8), want), name


def test_nvfp4_weights_are_inputs_viewing_the_file_and_the_network_computes_like_eager(nvfp4_moe, tmp_path):
    config, weights, mapped = _directory(nvfp4_moe, tmp_path)
    module = NemotronH(config, weights, torch.float32)
    component = target_component(module, OPTIONS)
    recorder, _ = record(component, refit=Provenance([(FILE, mapped)]), refit_method="inputs")
    network, entries = recorder.network, recorder.refit_weights
    # no FP4 or FP8 constant is left in the plan; every FP4 linear and expert stack is three inputs
    kinds = {network.get_layer(i).get_output(0).dtype for i in range(network.num_layers)
             if network.get_layer(i).type == trt.LayerType.CONSTANT}
    assert not kinds & {trt.DataType.FP4, trt.DataType.FP8}
    groups = _nvfp4_groups(weights, config)
    assert {len(names) for names, _ in groups} == {1, config.n_routed_experts}  # linears and expert stacks
    _check_map(entries, refit_tensors(tmp_path, entries), mapped, groups)
    inputs = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
    for name, e in entries.items():
        assert e["input"] and list(inputs[name].shape) == network_shape(e)
    fp4_bytes = sum(t.numel() for n, t in mapped.items() if t.dtype == torch.uint8)
    assert recorder.plan_bytes < 0.05 * sum(t.numel() * t.element_size() for t in mapped.values())  # (A, masks)
    # every packed tensor of the file is bound by some input
    bound = {n for e in entries.values() for n in e["tensors"]}
    assert {n for n, t in mapped.items() if t.dtype in (torch.uint8, torch.float8_e4m3fn)} <= bound and fp4_bytes
    # the stripped network fed the map's bytes (FP4 packed, FP8 as stored) computes the eager NVFP4 model
    feeds = _feeds(module)
    want = component.call(feeds)
    got = run_network(network, {**feeds, **refit_tensors(tmp_path, entries)})
    exact = NemotronH(config, weights, torch.float64)  # the same weights, dequantized in fp64: the spread
    state = {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in exact.state_spec(2, 16).items()}
    exact_logits = exact.forward(feeds["input_ids"], feeds["positions"], feeds["lengths"], feeds["logit_index"],
                                 state)[0]
    spread = float((want["logits"].double() - exact_logits).abs().max())
    bound = logit_order_bound(lm_head_bound(module.norm_f, module.lm_head), spread)
    assert_within(got["logits"], want["logits"], bound, "logits")
    # ... exactly what the same network with FP4 constants computes (the inputs carry the same bytes)
    plain, _ = record(component)
    assert torch.equal(run_network(plain.network, feeds)["logits"], got["logits"])


def test_nvfp4_refit_map_names_the_fp4_and_fp8_constants(nvfp4_moe, tmp_path):
    """Method "refit" (full TensorRT; recorded here, built on a GPU): FP4 and FP8 constants are named
    refittable weights whose map entries are the bytes TensorRT was given."""
    config, weights, mapped = _directory(nvfp4_moe, tmp_path)
    recorder, _ = record(target_component(NemotronH(config, weights, torch.float32), OPTIONS),
                         refit=Provenance([(FILE, mapped)]))
    entries = recorder.refit_weights
    constants = _constants(recorder.network)
    values = refit_tensors(tmp_path, entries)
    for name, e in entries.items():
        assert torch.equal(values[name].contiguous().reshape(-1).view(torch.uint8), constants[e["layer"]]), name
    by_tensors = {tuple(e["tensors"]): e for e in entries.values()}
    for names, shape in _nvfp4_groups(weights, config):
        assert by_tensors[tuple(names)]["network"] == {"dtype": "FP4", "shape": list(shape)}
        assert by_tensors[tuple(n + "_scale" for n in names)]["network"]["dtype"] == "FP8"
        assert tuple(n + "_scale_2" for n in names) in by_tensors
    assert recorder.plan_bytes < 0.05 * sum(t.numel() * t.element_size() for t in mapped.values())


def test_strip_plan_build_of_an_nvfp4_moe(nvfp4_moe, tmp_path):
    """`nemospec build --strip_plan`: the weights file holds the FP4 bytes once, the plan none of them,
    the estimate counts no NVFP4 plan bytes, and the TorchRunner reads the packed file back."""
    from runtime.loading import open_engine_dir
    out = tmp_path / "e"
    report = build(nvfp4_moe, out, BuildOptions(**{**OPTIONS.__dict__, "strip_plan": True}), log=lambda m: None)
    meta = json.loads((out / "config.json").read_text())
    assert meta["weights_format"] == "nvfp4_w4a16"
    stored = mmap_tensors(out / "weights" / "target.safetensors")
    fp4 = {n for n, t in stored.items() if t.dtype == torch.uint8}
    assert fp4 and all(n + "_scale" in stored and n + "_scale_2" in stored for n in fp4)
    maps = read_refit_map(out)["target"]
    assert maps["method"] == "inputs"
    assert fp4 <= {n for e in maps["weights"].values() for n in e["tensors"]}
    assert any(e.get("network", {}).get("dtype") == "FP4" and len(e["tensors"]) == 8 for e in maps["weights"].values())
    config = meta["model"]
    est = report["memory_estimate"]
    assert est["peak_bytes"] == build_memory.BASE_BYTES + build_memory.STRIPPED_PLAN_BYTES + \
        build_memory.GRAPH_BYTES_PER_LAYER * len(config["layer_types"])
    # the TorchRunner computes what the eager NVFP4 module computes
    config_, weights = load_nvfp4_checkpoint(nvfp4_moe, keep_quantized=True)
    module = NemotronH(config_, convert_weights(weights, torch.float32), torch.float32)
    feeds = _feeds(module)
    want = target_component(module, OPTIONS).call(feeds)["logits"]
    runner = open_engine_dir(out, backend="torch").runner
    got, _, _ = runner.forward(feeds["input_ids"], feeds["positions"], feeds["lengths"], feeds["logit_index"],
                               runner.new_state(2, 16))
    assert torch.equal(got, want)


@pytest.mark.skipif(not tensorrt_available(),
                    reason="running a weight-stripped engine (FP4 inputs bound, or refit) needs a CUDA GPU with TensorRT")
def test_stripped_nvfp4_engine_generates_like_torch(nvfp4_moe, tmp_path):
    from runtime.generation import generate
    from runtime.loading import open_engine_dir
    out = tmp_path / "e"
    build(nvfp4_moe, out, BuildOptions(**{**OPTIONS.__dict__, "strip_plan": True}), log=lambda m: None)
    prompts = [[5, 9, 17, 33], [7, 3]]
    want = generate(open_engine_dir(out, backend="torch").runner, prompts, 4).output_ids
    assert generate(open_engine_dir(out, backend="tensorrt").runner, prompts, 4).output_ids == want
