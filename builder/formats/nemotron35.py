"""NVIDIA's Nemotron 3.5 Lightning drafts (SGLang ``dflash.py`` / ``dspark.py``, ``dflash_utils``),
``architectures`` ``DFlashDraftModel`` / ``Qwen3DSparkModel`` with ``has_embed_tokens`` in the config.

Onto :class:`~builder.models.draft_configs.DFlashConfig` / ``DSparkConfig`` (the DFlash module):

* Qwen3 layers at the top level (``head_dim`` x heads may differ from ``hidden_size``; GQA; per-head
  ``q_norm`` / ``k_norm``); ``rope_parameters`` yarn (factor, original_max_position_embeddings) or
  null for plain RoPE with ``rope_theta``;
* ``embed_tokens.weight`` shipped and used (``has_embed_tokens``); ``has_lm_head: false`` -> the
  target's LM head; ``fc`` over the captured layers then ``hidden_norm``;
* captures: ``target_layer_ids`` (layer outputs) and ``eagle_aux_hidden_state_layer_ids`` (the same
  captures in Hugging Face ``hidden_states`` numbering) must be target + 1; each may also appear in
  ``dflash_config`` and must agree there;
* ``sample_from_anchor`` (absent: true; ``false`` is the bonus-anchor layout: block = the committed
  token + K mask rows, mask row j predicts the token at its own position) and, for DSpark,
  ``dspark_bonus_anchor`` (must be ``not sample_from_anchor``);
* ``dflash_config``: ``causal`` (causal block attention), ``use_swa`` + ``swa_window_size`` /
  ``sliding_window`` (Hugging Face's inclusive window), ``attention_sink_bias`` (per-head fp32 sinks
  ``layers.N.self_attn.attention_sink_bias``), ``mask_token_id``, ``block_size``;
* DSpark: ``block_size``, ``dspark_fixup_head_type: markov``, ``markov_head_type: vanilla``,
  ``markov_rank`` = ``dspark_markov_rank``; ``markov_head.markov_w1`` [V, r] (an embedding),
  ``markov_head.markov_w2`` [V, r] (quantizable);
* tensors as z-lab's (:mod:`builder.formats.zlab`: ``model.`` prefix dropped, fused projections split)
  plus the aliases ``encoder.fc.*`` -> ``fc.*``, ``encoder.output_norm_enc.*`` -> ``hidden_norm.*``.
  ModelOpt ``W4A16_NVFP4`` (``quantization_config`` and/or ``hf_quant_config.json``) is read by
  :mod:`builder.formats.reader`.
"""
from __future__ import annotations

from builder.formats.fields import Fields, layer_fields, markov_fields
from builder.formats.reader import Layout
from builder.formats.zlab import canonical as zlab_canonical
from builder.formats.zlab import unpack
from builder.models.draft_configs import DFlashConfig, DSparkConfig

DFLASH, DSPARK = "DFlashDraftModel", "Qwen3DSparkModel"
_ALIASES = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
_FIXUP_HEADS = ("markov",)


def is_nemotron35(data: dict) -> bool:
    """The Nemotron 3.5 layout: a DFlash / DSpark architecture whose config says ``has_embed_tokens``."""
    archs = data.get("architectures")
    return isinstance(archs, list) and archs[:1] in ([DFLASH], [DSPARK]) and "has_embed_tokens" in data


def canonical(stored: str) -> str:
    name = zlab_canonical(stored)
    for old, new in _ALIASES.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _both(f: Fields, inner: Fields | None, field: str, read):
    """A field that may sit at the top level and in ``dflash_config``: its value (they must agree)."""
    top, nested = read(f, field), None if inner is None else read(inner, field)
    if top is not None and nested is not None and top != nested:
        def show(v):
            return list(v) if isinstance(v, tuple) else v
        raise f.fail(field, f"is {show(top)!r} but {inner.prefix}{field} is {show(nested)!r}")
    return top if top is not None else nested


def _captures(f: Fields, inner: Fields | None) -> tuple[tuple[int, ...], str]:
    target = _both(f, inner, "target_layer_ids", lambda h, k: h.int_list(k))
    aux = _both(f, inner, "eagle_aux_hidden_state_layer_ids", lambda h, k: h.int_list(k))
    if target is None:
        if aux is None:
            raise f.fail("target_layer_ids", "is missing: the draft names the target layers it reads")
        return aux, "eagle_aux_hidden_state_layer_ids"
    if aux is not None and list(aux) != [i + 1 for i in target]:
        raise f.fail("eagle_aux_hidden_state_layer_ids", f"{list(aux)} is not target_layer_ids {list(target)} + 1 "
                                                          "(the same captures in hidden_states numbering)")
    return tuple(i + 1 for i in target), "target_layer_ids"


def _attention(f: Fields, inner: Fields | None, layers: int) -> dict:
    causal = False if inner is None else inner.bool("causal")
    swa = False if inner is None else inner.bool("use_swa")
    window = None
    if swa:
        window = inner.int("swa_window_size", None) or f.int("sliding_window", None)
        if window is None:
            raise inner.fail("use_swa", "is true but neither dflash_config.swa_window_size nor sliding_window is set")
        if inner.has("swa_window_size") and f.has("sliding_window") and f.int("sliding_window") != window:
            raise f.fail("sliding_window", f"is {f.get('sliding_window')} but dflash_config.swa_window_size is {window}")
    types = f.get("layer_types")
    if isinstance(types, list):
        want = "sliding_attention" if swa else "full_attention"
        bad = [t for t in types if t != want]
        if bad or len(types) != layers:
            found = repr(bad[0]) if bad else f"{len(types)} entries"
            raise f.fail("layer_types", f"has {found}: expected {layers} x {want!r} "
                                        f"(dflash_config.use_swa is {str(swa).lower()})")
    sinks = False if inner is None else inner.bool("attention_sink_bias")
    return dict(causal=causal, sliding_window=window, attention_sinks=sinks)


def _anchor(f: Fields, inner: Fields | None, kind: str) -> bool:
    sample = _both(f, inner, "sample_from_anchor", lambda h, k: h.bool(k, None) if h.has(k) else None)
    sample = True if sample is None else sample
    if kind == "dspark" and f.has("dspark_bonus_anchor") and f.bool("dspark_bonus_anchor") == sample:
        raise f.fail("dspark_bonus_anchor", f"is {str(sample).lower()} but sample_from_anchor is "
                                            f"{str(sample).lower()} (the bonus-anchor layout is sample_from_anchor: false)")
    return sample


def _markov(f: Fields, names: set, shapes: dict) -> dict:
    head = f.str("dspark_fixup_head_type", "markov")
    if head not in _FIXUP_HEADS:
        raise f.fail("dspark_fixup_head_type", f"is {head!r}: only the markov fix-up head is supported")
    extra = markov_fields(f, "dspark", names)
    rank2 = f.int("dspark_markov_rank", None, minimum=0)
    if rank2 is not None and f.has("markov_rank") and rank2 != extra["markov_rank"]:
        raise f.fail("dspark_markov_rank", f"is {rank2} but markov_rank is {extra['markov_rank']}")
    if not extra["markov_rank"]:
        w1 = shapes.get("markov_head.markov_w1.weight")
        extra["markov_rank"] = rank2 or (w1[1] if w1 is not None and len(w1) == 2 else 0)
    return extra


def parse(f: Fields, names: set, shapes: dict) -> DFlashConfig:
    arch = f.get("architectures")[0]
    kind = "dspark" if arch == DSPARK else "dflash"
    inner = f.obj("dflash_config", required=False)
    layers = layer_fields(f, f.str("model_type", "qwen3"), sliding=True)
    ids, field = _captures(f, inner)
    mask = _both(f, inner, "mask_token_id", lambda h, k: h.int(k, None, minimum=0))
    if mask is None:
        mask = f.int("pard_token", None, minimum=0)
    if mask is None:
        raise f.fail("mask_token_id", "is missing: DFlash block rows after the anchor embed the mask token")
    block = _both(f, inner, "block_size", lambda h, k: h.int(k, None))
    emb = shapes.get("embed_tokens.weight")
    if f.bool("has_embed_tokens") and emb is None:
        raise f.fail("has_embed_tokens", "is true but the checkpoint has no embed_tokens.weight")
    if f.bool("has_lm_head") and "lm_head.weight" not in names:
        raise f.fail("has_lm_head", "is true but the checkpoint has no lm_head.weight")
    target_vocab = f.int("vocab_size")
    cls = DSparkConfig if kind == "dspark" else DFlashConfig
    return cls(
        source="nemotron35", architecture=arch, **layers,
        target_hidden_size=f.int("target_hidden_size", layers["hidden_size"]), target_vocab_size=target_vocab,
        draft_vocab_size=f.int("draft_vocab_size", target_vocab), target_layer_ids=ids,
        block_size=block or (8 if kind == "dspark" else 16), mask_token_id=mask,
        sample_from_anchor=_anchor(f, inner, kind), num_speculative_tokens=None,
        embedding_rows=emb[0] if emb is not None and len(emb) == 2 else 0, has_lm_head="lm_head.weight" in names,
        has_d2t="d2t" in names, layer_ids_field=field, layer_ids_offset=1 if field == "target_layer_ids" else 0,
        **_attention(f, inner, layers["num_hidden_layers"]), **(_markov(f, names, shapes) if kind == "dspark" else {}))


LAYOUT = Layout("Nemotron 3.5 Lightning", parse, canonical, unpack)
