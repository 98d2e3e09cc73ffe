"""builder.config / builder.checkpoint against checkpoints written by transformers (the authority)."""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from builder.checkpoint import (
    INDEX_FILE,
    SAFETENSORS_FILE,
    checkpoint_files,
    checkpoint_hash,
    expected_tensors,
    load_checkpoint,
    optional_tensors,
)
from builder.config import NemotronHConfig, load_config, parse_hf_config
from builder.errors import BuildError, CheckpointError, NemospecError

try:
    from tests.tiny_models import tiny_checkpoint
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    from tiny_models import tiny_checkpoint


# --- helpers -------------------------------------------------------------------------------------
def read_raw(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in a directory, names as stored."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def rewrite(src: Path, dst: Path, edit=None, config_edit=None) -> Path:
    """Copy a checkpoint as one model.safetensors with edited tensors and/or config."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = read_raw(src)
    if edit is not None:
        tensors = edit(dict(tensors))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / SAFETENSORS_FILE))
    config = json.loads((src / "config.json").read_text())
    if config_edit is not None:
        config = config_edit(config) or config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def hf_raw(**kw) -> dict:
    return {"model_type": "nemotron_h", **kw}


def assert_one_line(err: pytest.ExceptionInfo, *parts: str) -> str:
    msg = str(err.value)
    assert "\n" not in msg and msg
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


@pytest.fixture(scope="session")
def dense(tmp_path_factory):
    return tiny_checkpoint("dense", tmp_path_factory)


@pytest.fixture(scope="session")
def moe(tmp_path_factory):
    return tiny_checkpoint("moe", tmp_path_factory)


@pytest.fixture(scope="session")
def two_attention(tmp_path_factory):
    return tiny_checkpoint("two_attention", tmp_path_factory)


@pytest.fixture(scope="session")
def sharded(tmp_path_factory):
    return tiny_checkpoint("sharded", tmp_path_factory)


# --- loading what transformers writes ------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dense", "moe", "two_attention"])
def test_tiny_kinds_load_with_every_expected_tensor(kind, request):
    directory = request.getfixturevalue(kind)
    config, tensors = load_checkpoint(directory)
    spec = expected_tensors(config)
    assert list(tensors) == list(spec)
    for name, shape in spec.items():
        assert tuple(tensors[name].shape) == shape, name
        assert tensors[name].dtype == torch.float32
    # transformers wrote exactly the canonical names.
    raw = read_raw(directory)
    assert set(raw) == set(spec)
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.time_step_min == 0.0 and config.dtype == "float32"


def test_kinds_have_the_advertised_layers(dense, moe, two_attention):
    assert load_config(dense).hybrid_override_pattern == "M-M*-M-"
    m = load_config(moe)
    assert m.layer_types == ("mamba", "moe", "attention", "moe", "mamba", "mlp")
    assert m.n_shared_experts == 1 and m.num_experts_per_tok == 2
    assert load_config(two_attention).layer_indices("attention") == (1, 4)


def test_names_match_transformers_state_dict(moe):
    from transformers import NemotronHForCausalLM

    model = NemotronHForCausalLM.from_pretrained(str(moe))
    config, tensors = load_checkpoint(moe)
    ours = {}
    for name, t in model.state_dict().items():
        name = "backbone." + name[len("model."):] if name.startswith("model.") else name
        if name.endswith("experts.up_proj") or name.endswith("experts.down_proj"):
            base, proj = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                ours[f"{base}.{e}.{proj}.weight"] = t[e]
        else:
            ours[name] = t
    assert set(ours) == set(tensors)
    for name in tensors:
        assert torch.equal(ours[name], tensors[name]), name


def test_moe_layer_tensor_names(moe):
    config = load_config(moe)
    spec = expected_tensors(config)
    layer = sorted(n for n in spec if n.startswith("backbone.layers.1."))
    assert "backbone.layers.1.mixer.gate.e_score_correction_bias" in layer
    assert spec["backbone.layers.1.mixer.experts.7.up_proj.weight"] == (16, 32)
    assert spec["backbone.layers.1.mixer.experts.7.down_proj.weight"] == (32, 16)
    assert spec["backbone.layers.1.mixer.shared_experts.up_proj.weight"] == (32, 32)
    assert len([n for n in layer if ".experts." in n]) == 16


def test_sharded_equals_unsharded(dense, sharded):
    assert (sharded / INDEX_FILE).is_file() and len(checkpoint_files(sharded)) == 2
    c1, t1 = load_checkpoint(dense)
    c2, t2 = load_checkpoint(sharded)
    assert c1 == c2 and list(t1) == list(t2)
    for name in t1:
        assert torch.equal(t1[name], t2[name]), name


def test_model_prefix_alias(dense, tmp_path):
    out = rewrite(dense, tmp_path / "m", lambda t: {("model." + k[9:] if k.startswith("backbone.") else k): v
                                                    for k, v in t.items()})
    assert any(k.startswith("model.") for k in read_raw(out))
    _, ref = load_checkpoint(dense)
    _, got = load_checkpoint(out)
    assert list(got) == list(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_duplicate_after_alias_is_refused(dense, tmp_path):
    out = rewrite(dense, tmp_path / "d", lambda t: {**t, "model.norm_f.weight": t["backbone.norm_f.weight"].clone()})
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(out)
    assert_one_line(err, "model.norm_f.weight", "backbone.norm_f.weight")


def test_fused_experts_are_split(moe, tmp_path):
    config = load_config(moe)

    def fuse(t):
        for layer in config.layer_indices("moe"):
            for proj in ("up_proj", "down_proj"):
                names = [f"backbone.layers.{layer}.mixer.experts.{e}.{proj}.weight"
                         for e in range(config.n_routed_experts)]
                t[f"model.layers.{layer}.mixer.experts.{proj}"] = torch.stack([t.pop(n) for n in names])
        return t

    out = rewrite(moe, tmp_path / "fused", fuse)
    assert "model.layers.1.mixer.experts.up_proj" in read_raw(out)
    _, ref = load_checkpoint(moe)
    _, got = load_checkpoint(out)
    assert list(got) == list(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_fused_experts_wrong_shape(moe, tmp_path):
    def fuse_bad(t):
        names = [f"backbone.layers.1.mixer.experts.{e}.up_proj.weight" for e in range(8)]
        t["backbone.layers.1.mixer.experts.up_proj"] = torch.stack([t.pop(n) for n in names])[:7]
        return t

    with pytest.raises(CheckpointError) as err:
        load_checkpoint(rewrite(moe, tmp_path / "bad", fuse_bad))
    assert_one_line(err, "backbone.layers.1.mixer.experts.up_proj", "[7, 16, 32]", "[8, 16, 32]")


def test_tied_embeddings(tmp_path_factory, tmp_path):
    tied = tiny_checkpoint("dense", tmp_path_factory, tie_word_embeddings=True)
    config, tensors = load_checkpoint(tied)
    assert config.tie_word_embeddings
    assert "lm_head.weight" not in expected_tensors(config) and "lm_head.weight" in optional_tensors(config)
    # transformers 5.24 writes (and uses) lm_head.weight even when tied: kept as it is.
    assert "lm_head.weight" in tensors
    assert torch.equal(tensors["lm_head.weight"], tensors["backbone.embeddings.weight"])  # tiny_models ties values
    out = rewrite(tied, tmp_path / "nohead", lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    _, tensors = load_checkpoint(out)
    assert "lm_head.weight" not in tensors  # not invented


def test_mtp_tensors_pass_through(dense, tmp_path):
    extra = {"mtp.layers.0.mixer.q_proj.weight": torch.randn(3, 5), "mtp.enorm.weight": torch.ones(64)}
    out = rewrite(dense, tmp_path / "mtp", lambda t: {**t, **extra})
    _, tensors = load_checkpoint(out)
    for k, v in extra.items():
        assert torch.equal(tensors[k], v)
    out = rewrite(dense, tmp_path / "mtp_int", lambda t: {**t, "mtp.bad": torch.zeros(2, dtype=torch.int32)})
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(out)
    assert_one_line(err, "mtp.bad", "int32")


# --- config parsing ------------------------------------------------------------------------------
def test_defaults_equal_transformers():
    import transformers

    hf = transformers.NemotronHConfig()
    ours = NemotronHConfig()
    kind = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
    for f in dataclasses.fields(ours):
        value = getattr(ours, f.name)
        if f.name in ("layer_types", "mtp_layer_types"):
            ref = tuple(kind[k] for k in getattr(hf, "layers_block_type" if f.name == "layer_types"
                                                   else "mtp_layers_block_type"))
        elif f.name == "dtype":
            continue
        else:
            ref = getattr(hf, f.name)
            ref = tuple(ref) if isinstance(ref, list) else ref
        assert value == ref, f.name
    assert parse_hf_config(hf_raw()) == ours


def test_legacy_aliases_like_transformers():
    import transformers

    raw = dict(mamba_n_groups=4, mamba_d_conv=3, mamba_dt_min=0.002, mamba_dt_max=0.2, mamba_dt_limit=[0.0, 5.0],
               mamba_conv_bias=False, mamba_chunk_size=64, n_groups=2, hybrid_override_pattern="M*",
               mtp_hybrid_override_pattern="*-", num_nextn_predict_layers=1, torch_dtype="bfloat16")
    hf = transformers.NemotronHConfig(**raw)
    ours = parse_hf_config(hf_raw(**raw))
    assert (ours.n_groups, ours.conv_kernel, ours.time_step_min, ours.time_step_max, ours.use_conv_bias,
            ours.chunk_size) == (hf.n_groups, hf.conv_kernel, hf.time_step_min, hf.time_step_max,
                                 hf.use_conv_bias, hf.chunk_size)
    assert ours.time_step_limit == tuple(hf.time_step_limit) == (0.0, 5.0)
    assert ours.layer_types == ("mamba", "attention") and ours.mtp_layer_types == ("attention", "mlp")
    assert ours.dtype == "bfloat16"


def test_pattern_and_block_type_spellings_agree():
    a = parse_hf_config(hf_raw(hybrid_override_pattern="ME*-M"))
    b = parse_hf_config(hf_raw(layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "mamba"]))
    c = parse_hf_config(hf_raw(layers_block_type=["mamba", "moe", "attention", "mlp", "linear_attention"]))
    assert a.layer_types == b.layer_types == c.layer_types == ("mamba", "moe", "attention", "mlp", "mamba")
    assert a == b == c
    # an explicit list wins over the pattern, as in transformers
    d = parse_hf_config(hf_raw(hybrid_override_pattern="MMM", layers_block_type=["mlp"]))
    assert d.layer_types == ("mlp",)
    m1 = parse_hf_config(hf_raw(mtp_hybrid_override_pattern="*E"))
    m2 = parse_hf_config(hf_raw(mtp_layers_block_type=["full_attention", "moe"]))
    m3 = parse_hf_config(hf_raw(mtp_layers_block_type=["attention", "mlp"]))
    assert m1.mtp_layer_types == m2.mtp_layer_types == ("attention", "moe")
    assert m3.mtp_layer_types == ("attention", "mlp")


def test_inf_encodings_and_round_trip(dense):
    text = (dense / "config.json").read_text()
    assert '"__float__": "Infinity"' in text  # what transformers writes
    config = load_config(dense)
    assert config.time_step_limit == (0.0, math.inf)
    for spelling in ({"__float__": "Infinity"}, "inf", "Infinity", 1e400, float("inf")):
        assert parse_hf_config(hf_raw(time_step_limit=[0.0, spelling])).time_step_limit == (0.0, math.inf)
    assert parse_hf_config(hf_raw(time_step_limit=[0.01, 3])).time_step_limit == (0.01, 3.0)
    text = json.dumps(config.to_dict(), allow_nan=False)
    assert NemotronHConfig.from_dict(json.loads(text)) == config


@pytest.mark.parametrize("kind", ["dense", "moe", "two_attention"])
def test_to_dict_from_dict_round_trip(kind, request):
    config = load_config(request.getfixturevalue(kind))
    back = NemotronHConfig.from_dict(json.loads(json.dumps(config.to_dict(), allow_nan=False)))
    assert back == config and hash(back) == hash(config)
    odd = dataclasses.replace(config, eos_token_id=(2, 7), moe_latent_size=12, bos_token_id=None,
                              routed_scaling_factor=2.5, time_step_limit=(1e-4, 123.456789))
    assert NemotronHConfig.from_dict(json.loads(json.dumps(odd.to_dict(), allow_nan=False))) == odd
    assert config.mamba_intermediate_size == config.mamba_num_heads * config.mamba_head_dim
    assert config.conv_dim == config.mamba_intermediate_size + 2 * config.n_groups * config.ssm_state_size
    assert config.num_layers == len(config.layer_types)


def test_from_dict_is_strict():
    d = NemotronHConfig().to_dict()
    with pytest.raises(CheckpointError) as err:
        NemotronHConfig.from_dict({k: v for k, v in d.items() if k != "hidden_size"}, source="engine/config.json")
    assert_one_line(err, "engine/config.json", "hidden_size")


def test_latent_moe_spec():
    c = parse_hf_config(hf_raw(hybrid_override_pattern="E", moe_latent_size=12, mlp_bias=True, hidden_size=32,
                               n_routed_experts=4, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24))
    spec = expected_tensors(c)
    assert spec["backbone.layers.0.mixer.fc1_latent_proj.weight"] == (12, 32)
    assert spec["backbone.layers.0.mixer.fc2_latent_proj.bias"] == (32,)
    assert spec["backbone.layers.0.mixer.experts.3.up_proj.weight"] == (16, 12)
    assert spec["backbone.layers.0.mixer.experts.3.down_proj.weight"] == (12, 16)


# --- errors --------------------------------------------------------------------------------------
def test_error_classes():
    assert issubclass(CheckpointError, NemospecError) and issubclass(BuildError, NemospecError)
    assert "\n" not in str(CheckpointError("a\nb"))


def write_config(tmp_path: Path, raw) -> Path:
    (tmp_path / "config.json").write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("raw, parts", [
    ({"model_type": "llama"}, ["config.json", "model_type", "nemotron_h", "llama"]),
    ({}, ["config.json", "model_type", "no model_type"]),
    (hf_raw(hybrid_override_pattern="M-X*"), ["config.json", "hybrid_override_pattern", "'X'", "position 2"]),
    (hf_raw(mtp_hybrid_override_pattern="*Q"), ["mtp_hybrid_override_pattern", "'Q'", "position 1"]),
    (hf_raw(layers_block_type=["mamba", "sliding_attention"]), ["layers_block_type", "sliding_attention",
                                                                "position 1"]),
    (hf_raw(hidden_size=0), ["config.json", "hidden_size", "positive", "0"]),
    (hf_raw(vocab_size=-3), ["vocab_size", "-3"]),
    (hf_raw(vocab_size=2048, eos_token_id=99999), ["eos_token_id", "99999", "outside the vocabulary"]),   # never stopped
    (hf_raw(vocab_size=2048, eos_token_id=[-5, 4096]), ["eos_token_id", "-5", "outside the vocabulary"]),
    (hf_raw(hidden_size="big"), ["hidden_size", "integer", "big"]),
    (hf_raw(num_attention_heads=4, num_key_value_heads=3), ["num_attention_heads", "num_key_value_heads=3"]),
    (hf_raw(mamba_num_heads=6, n_groups=4), ["mamba_num_heads", "n_groups=4", "6"]),
    (hf_raw(n_routed_experts=6, n_group=4), ["n_routed_experts", "n_group=4", "6"]),
    (hf_raw(torch_dtype="int8"), ["torch_dtype", "int8"]),
    (hf_raw(time_step_limit=[0.0]), ["time_step_limit"]),
    # infinite values built engines that generate token 0 only (exit 0)
    (hf_raw(time_step_limit=["inf", "inf"]), ["time_step_limit", "finite min"]),
    (hf_raw(layer_norm_epsilon={"__float__": "Infinity"}), ["layer_norm_epsilon", "finite", "inf"]),
    (hf_raw(routed_scaling_factor="inf"), ["routed_scaling_factor", "finite", "inf"]),
    (hf_raw(mamba_dt_min=1e400), ["time_step_min", "finite", "inf"]),
    (hf_raw(tie_word_embeddings="yes"), ["tie_word_embeddings", "yes"]),
    (hf_raw(hybrid_override_pattern="M*-", num_hidden_layers=4),   # transformers warns, follows the pattern
     ["num_hidden_layers", "4", "'hybrid_override_pattern' has 3 layers"]),
    (hf_raw(layers_block_type=["mamba", "moe"], num_hidden_layers=3), ["num_hidden_layers", "'layers_block_type' has 2"]),
])
def test_config_errors(tmp_path, raw, parts):
    with pytest.raises(CheckpointError) as err:
        load_config(write_config(tmp_path, raw))
    assert_one_line(err, *parts)


def test_config_file_errors(tmp_path):
    with pytest.raises(CheckpointError) as err:
        load_config(tmp_path)
    assert_one_line(err, "config.json", "missing")
    with pytest.raises(CheckpointError) as err:
        load_config(write_config(tmp_path, '{"model_type": "nemotron_h",\n "x": }'))
    assert_one_line(err, "config.json", "invalid JSON", "line 2")
    with pytest.raises(CheckpointError) as err:
        load_config(tmp_path / "nope")
    assert_one_line(err, "nope", "not found")


def test_missing_tensor(dense, sharded, tmp_path):
    out = rewrite(dense, tmp_path / "m", lambda t: {k: v for k, v in t.items() if k != "backbone.layers.2.mixer.D"})
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(out)
    assert_one_line(err, "model.safetensors", "missing tensor", "backbone.layers.2.mixer.D", "[8]")
    # sharded: the index should have named it
    out = tmp_path / "s"
    shutil.copytree(sharded, out)
    index = json.loads((out / INDEX_FILE).read_text())
    del index["weight_map"]["backbone.norm_f.weight"]
    (out / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(out)
    assert_one_line(err, INDEX_FILE, "backbone.norm_f.weight", "weight_map")


def test_missing_shard(sharded, tmp_path):
    out = tmp_path / "s"
    shutil.copytree(sharded, out)
    shard = sorted(out.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(out)
    assert_one_line(err, INDEX_FILE, shard.name, "missing")


def test_wrong_shape(dense, tmp_path):
    name = "backbone.layers.3.mixer.k_proj.weight"
    out = rewrite(dense, tmp_path / "w", lambda t: {**t, name: torch.zeros(16, 64)})
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(out)
    assert_one_line(err, name, "[16, 64]", "[32, 64]", "model.safetensors")


def test_int_dtype(dense, tmp_path):
    name = "backbone.layers.0.mixer.A_log"
    out = rewrite(dense, tmp_path / "i", lambda t: {**t, name: t[name].to(torch.int64)})
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(out)
    assert_one_line(err, name, "int64", "float32")


def test_half_dtypes_accepted(dense, tmp_path):
    out = rewrite(dense, tmp_path / "h", lambda t: {k: v.to(torch.bfloat16 if "mixer" in k else torch.float16)
                                                    for k, v in t.items()})
    _, tensors = load_checkpoint(out)
    assert tensors["backbone.layers.0.mixer.D"].dtype == torch.bfloat16
    assert tensors["backbone.embeddings.weight"].dtype == torch.float16


def test_pickle_checkpoint_refused(dense, tmp_path):
    shutil.copy(dense / "config.json", tmp_path / "config.json")
    torch.save({"backbone.embeddings.weight": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    assert_one_line(err, "pytorch_model.bin", "pickle checkpoints are refused: safetensors only")


def test_extra_unknown_tensor(dense, tmp_path):
    out = rewrite(dense, tmp_path / "x", lambda t: {**t, "backbone.layers.0.mixer.gate_proj.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(out)
    assert_one_line(err, "unexpected tensor", "backbone.layers.0.mixer.gate_proj.weight", "model.safetensors")


def test_checkpoint_hash(dense, sharded, tmp_path):
    h = checkpoint_hash(dense)
    assert len(h) == 64 and int(h, 16) >= 0
    same = rewrite(dense, tmp_path / "same")
    shutil.copy(dense / "config.json", same / "config.json")
    assert checkpoint_hash(dense) == h
    changed = rewrite(dense, tmp_path / "changed",
                      lambda t: {**t, "backbone.norm_f.weight": t["backbone.norm_f.weight"] + 1e-3})
    shutil.copy(dense / "config.json", changed / "config.json")
    assert checkpoint_hash(changed) != checkpoint_hash(same)
    assert checkpoint_hash(sharded) != h


def test_a_config_without_a_dtype_takes_the_weights_own(tmp_path):
    """transformers' torch_dtype="auto" falls back to the weights' dtype where config.json names none;
    nemospec took float32 and built a bf16 checkpoint at twice its bytes."""
    import json
    import shutil

    from builder import embedded
    from builder.checkpoint import load_checkpoint
    src = embedded.ROOT / "draft_target"   # bf16 tensors
    shutil.copytree(src, tmp_path / "c")
    raw = json.loads((tmp_path / "c" / "config.json").read_text())
    assert raw.pop("dtype") == "bfloat16"
    raw.pop("torch_dtype", None)
    (tmp_path / "c" / "config.json").write_text(json.dumps(raw))
    config, weights = load_checkpoint(tmp_path / "c")
    assert config.dtype == "bfloat16" and next(iter(weights.values())).dtype == torch.bfloat16
    (tmp_path / "c" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    assert load_checkpoint(tmp_path / "c")[0].dtype == "bfloat16"   # its eos set merged in, the note kept
    raw["dtype"] = "float32"   # a named dtype still wins
    (tmp_path / "c" / "config.json").write_text(json.dumps(raw))
    assert load_checkpoint(tmp_path / "c")[0].dtype == "float32"
