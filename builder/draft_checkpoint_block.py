"""DFlash, DSpark and P-EAGLE draft checkpoints: reading, name mapping and validation.

Companion of :mod:`builder.draft_checkpoint` (EAGLE / EAGLE-3) for the drafts that propose several
tokens in one forward. ``load_block_draft_checkpoint(dir)`` returns ``(cfg, weights)``: a frozen
:class:`DFlashConfig`, :class:`DSparkConfig` or :class:`PEagleConfig` and canonical name -> tensor
(dtype as stored; ``d2t`` int64). Every error is a one-line :class:`~builder.errors.DraftError`
naming the file and the field or tensor at fault. ``is_block_draft(dir)`` tells whether a
directory holds one of these (so a caller can dispatch between the two loaders).

Accepted layouts
----------------
* speculators 0.9.0, ``speculators_model_type: "dflash"`` (``DFlashDraftModel``) and ``"dspark"``
  (``DSparkDraftModel``): ``transformer_layer_config`` (Qwen3 fields; ``vocab_size`` = the target's
  vocabulary; ``layer_types`` must be all full attention), ``draft_vocab_size``, ``block_size``,
  ``target_hidden_size``, ``aux_hidden_state_layer_ids`` (Hugging Face ``hidden_states`` ids, the
  convention of vLLM's aux-state capture and of ``NemotronH(capture_layers=...)``: id i is the
  hidden state entering target layer i), ``mask_token_id``, ``sample_from_anchor`` (absent: false
  for dflash, true for dspark, speculators' own defaults), and for dspark ``markov_rank``,
  ``markov_head_type`` (only ``vanilla``), ``enable_confidence_head``,
  ``confidence_head_with_markov``. Tensors ``fc.weight`` [H, k*Ht], ``hidden_norm.weight``,
  ``norm.weight``, ``layers.{i}.*`` (Qwen3 layer, q/k norm always), ``lm_head.weight`` (saved only
  for a reduced draft vocabulary; otherwise the target's head is used), optional
  ``embed_tokens.weight`` (speculators never saves it: the target's embedding is used), ``d2t`` /
  ``t2d``, dspark ``markov_head.markov_w1.weight`` [Vt, r], ``markov_head.markov_w2.weight``
  [Vd, r], ``confidence_head.proj.{weight,bias}``.
* the z-lab / DeepSpec layout the serving engines read (and NVIDIA's Nemotron 3.5 drafts follow):
  ``architectures`` ``DFlashDraftModel`` / ``DFlashQwen3ForCausalLM`` / ``Qwen3DSparkModel`` /
  ``DSparkDraftModel``; Qwen3 fields at the top level; ``block_size`` at the top level or in
  ``dflash_config``; target layer ids in ``dflash_config.target_layer_ids``,
  ``dspark_target_layer_ids`` or ``target_layer_ids`` in z-lab's convention (id i = the OUTPUT of
  target layer i = HF ``hidden_states[i + 1]``; we add 1, as vLLM's
  ``get_eagle3_aux_layers_from_config`` and speculators' DFlash converter do), or
  ``eagle_aux_hidden_state_layer_ids`` (HF convention, used as is); ``mask_token_id`` in
  ``dflash_config`` or at the top level (or ``dspark_noise_token_id``). The draft may ship its own
  ``embed_tokens.weight`` and ``lm_head.weight``; fused ``qkv_proj`` / ``gate_up_proj`` tensors are
  split; a ``model.`` prefix is dropped; the d2t map may be named ``draft_id_to_target_id``. Sliding
  window layers, causal-block overrides and attention sinks (``dflash_config.use_swa``, ``causal``,
  ``attention_sink_bias``, ``layer_types``) are refused with an error naming the field.
* speculators ``speculators_model_type: "peagle"`` (``PEagleDraftModel``): every EAGLE-3 field of
  :mod:`builder.draft_checkpoint` plus ``mask_token_id``; tensors of EAGLE-3 plus ``mask_hidden``
  [1, 1, k*Ht] (the hidden-state placeholder of the parallel rows).

``validate_block_draft(cfg, target_cfg)`` checks a draft against its NemotronH target (hidden size,
vocabulary, d2t, layer ids in [0, L], mask token) and returns the config with its layer ids sorted
ascending (the capture order of vLLM and of our fused hidden capture).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open

from builder.draft_checkpoint import (_FLOAT_DTYPES, _IGNORED, _INT_DTYPES, Eagle3Config, _DraftLayers,
                                      _Fields, _fmt, _headers, _layers, _parse_speculators_eagle3,
                                      _read_config, _verifier, draft_tensors, validate_against_target)
from builder.errors import CheckpointError, DraftError

__all__ = [
    "DFlashConfig",
    "DSparkConfig",
    "PEagleConfig",
    "BLOCK_SPECULATORS_TYPES",
    "BLOCK_ARCHITECTURES",
    "MARKOV_HEAD_TYPES",
    "is_block_draft",
    "load_block_draft_checkpoint",
    "load_block_draft_config",
    "block_draft_config_from_dict",
    "block_draft_tensors",
    "validate_block_draft",
]

BLOCK_SPECULATORS_TYPES = ("dflash", "dspark", "peagle")
DFLASH_ARCHITECTURES = ("DFlashDraftModel", "DFlashQwen3ForCausalLM", "DFlashSpeculator")
DSPARK_ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator")
BLOCK_ARCHITECTURES = DFLASH_ARCHITECTURES + DSPARK_ARCHITECTURES
#: speculators' Markov head types; only ``vanilla`` (B = W2(W1[prev])) is implemented
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
_D2T_NAMES = ("d2t", "draft_id_to_target_id")

Shape = tuple[int, ...]


# --- configs -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DFlashConfig(_DraftLayers):
    """A DFlash block-diffusion draft (speculators ``dflash`` / z-lab ``DFlashDraftModel``).

    Decoder layers are Qwen3 layers (per-head q/k RMSNorm) whatever ``layer_type`` says: the DFlash
    attention always has them.
    """

    target_hidden_size: int = 0
    target_vocab_size: int = 0          # the target's vocabulary (W1 rows, embedding rows by default)
    draft_vocab_size: int = 0           # rows of the LM head
    target_layer_ids: tuple[int, ...] = ()  # HF hidden_states ids (NemotronH capture_layers)
    block_size: int = 8                 # block length the draft was trained with
    mask_token_id: int = 0
    sample_from_anchor: bool = False
    num_speculative_tokens: int | None = None  # the checkpoint's default proposal length
    embedding_rows: int = 0             # rows of the draft's own embed_tokens (0: none)
    has_lm_head: bool = False
    has_d2t: bool = False
    layer_ids_field: str = "aux_hidden_state_layer_ids"  # where the checkpoint names them
    layer_ids_offset: int = 0           # 1 when the checkpoint counts layer outputs (z-lab)

    kind = "dflash"

    @property
    def num_aux(self) -> int:
        return len(self.target_layer_ids)


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """A DSpark draft: the DFlash backbone plus a vanilla Markov head (and a confidence head)."""

    sample_from_anchor: bool = True
    markov_rank: int = 0                # 0: no Markov head (pure DFlash drafting)
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_head_with_markov: bool = False

    kind = "dspark"


@dataclass(frozen=True)
class PEagleConfig(Eagle3Config):
    """A P-EAGLE draft (speculators ``peagle``): EAGLE-3 layers, parallel placeholder rows."""

    mask_token_id: int = 0
    num_speculative_tokens: int | None = None

    kind = "peagle"


_CLASSES = {"dflash": DFlashConfig, "dspark": DSparkConfig, "peagle": PEagleConfig}


def block_draft_config_from_dict(data: Mapping[str, Any]) -> DFlashConfig | DSparkConfig | PEagleConfig:
    """Inverse of ``cfg.to_dict()`` (for an engine directory's config.json)."""
    data = dict(data)
    kind = data.pop("kind", None)
    cls = _CLASSES.get(kind)
    if cls is None:
        raise DraftError(f"draft config: unknown kind {kind!r} (expected one of {', '.join(_CLASSES)})")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise DraftError(f"draft config: unknown field {unknown[0]!r} for kind {kind}")
    if data.get("rope_scaling") is not None:
        data["rope_scaling"] = tuple(sorted(data["rope_scaling"].items()))
    for key in ("aux_layer_ids", "target_layer_ids", "verifier_architectures"):
        if data.get(key) is not None:
            data[key] = tuple(data[key])
    return cls(**data)


# --- config.json parsing -------------------------------------------------------------------------
def _proposal_tokens(f: _Fields) -> int | None:
    spec = f.obj("speculators_config", required=False)
    if spec is None:
        return None
    methods = spec.get("proposal_methods")
    if not isinstance(methods, list) or not methods or not isinstance(methods[0], Mapping):
        return None
    value = methods[0].get("speculative_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _refuse_sliding(f: _Fields, dflash: _Fields | None) -> None:
    types = f.get("layer_types")
    if isinstance(types, list) and any(t != "full_attention" for t in types):
        bad = next(t for t in types if t != "full_attention")
        raise f.fail("layer_types", f"has {bad!r}: only full-attention DFlash layers are supported "
                                    f"(sliding-window / causal block attention is not)")
    if dflash is not None:
        if dflash.get("use_swa"):
            raise dflash.fail("use_swa", "is true: sliding-window DFlash attention is not supported")
        if dflash.get("causal"):
            raise dflash.fail("causal", "is true: causal DFlash block attention is not supported")
        if dflash.get("attention_sink_bias"):
            raise dflash.fail("attention_sink_bias", "is true: attention sinks are not supported")
    if f.get("add_swa_attention_sink_bias"):
        raise f.fail("add_swa_attention_sink_bias", "is true: attention sinks are not supported")
    if f.get("is_causal"):
        raise f.fail("is_causal", "is true: causal DFlash block attention is not supported")


def _int_ids(f: _Fields, field: str) -> tuple[int, ...] | None:
    return f.int_list(field)


def _markov(f: _Fields, kind: str, names: set[str]) -> dict[str, Any]:
    if kind != "dspark":
        return {}
    rank = f.int("markov_rank", None, minimum=0)
    if rank is None:  # HF layouts may omit it: read it off W1
        rank = 0
    head = f.str("markov_head_type", "vanilla")
    if head not in MARKOV_HEAD_TYPES:
        raise f.fail("markov_head_type", f"is {head!r}: unknown Markov head type (speculators defines "
                                         f"{', '.join(MARKOV_HEAD_TYPES)})")
    if head != "vanilla":
        raise f.fail("markov_head_type", f"is {head!r}: only the vanilla Markov head (B = W2(W1[prev])) "
                                         f"is supported")
    confidence = f.bool("enable_confidence_head", "confidence_head.proj.weight" in names)
    with_markov = f.bool("confidence_head_with_markov", confidence and rank > 0)
    return dict(markov_rank=rank, markov_head_type=head, confidence_head=confidence,
                confidence_head_with_markov=with_markov and confidence)


def _parse_speculators_dflash(f: _Fields, kind: str, names: set[str]) -> DFlashConfig:
    layer = f.obj("transformer_layer_config")
    _refuse_sliding(layer, None)
    layers = _layers(layer, layer.str("model_type", "qwen3"))
    target_vocab = layer.int("vocab_size")
    ids = f.int_list("aux_hidden_state_layer_ids")
    if ids is None:
        raise f.fail("aux_hidden_state_layer_ids", "is missing: a DFlash draft names the target layers it reads")
    mask = f.int("mask_token_id", None, minimum=0)
    if mask is None:
        raise f.fail("mask_token_id", "is missing: DFlash block rows after the anchor embed the mask token")
    cls = DSparkConfig if kind == "dspark" else DFlashConfig
    extra = _markov(f, kind, names)
    if kind == "dspark" and extra["markov_rank"] == 0 and "markov_head.markov_w1.weight" in names:
        raise f.fail("markov_rank", "is 0 but the checkpoint has Markov head tensors")
    return cls(
        source="speculators", architecture="DSparkDraftModel" if kind == "dspark" else "DFlashDraftModel",
        **layers, **_verifier(f), target_hidden_size=f.int("target_hidden_size", layers["hidden_size"]),
        target_vocab_size=target_vocab, draft_vocab_size=f.int("draft_vocab_size", target_vocab),
        target_layer_ids=ids, block_size=f.int("block_size", 8), mask_token_id=mask,
        sample_from_anchor=f.bool("sample_from_anchor", kind == "dspark"),
        num_speculative_tokens=_proposal_tokens(f), embedding_rows=0,
        has_lm_head="lm_head.weight" in names, has_d2t="d2t" in names, **extra)


def _parse_hf_dflash(f: _Fields, arch: str, names: set[str], shapes: dict[str, Shape]) -> DFlashConfig:
    dflash = f.obj("dflash_config", required=False)
    _refuse_sliding(f, dflash)
    kind = "dspark" if arch in DSPARK_ARCHITECTURES or "markov_head.markov_w1.weight" in names else "dflash"
    layers = _layers(f, f.str("model_type", "qwen3"))
    target_vocab = f.int("vocab_size")
    ids, ids_field, offset = None, "", 0
    for holder, field in ((dflash, "target_layer_ids"), (f, "dspark_target_layer_ids"), (f, "target_layer_ids")):
        if holder is not None and holder.int_list(field) is not None:
            ids = tuple(i + 1 for i in holder.int_list(field))  # z-lab: output of layer i
            ids_field, offset = holder.prefix + field, 1
            break
    if ids is None:
        ids, ids_field = f.int_list("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids"
    if ids is None:
        raise f.fail("dflash_config.target_layer_ids", "is missing: a DFlash draft names the target layers it reads")
    mask = None if dflash is None else dflash.int("mask_token_id", None, minimum=0)
    for field in ("mask_token_id", "dspark_noise_token_id"):
        if mask is None:
            mask = f.int(field, None, minimum=0)
    if mask is None:
        raise f.fail("dflash_config.mask_token_id", "is missing: DFlash block rows after the anchor embed the mask token")
    block = f.int("block_size", None)
    if block is None and dflash is not None:
        block = dflash.int("block_size", None)
    extra = _markov(f, kind, names)
    if kind == "dspark" and extra["markov_rank"] == 0:
        w1 = shapes.get("markov_head.markov_w1.weight")
        extra["markov_rank"] = w1[1] if w1 is not None and len(w1) == 2 else 0
        if extra["confidence_head"] and "confidence_head_with_markov" not in f.data:
            extra["confidence_head_with_markov"] = extra["markov_rank"] > 0
    emb = shapes.get("embed_tokens.weight")
    cls = DSparkConfig if kind == "dspark" else DFlashConfig
    return cls(
        source="zlab", architecture=arch, **layers,
        target_hidden_size=f.int("target_hidden_size", layers["hidden_size"]),
        target_vocab_size=target_vocab, draft_vocab_size=f.int("draft_vocab_size", target_vocab),
        target_layer_ids=ids, block_size=block or 16, mask_token_id=mask,
        sample_from_anchor=f.bool("sample_from_anchor", kind == "dspark"),
        num_speculative_tokens=None, embedding_rows=emb[0] if emb is not None and len(emb) == 2 else 0,
        has_lm_head="lm_head.weight" in names, has_d2t="d2t" in names, layer_ids_field=ids_field,
        layer_ids_offset=offset, **extra)


def _parse(data: dict, where: str, names: set[str], shapes: dict[str, Shape]):
    f = _Fields(data, where)
    kind = data.get("speculators_model_type")
    if kind is not None:
        if kind == "peagle":
            e3 = _parse_speculators_eagle3(f, names)
            mask = f.int("mask_token_id", None, minimum=0)
            if mask is None:
                raise f.fail("mask_token_id", "is missing: P-EAGLE parallel rows embed the mask token")
            fields = {k.name: getattr(e3, k.name) for k in dataclasses.fields(e3)}
            fields.update(architecture="PEagleDraftModel", mask_token_id=mask,
                          num_speculative_tokens=_proposal_tokens(f))
            return PEagleConfig(**fields)
        if kind in ("dflash", "dspark"):
            return _parse_speculators_dflash(f, kind, names)
        raise f.fail("speculators_model_type", f"is {kind!r}: not a block draft "
                                              f"(supported: {', '.join(BLOCK_SPECULATORS_TYPES)})")
    archs = data.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch in BLOCK_ARCHITECTURES:
        return _parse_hf_dflash(f, arch, names, shapes)
    raise f.fail("architectures", f"is {arch!r}: unknown block draft architecture (supported: "
                                  f"{', '.join(BLOCK_ARCHITECTURES)}, or speculators_model_type "
                                  f"{'/'.join(BLOCK_SPECULATORS_TYPES)})")


def is_block_draft(checkpoint_dir: str | os.PathLike) -> bool:
    """Whether ``config.json`` declares a dflash / dspark / peagle draft (reads the config only)."""
    try:
        data, _ = _read_config(Path(checkpoint_dir))
    except DraftError:
        return False
    if data.get("speculators_model_type") in BLOCK_SPECULATORS_TYPES:
        return True
    archs = data.get("architectures")
    return isinstance(archs, list) and bool(archs) and archs[0] in BLOCK_ARCHITECTURES


# --- tensor names --------------------------------------------------------------------------------
def _dflash_layer_tensors(cfg: DFlashConfig, i: int) -> dict[str, Shape]:
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    p = f"layers.{i}."
    t: dict[str, Shape] = {}
    for name, out, inp in (("q", q, H), ("k", kv, H), ("v", kv, H), ("o", H, q)):
        t[f"{p}self_attn.{name}_proj.weight"] = (out, inp)
        if cfg.attention_bias:
            t[f"{p}self_attn.{name}_proj.bias"] = (out,)
    t[f"{p}self_attn.q_norm.weight"] = (D,)
    t[f"{p}self_attn.k_norm.weight"] = (D,)
    inter = cfg.intermediate_size
    for name, shape in (("gate", (inter, H)), ("up", (inter, H)), ("down", (H, inter))):
        t[f"{p}mlp.{name}_proj.weight"] = shape
        if cfg.mlp_bias:
            t[f"{p}mlp.{name}_proj.bias"] = (shape[0],)
    t[f"{p}input_layernorm.weight"] = (H,)
    t[f"{p}post_attention_layernorm.weight"] = (H,)
    return t


def block_draft_tensors(cfg) -> tuple[dict[str, Shape], dict[str, Shape]]:
    """(required, optional) canonical tensor name -> shape of a block draft checkpoint."""
    if isinstance(cfg, PEagleConfig):
        required, optional = draft_tensors(cfg)
        required["mask_hidden"] = (1, 1, cfg.num_aux * cfg.target_hidden_size)
        return required, optional
    H = cfg.hidden_size
    required: dict[str, Shape] = {"fc.weight": (H, cfg.num_aux * cfg.target_hidden_size),
                                  "hidden_norm.weight": (H,), "norm.weight": (H,)}
    optional: dict[str, Shape] = {}
    for i in range(cfg.num_hidden_layers):
        required.update(_dflash_layer_tensors(cfg, i))
    head = (cfg.draft_vocab_size, H)
    if cfg.draft_vocab_size != cfg.target_vocab_size:
        required["lm_head.weight"] = head
        required["d2t"] = (cfg.draft_vocab_size,)
    else:
        optional["lm_head.weight"] = head
        optional["d2t"] = (cfg.draft_vocab_size,)
    optional["embed_tokens.weight"] = (cfg.embedding_rows or cfg.target_vocab_size, H)
    if isinstance(cfg, DSparkConfig):
        r = cfg.markov_rank
        if r > 0:
            required["markov_head.markov_w1.weight"] = (cfg.target_vocab_size, r)
            required["markov_head.markov_w2.weight"] = (cfg.draft_vocab_size, r)
        if cfg.confidence_head:
            width = H + (r if cfg.confidence_head_with_markov else 0)
            required["confidence_head.proj.weight"] = (1, width)
            required["confidence_head.proj.bias"] = (1,)
    return required, optional


def _canonical(stored: str, source: str) -> str:
    name = stored
    if source == "hf" and name.startswith("model.") and not name.startswith("model.lm_head"):
        name = name[len("model."):]
    if name == "draft_id_to_target_id":
        name = "d2t"
    return name


_PACKED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_ROW_SUFFIXES = ("weight", "bias", "weight_scale")       # split along the output rows
_SHARED_SUFFIXES = ("weight_scale_2", "input_scale")    # per-tensor scalars: each part keeps them


def _unpack(entries: dict, data: dict) -> dict:
    """Expand fused ``qkv_proj`` / ``gate_up_proj`` entries into one virtual entry per projection
    (sizes from the config: q heads, kv heads, head_dim, intermediate_size). NVFP4 packed weights
    and their block scales split along the rows too; their global scales are shared."""
    hidden = data.get("hidden_size")
    heads, kv_heads = data.get("num_attention_heads"), data.get("num_key_value_heads", data.get("num_attention_heads"))
    head_dim = data.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) else None)
    out = {}
    for name, entry in entries.items():
        fused = next((k for k in _PACKED if f".{k}." in f".{name}"), None)
        suffix = name.rsplit(".", 1)[-1]
        if fused is None or suffix not in _ROW_SUFFIXES + _SHARED_SUFFIXES:
            out[name] = entry
            continue
        path, stored, shape, dtype, _ = entry
        if suffix in _SHARED_SUFFIXES:
            for part in _PACKED[fused]:
                out[name.replace(fused, part)] = entry
            continue
        if fused == "self_attn.qkv_proj":
            if not all(isinstance(v, int) for v in (heads, kv_heads, head_dim)):
                raise DraftError(f"{path}: tensor {stored!r} is a fused qkv projection but config.json lacks "
                                 f"num_attention_heads / num_key_value_heads / head_dim to split it")
            sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        else:
            inter = data.get("intermediate_size")
            if not isinstance(inter, int):
                raise DraftError(f"{path}: tensor {stored!r} is a fused gate/up projection but config.json "
                                 f"lacks intermediate_size to split it")
            sizes = [inter, inter]
        if not shape or shape[0] != sum(sizes):
            raise DraftError(f"{path}: tensor {stored!r} has shape {_fmt(shape)}, expected {sum(sizes)} rows "
                             f"({' + '.join(map(str, sizes))}) for the fused projection")
        start = 0
        for part, size in zip(_PACKED[fused], sizes):
            out[name.replace(fused, part)] = (path, stored, (size,) + tuple(shape[1:]), dtype, (start, size))
            start += size
    return out


# --- loading -------------------------------------------------------------------------------------
def load_block_draft_config(checkpoint_dir: str | os.PathLike):
    """The draft's config (reads tensor headers to tell optional tensors apart; no tensor data)."""
    return _load(checkpoint_dir, read=False)[0]


def load_block_draft_checkpoint(checkpoint_dir: str | os.PathLike, keep_quantized: bool = True):
    """Read and validate a DFlash / DSpark / P-EAGLE draft checkpoint: (cfg, canonical name -> tensor).

    A ModelOpt NVFP4 checkpoint (``hf_quant_config.json`` or ``quantization_config``; packed uint8
    ``X.weight`` + ``X.weight_scale`` + ``X.weight_scale_2``) gives
    :class:`builder.quantization.NVFP4Weight` objects for its packed weights (the draft modules bind
    them like tensors; ``F.linear`` dequantizes on the fly eagerly and lowers to FP4 constants in
    TensorRT; DSpark's W2 goes to the fused Markov-head op), or plain dequantized tensors with
    ``keep_quantized=False``. The logical shape of each packed weight comes from the config."""
    return _load(checkpoint_dir, read=True, keep_quantized=keep_quantized)


def _quant_config(directory: Path):
    from builder.quantization import read_quant_config
    if not directory.is_dir():
        return None
    try:
        return read_quant_config(directory)
    except CheckpointError as e:
        raise DraftError(str(e)) from None


def _load(checkpoint_dir, read: bool, keep_quantized: bool = True):
    from builder.quantization import _SCALE_SUFFIXES
    directory = Path(checkpoint_dir)
    data, where = _read_config(directory)
    qc = _quant_config(directory)
    headers = _headers(directory)
    source = "speculators" if "speculators_model_type" in data else "hf"
    entries: dict[str, tuple] = {}
    for stored, (path, _, shape, dtype) in headers.items():
        name = _canonical(stored, source)
        if name in entries:
            raise DraftError(f"{path}: tensor {stored!r} duplicates {entries[name][1]!r} (both are {name!r})")
        entries[name] = (path, stored, shape, dtype, None)
    if source == "hf":
        entries = _unpack(entries, data)
    shapes = {n: e[2] for n, e in entries.items()}
    cfg = _parse(data, where, set(entries), shapes)
    required, optional = block_draft_tensors(cfg)
    missing = [n for n in required if n not in entries]
    if missing:
        files = sorted({e[0].name for e in headers.values()}) or ["(no tensors)"]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        hint = ""
        if missing[0] == "d2t":
            hint = (f"; draft_vocab_size {cfg.draft_vocab_size} != target vocab_size {cfg.target_vocab_size} "
                    f"needs the d2t draft->target id map")
        raise DraftError(f"{directory / files[0]}: missing tensor {missing[0]!r}, expected shape "
                         f"{_fmt(required[missing[0]])}{hint}{more}")
    for name, (path, stored, shape, dtype, _) in entries.items():
        if name in _IGNORED:
            continue
        if qc is not None and name.endswith(_SCALE_SUFFIXES):
            base = name[:name.rfind(".")] + ".weight"
            if base not in entries:
                raise DraftError(f"{path}: tensor {stored!r} has no packed FP4 weight {base!r}")
            continue  # validated with its weight (builder.quantization) when read
        want = required.get(name, optional.get(name))
        if want is None:
            raise DraftError(f"{path}: unexpected tensor {stored!r} for a {cfg.kind} draft "
                             f"({cfg.architecture}, {cfg.num_hidden_layers} layer(s))")
        if qc is not None and dtype == "U8" and name.endswith(".weight"):
            packed = tuple(want[:-1]) + (want[-1] // 2,)
            if shape != packed:
                raise DraftError(f"{path}: packed FP4 tensor {stored!r} has shape {_fmt(shape)}, expected "
                                 f"{_fmt(packed)} for logical shape {_fmt(want)} (odd or wrong packed length)")
            if name + "_scale" not in entries:
                raise DraftError(f"{path}: packed FP4 tensor {stored!r} has no {name + '_scale'!r} block scales")
            continue
        if shape != want:
            raise DraftError(f"{path}: tensor {stored!r} has shape {_fmt(shape)}, expected {_fmt(want)}")
        allowed = _INT_DTYPES if name == "d2t" else _FLOAT_DTYPES
        if dtype not in allowed:
            raise DraftError(f"{path}: tensor {stored!r} has dtype {dtype}, expected one of {', '.join(allowed)}"
                             + ("" if qc is not None else " (no quantization config: not an NVFP4 checkpoint)"))
    if not read:
        return cfg, {}
    weights: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, entry in entries.items():
        if name not in _IGNORED:
            by_file.setdefault(entry[0], []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            cache: dict[str, torch.Tensor] = {}
            for name in names:
                _, stored, _, _, part = entries[name]
                t = cache.get(stored)
                if t is None:
                    t = cache[stored] = f.get_tensor(stored)
                weights[name] = t if part is None else t[part[0]:part[0] + part[1]].contiguous()
    if qc is not None:
        from builder.quantization import dequantize_weights, nvfp4_weights
        try:
            weights = nvfp4_weights(weights, qc, {**optional, **required}, where=str(directory))
        except CheckpointError as e:
            raise DraftError(str(e)) from None
        if not keep_quantized:
            weights = dequantize_weights(weights)
    if "d2t" in weights:
        d2t = weights["d2t"] = weights["d2t"].long()
        target_ids = torch.arange(d2t.shape[0]) + d2t
        vocab = cfg.target_vocab_size
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab:
            raise DraftError(f"{entries['d2t'][0]}: tensor 'd2t' maps draft ids outside the target vocabulary "
                             f"[0, {vocab})")
    return cfg, weights


# --- against the target --------------------------------------------------------------------------
def validate_block_draft(draft_cfg, target_cfg):
    """Check a block draft against its target (a NemotronHConfig, or any config with
    ``hidden_size``, ``vocab_size`` and ``num_layers`` / ``num_hidden_layers``). Returns the draft
    config with its layer ids sorted ascending. Raises :class:`DraftError` naming the field."""
    c = draft_cfg
    target_hidden = int(target_cfg.hidden_size)
    target_vocab = int(target_cfg.vocab_size)
    layers = getattr(target_cfg, "num_layers", None)
    if layers is None:
        layers = getattr(target_cfg, "num_hidden_layers")
    layers = int(layers)
    if isinstance(c, PEagleConfig):
        try:
            c = validate_against_target(c, target_cfg)
        except DraftError as e:
            raise DraftError(str(e).replace("eagle3 draft:", "peagle draft:", 1)) from None
        rows = c.target_vocab_size
        if not 0 <= c.mask_token_id < rows:
            raise DraftError(f"peagle draft: mask_token_id {c.mask_token_id} is outside the embedding's "
                             f"{rows} rows")
        return c
    kind = c.kind
    if c.target_hidden_size != target_hidden:
        field = "target_hidden_size" if c.target_hidden_size != c.hidden_size else "hidden_size"
        raise DraftError(f"{kind} draft: {field} {c.target_hidden_size} does not match the target's "
                         f"hidden_size {target_hidden}")
    if c.hidden_size != target_hidden:
        if not c.embedding_rows:
            raise DraftError(f"{kind} draft: hidden_size {c.hidden_size} differs from the target's hidden_size "
                             f"{target_hidden} and the draft ships no embed_tokens.weight to use instead")
        if not c.has_lm_head:
            raise DraftError(f"{kind} draft: hidden_size {c.hidden_size} differs from the target's hidden_size "
                             f"{target_hidden} and the draft ships no lm_head.weight to use instead")
    if c.target_vocab_size != target_vocab:
        field = "transformer_layer_config.vocab_size" if c.source == "speculators" else "vocab_size"
        raise DraftError(f"{kind} draft: {field} (target vocabulary) {c.target_vocab_size} does not match the "
                         f"target's vocab_size {target_vocab}")
    if c.draft_vocab_size > target_vocab:
        raise DraftError(f"{kind} draft: draft_vocab_size {c.draft_vocab_size} exceeds the target's vocab_size "
                         f"{target_vocab}")
    if c.draft_vocab_size != target_vocab and not c.has_d2t:
        raise DraftError(f"{kind} draft: draft_vocab_size {c.draft_vocab_size} != target vocab_size "
                         f"{target_vocab} but the checkpoint has no d2t tensor")
    ids = c.target_layer_ids
    field = c.layer_ids_field
    shown = [i - c.layer_ids_offset for i in ids]
    bad = [i for i in ids if not 0 <= i <= layers]
    if bad:
        conv = f" (HF hidden_states ids {list(ids)})" if c.layer_ids_offset else ""
        raise DraftError(f"{kind} draft: {field} {shown}{conv} has id {shown[ids.index(bad[0])]} outside the "
                         f"target's layers ([0, {layers}] hidden_states ids for {layers} layers)")
    if len(set(ids)) != len(ids):
        raise DraftError(f"{kind} draft: {field} {shown} repeats a layer id")
    rows = c.embedding_rows or target_vocab
    if not 0 <= c.mask_token_id < rows:
        raise DraftError(f"{kind} draft: mask_token_id {c.mask_token_id} is outside the embedding's {rows} rows")
    return dataclasses.replace(c, target_layer_ids=tuple(sorted(ids)))
