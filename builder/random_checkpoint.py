"""Small random NemotronH checkpoints written in the Hugging Face format, by our own code.

For the demo and benchmarks until a trained model ships (and for tests): transformers writes the
checkpoint (so its layout is the reference's), with weights re-drawn at a spread that gives peaked,
token-dependent logits instead of transformers' near-flat 0.02 init. Optionally a byte-level BPE
tokenizer is trained on local text (the running Python's standard library sources) so `--prompt`
works; nothing is downloaded.

Run as a module (``python -m builder.random_checkpoint --config CONFIG.json --output_dir D``) it writes
a checkpoint at a shipped model's real shapes instead, tensor by tensor: :mod:`builder.shaped_checkpoint`.
"""
from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch

DEFAULTS = dict(
    vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2,
    conv_kernel=4, chunk_size=16, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=64, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, layer_norm_epsilon=1e-5,
)


def reinitialise(model: torch.nn.Module, seed: int) -> None:
    """Weights with real spread: linear std 2/sqrt(fan_in), embeddings 0.5, router 1.0, norms 1 +- 0.1,
    A_log as transformers, softplus(dt_bias) log-uniform in [0.01, 0.1]."""
    g = torch.Generator().manual_seed(seed)
    heads = model.config.mamba_num_heads

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g) * std + mean

    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
            elif leaf == "dt_bias":
                dt = torch.exp(torch.rand(heads, generator=g) * (math.log(0.1) - math.log(0.01)) + math.log(0.01))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif leaf == "D":
                p.copy_(torch.rand(heads, generator=g) + 0.5)
            elif leaf == "e_score_correction_bias":
                p.copy_(normal(p.shape, 0.1))
            elif name.endswith("gate.weight"):
                p.copy_(normal(p.shape, 1.0))
            elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(normal(p.shape, 0.1, mean=1.0))
            elif leaf == "bias":
                p.copy_(normal(p.shape, 0.1))
            elif name.endswith("embeddings.weight"):
                p.copy_(normal(p.shape, 0.5))
            elif name.endswith("conv1d.weight"):
                p.copy_(normal(p.shape, 0.3))
            elif p.dim() >= 2:  # Linear weights [out, in] and fused experts [E, out, in]
                p.copy_(normal(p.shape, 2.0 / math.sqrt(p.shape[-1])))
            else:
                raise ValueError(f"random_checkpoint: no init rule for {name} {tuple(p.shape)}")


def build_model(config_kwargs: dict, seed: int = 0, tie_word_embeddings: bool = False):
    """transformers.NemotronHForCausalLM (fp32, eval) with non-degenerate random weights.

    ``time_step_min`` ends as 0.0: transformers clamps dt at it in prefill but not in its decode
    step; with 0.0 both paths agree (transformers needs it > 0 while initialising, hence after).
    transformers never ties NemotronH's lm_head (it writes and uses its own), so a tied model gets
    the embedding values in lm_head: "tied" then means the same whichever tensor a reader uses.
    """
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    config = NemotronHConfig(**config_kwargs, tie_word_embeddings=tie_word_embeddings, dtype="float32")
    model = NemotronHForCausalLM(config).to(torch.float32).eval()
    model.config.time_step_min = 0.0
    for module in model.modules():
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = (0.0, float("inf"))
    reinitialise(model, seed)
    if tie_word_embeddings:
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embeddings.weight)
    return model


def add_mtp_layers(directory, pattern: str = "*E", seed: int = 0) -> Path:
    """Appends random NemotronH MTP layers (``mtp.*``, vLLM's layout) to a checkpoint written here.

    transformers neither builds nor writes MTP layers, so they are drawn with the same spread as
    the other weights and the config gains ``num_nextn_predict_layers`` and the MTP pattern.
    """
    import json

    from safetensors.torch import load_file, save_file

    from builder.checkpoint import mtp_tensors
    from builder.config import load_config

    directory = Path(directory)
    raw = json.loads((directory / "config.json").read_text())
    raw.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern=pattern)
    raw.pop("mtp_layers_block_type", None)
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    config = load_config(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 1000)
    for name, shape in mtp_tensors(config).items():
        leaf = name.rsplit(".", 2)[-2]
        if name.endswith("norm.weight") or leaf in ("enorm", "hnorm", "final_layernorm"):
            value = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            value = 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("gate.weight"):
            value = torch.randn(shape, generator=g)
        else:
            value = torch.randn(shape, generator=g) * 2.0 / math.sqrt(shape[-1])
        tensors[name] = value.to(tensors["backbone.embeddings.weight"].dtype)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def write_layer_subset_draft(source, directory, keep_layers, noise: float = 0.0, seed: int = 0) -> Path:
    """A draft_target checkpoint cut from a target: the kept layers (renumbered), the embeddings,
    final norm and LM head, optionally with relative Gaussian noise. Same vocabulary and tokenizer,
    fewer layers: a draft that agrees with its target often but not always."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source, directory = Path(source), Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    raw = json.loads((source / "config.json").read_text())
    pattern = raw.get("hybrid_override_pattern") or "".join(
        {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}[k]
        for k in raw["layers_block_type"])
    raw.pop("layers_block_type", None)
    raw["hybrid_override_pattern"] = "".join(pattern[i] for i in keep_layers)
    raw["num_hidden_layers"] = len(keep_layers)
    raw["num_nextn_predict_layers"] = 0
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    tensors = load_file(str(source / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in tensors.items():
        if name.startswith("mtp."):
            continue
        if name.startswith("backbone.layers."):
            index = int(name.split(".")[2])
            if index not in keep_layers:
                continue
            name = name.replace(f"backbone.layers.{index}.", f"backbone.layers.{keep_layers.index(index)}.", 1)
        if noise and value.is_floating_point() and value.dim() >= 2:
            value = value + noise * value.std() * torch.randn(value.shape, generator=g).to(value.dtype)
        out[name] = value.contiguous()
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    for extra in ("tokenizer.json", "generation_config.json"):
        if (source / extra).is_file():
            shutil.copy2(source / extra, directory / extra)
    return directory


def stdlib_corpus(max_files: int = 60) -> list[Path]:
    """Python standard library sources of the running interpreter (PSF licence), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(root.glob("*.py"))[:max_files]


def train_tokenizer(vocab_size: int, files: list[Path]):
    """Byte-level BPE with <unk>=?, <pad>=0, <s>=1, </s>=2 as the first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in files], trainer)
    return tok


def write_random_checkpoint(directory, pattern: str = "M*E-M", seed: int = 0, tokenizer: bool = False,
                            dtype: str = "float32", mtp_pattern: str | None = None, **overrides) -> Path:
    """Writes config.json + model.safetensors (+ tokenizer.json) and returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = build_model(dict(DEFAULTS, hybrid_override_pattern=pattern, **overrides), seed)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
        model.config.dtype = dtype
    model.save_pretrained(str(directory))
    if mtp_pattern:
        add_mtp_layers(directory, mtp_pattern, seed)
    if tokenizer:
        tok = train_tokenizer(model.config.vocab_size, stdlib_corpus())
        tok.save(str(directory / "tokenizer.json"))
    return directory


def main(argv=None) -> int:
    """``python -m builder.random_checkpoint --config CONFIG.json --output_dir D ...``: a random checkpoint
    at a shipped model's shapes (see :mod:`builder.shaped_checkpoint`); exit 2 with one line on bad input."""
    import argparse
    import sys

    from builder.errors import NemospecError
    from builder.shaped_checkpoint import FILLS, write_shaped_checkpoint

    p = argparse.ArgumentParser(prog="python -m builder.random_checkpoint",
                                description="random NemotronH checkpoint with the tensor names and shapes of a "
                                            "public config.json (tests and benchmarks only)")
    p.add_argument("--config", required=True, help="a NemotronH config.json (e.g. benchmarks/configs/*.json)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--num_layers", type=int, default=None, help="keep the first N entries of the layer pattern")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--quantize", default=None, choices=["nvfp4_w4a16"], help="pack linears as ModelOpt NVFP4")
    p.add_argument("--vocab_size", type=int, default=None, help="a reduced vocabulary (default: the config's)")
    p.add_argument("--fill", default="random", choices=FILLS,
                   help="zeros: structure only (sparse files, no disk or time for the weights)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_shard_gb", type=float, default=4.0)
    p.add_argument("--pattern", default=None, help="tests: replace the layer pattern (e.g. '*': one attention block)")
    p.add_argument("--no_mtp", action="store_true", help="drop the config's MTP layers")
    p.add_argument("--routable_experts", type=int, default=None,
                   help="the router chooses among the first N experts only; the rest are sparse holes "
                        "(a full-width MoE layer in N/n_routed_experts of its disk)")
    args = p.parse_args(argv)
    try:
        summary = write_shaped_checkpoint(args.config, args.output_dir, args.num_layers, args.dtype, args.quantize,
                                          args.vocab_size, args.fill, args.seed, args.max_shard_gb,
                                          log=lambda m: print(m, file=sys.stderr), pattern=args.pattern,
                                          mtp=not args.no_mtp, routable_experts=args.routable_experts)
    except NemospecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import json
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
