"""The widened embedded model: the trained target at K times its width, and its drafts adapted.

The embedded target's weights sit in cache, so on it a verify of K+1 rows is compute-bound and
speculation cannot pay; every served model decodes from memory. Widening replicates every hidden
unit, Mamba head, attention head, MLP and expert unit of the trained target K times and divides each
linear map's input side by K (``widen_maps``): the wide model computes the trained function (up to
float rounding; transformers is the oracle) while its decode streams K^2 times the weights.

What each draft ties to the target widens with it; its own width stays, so its trained acceptance
and its small cost per proposal (as at 8B) both carry over:
* eagle3, peagle, dflash, dspark (and dspark_nvfp4): the fc over the target's captured features
  widens on its input side (P-EAGLE's learned ``mask_hidden`` feature tiles); the target's embedding
  (and, for the block drafts, its LM head) no longer fit the draft's width, so the draft ships the
  trained ones as its own ``embed_tokens`` / ``lm_head`` (a layout every loader already reads).
* eagle (EAGLE-1): its layer predicts the target's next feature and feeds the target's LM head, so
  its width is the target's: it widens whole, by the target's rule.
* mtp: its layers are the target's (``mtp.*``) and widen with it.
* draft_target: a separate model with its own embedding and head; copied unchanged.

    python -m builder.embedded.widen --factor 4 --output_dir DIR

DIR mirrors ``builder/embedded`` (``target/`` with its tokenizer, one directory per draft, a
MANIFEST.json), written whole or not at all.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from builder import embedded
from builder.atomic_dir import atomic_dir
from builder.embedded.widen_maps import Rule, TargetMaps, apply, heads_to_units, segments, tiled, widen_target_config
from builder.errors import ArgumentParser, CheckpointError, NemospecError

DEFAULT_FACTOR = 4
FEATURE_DRAFTS = ("eagle3", "peagle", "dflash", "dspark", "dspark_nvfp4")
OWN_HEAD = ("dflash", "dspark", "dspark_nvfp4")  # block drafts that read the target's LM head
KINDS = ("target", "eagle", *FEATURE_DRAFTS, "draft_target")
WEIGHTS = "model.safetensors"


def _load(directory: Path) -> tuple[dict, dict]:
    return json.loads((directory / "config.json").read_text()), load_file(str(directory / WEIGHTS))


def _save(directory: Path, cfg: dict, tensors: dict, copy_from: Path, extra=()) -> None:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(tensors, str(directory / WEIGHTS))
    for name in extra:
        if (copy_from / name).is_file():
            shutil.copy2(copy_from / name, directory / name)


def _widen(tensors: dict, rule_of, k: int, where: str) -> dict:
    out = {}
    for name, t in tensors.items():
        try:
            rule = rule_of(name)
        except KeyError:
            raise CheckpointError(f"{where}: tensor {name} has no widening rule (not the shipped checkpoint?)") from None
        out[name] = apply(t, rule, k)
    return out


def widen_target(src: Path, dst: Path, k: int) -> tuple[dict, dict]:
    cfg, tensors = _load(src)
    maps = TargetMaps(cfg, k)
    _save(dst, widen_target_config(cfg, k), _widen(tensors, maps.rule, k, f"{src / WEIGHTS}"), src,
          extra=("tokenizer.json", "tokenizer_config.json", "generation_config.json"))
    return cfg, tensors


class _LlamaMaps:
    """An EAGLE-1 draft's Llama layer, widened by the target's rule (hidden, whole heads, MLP units)."""

    def __init__(self, layer: dict, k: int):
        self.k, D, hd = k, layer["hidden_size"], layer["head_dim"]
        self.D, self.hidden = D, tiled(D, k)
        self.q = heads_to_units(tiled(layer["num_attention_heads"], k), hd)
        self.kv = heads_to_units(tiled(layer["num_key_value_heads"], k), hd)
        self.mlp = tiled(layer["intermediate_size"], k)

    def rule(self, name: str) -> Rule:
        h = self.hidden
        if name.endswith("norm.weight") or name == "fusion_fc.bias":
            return Rule(out=h)
        rules = {
            "fusion_fc.weight": Rule(out=h, inp=segments([h, h], [self.D, self.D]), divide=True),
            "transformer.self_attn.q_proj.weight": Rule(out=self.q, inp=h, divide=True),
            "transformer.self_attn.k_proj.weight": Rule(out=self.kv, inp=h, divide=True),
            "transformer.self_attn.v_proj.weight": Rule(out=self.kv, inp=h, divide=True),
            "transformer.self_attn.o_proj.weight": Rule(out=h, inp=self.q, divide=True),
            "transformer.mlp.gate_proj.weight": Rule(out=self.mlp, inp=h, divide=True),
            "transformer.mlp.up_proj.weight": Rule(out=self.mlp, inp=h, divide=True),
            "transformer.mlp.down_proj.weight": Rule(out=h, inp=self.mlp, divide=True),
        }
        return rules[name]


def widen_eagle(src: Path, dst: Path, k: int) -> None:
    cfg, tensors = _load(src)
    layer = cfg["transformer_layer_config"]
    maps = _LlamaMaps(layer, k)
    wide = dict(cfg, transformer_layer_config={
        **layer, **{key: int(layer[key]) * k for key in
                    ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")}})
    _save(dst, wide, _widen(tensors, maps.rule, k, f"{src / WEIGHTS}"), src)


def _fc_rule(D: int, k: int, cols: dict, quantized: bool):
    """The fc over the target's captured features widens on its input side. NVFP4 stores two values a
    byte and one scale per 16 inputs, so its columns tile in those units and are not divided (the
    1/K goes into the global scale)."""
    def rule(name: str) -> Rule:
        if name not in cols:
            return Rule()
        per = 16 if name.endswith("scale") else (2 if quantized else 1)
        if D % per:
            raise CheckpointError(f"{name}: target hidden_size {D} is not a multiple of {per}")
        width = D // per
        n = cols[name] // width
        return Rule(inp=segments([tiled(width, k)] * n, [width] * n), divide=not quantized)
    return rule


def widen_feature_draft(kind: str, src: Path, dst: Path, k: int, target_cfg: dict, target: dict) -> None:
    cfg, tensors = _load(src)
    D = int(cfg["target_hidden_size"])
    if D != target_cfg["hidden_size"]:
        raise CheckpointError(f"{src / 'config.json'}: target_hidden_size {D} != the target's {target_cfg['hidden_size']}")
    quantized = "fc.weight_scale" in tensors
    cols = {n: tensors[n].shape[1] for n in ("fc.weight", "fc.weight_scale") if n in tensors}
    out = _widen(tensors, _fc_rule(D, k, cols, quantized), k, f"{src / WEIGHTS}")
    if quantized:
        out["fc.weight_scale_2"] = tensors["fc.weight_scale_2"].float() / k
    if "mask_hidden" in out:
        m = out["mask_hidden"]
        n = m.shape[-1] // D
        out["mask_hidden"] = m.index_select(-1, segments([tiled(D, k)] * n, [D] * n)).contiguous()
    out.setdefault("embed_tokens.weight", target["backbone.embeddings.weight"].clone())
    if kind in OWN_HEAD:
        out.setdefault("lm_head.weight", target["lm_head.weight"].clone())
    _save(dst, dict(cfg, target_hidden_size=D * k), out, src, extra=("hf_quant_config.json",))


def _copy(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)


def source_kinds(root: Path) -> dict[str, Path]:
    """The shipped directories under ``root``, each checked against root's MANIFEST.json."""
    manifest = root / "MANIFEST.json"
    if not manifest.is_file():
        raise CheckpointError(f"{manifest}: missing (the source must be the shipped embedded model)")
    try:
        entries = json.loads(manifest.read_text()).get("checkpoints", {})
    except (UnicodeDecodeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{manifest}: not the shipped manifest ({type(e).__name__}: {e})") from None
    out = {}
    for kind in KINDS:
        entry = entries.get(kind) if isinstance(entries, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("files"), dict):
            raise CheckpointError(f"{manifest}: no checkpoint named {kind} with its files")
        for file, digest in entry["files"].items():
            path = root / kind / file
            if not path.is_file() or embedded.sha256(path) != digest:
                raise CheckpointError(f"{path}: {'missing' if not path.is_file() else 'SHA-256 differs from'} "
                                      f"the shipped embedded model's manifest")
        out[kind] = root / kind
    return out


def widen(output_dir: str | os.PathLike, factor: int = DEFAULT_FACTOR, source: str | os.PathLike | None = None,
          log=print) -> Path:
    """Writes the widened embedded model into ``output_dir`` (whole or not at all); returns it."""
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise CheckpointError(f"--factor: expected an integer >= 1, got {factor!r}")
    root = Path(source) if source is not None else embedded.ROOT
    kinds = source_kinds(root)
    output_dir = Path(output_dir)
    with atomic_dir(output_dir, replaceable=_earlier_output) as tmp:
        target_cfg, target = widen_target(kinds["target"], tmp / "target", factor)
        widen_eagle(kinds["eagle"], tmp / "eagle", factor)
        for kind in FEATURE_DRAFTS:
            widen_feature_draft(kind, kinds[kind], tmp / kind, factor, target_cfg, target)
        _copy(kinds["draft_target"], tmp / "draft_target")
        source_digest = hashlib.sha256((root / "MANIFEST.json").read_bytes()).hexdigest()
        embedded.write_manifest(list(KINDS), {"widened": {"factor": factor, "source_manifest": source_digest}},
                                root=tmp)
    log(f"widened the embedded model {factor}x into {output_dir} "
        f"(target hidden {target_cfg['hidden_size'] * factor}, "
        f"{(output_dir / 'target' / WEIGHTS).stat().st_size / 1e6:.0f} MB)")
    return output_dir


def _earlier_output(directory: Path) -> bool:
    """A directory this command wrote before (its manifest records the widening): the only kind it replaces."""
    try:
        return "widened" in json.loads((directory / "MANIFEST.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def _factor(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m builder.embedded.widen", description=__doc__.split("\n\n")[0])
    p.add_argument("--factor", type=_factor, default=DEFAULT_FACTOR, help="width multiple K (default 4)")
    p.add_argument("--output_dir", required=True, help="directory to write (replaced whole)")
    p.add_argument("--source", default=None, help="the shipped embedded model's directory (default: this package's)")
    args = p.parse_args(argv)
    try:
        widen(args.output_dir, args.factor, args.source)
    except NemospecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
