"""An engine directory's config.json, checked before anything is built from it: a damaged or foreign
file is one line naming the file and the field (exit 2 in the CLI), never a KeyError deep in loading."""
from __future__ import annotations

import json
from pathlib import Path

from builder.errors import NemospecError

BUILD_COUNTS = ("max_seq_len", "max_input_len", "max_batch_size")
DTYPES = ("float32", "float16", "bfloat16")   # builder.checkpoint.TORCH_DTYPES' names, without importing torch


def _fail(path: Path, what: str):
    raise NemospecError(f"{path}: {what}; rebuild the engine directory with `nemospec build`")


def read_engine_meta(path: Path, dtypes=DTYPES) -> dict:
    """The parsed file, with the fields the loaders read present and of the right kind."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        _fail(path, f"not readable JSON ({e})")
    if not isinstance(meta, dict):
        _fail(path, f"expected a JSON object, got {type(meta).__name__}")
    for field in ("engines", "model", "build"):
        if not isinstance(meta.get(field), dict):
            _fail(path, f"field '{field}' missing or not an object")
    if "target" not in meta["engines"]:
        _fail(path, "field 'engines.target' missing; not a nemospec engine directory")
    build = meta["build"]
    if build.get("dtype") not in dtypes:
        _fail(path, f"field 'build.dtype': expected one of {', '.join(dtypes)}, got {build.get('dtype')!r}")
    for key in BUILD_COUNTS:
        value = build.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _fail(path, f"field 'build.{key}': expected an integer >= 1, got {value!r}")
    if meta.get("tokenizer") is not None and not isinstance(meta["tokenizer"], str):
        _fail(path, f"field 'tokenizer': expected the tokenizer file's name, got {meta['tokenizer']!r}")
    spec = meta.get("speculative")
    if spec is not None:
        if not isinstance(spec, dict) or not isinstance(spec.get("mode"), str):
            _fail(path, "field 'speculative': expected an object with 'mode'")
        if spec["mode"] != "mtp" and not isinstance(spec.get("draft"), dict):   # MTP's layers are the target's
            _fail(path, f"field 'speculative.draft': expected the {spec['mode']} draft's config object")
        draft_len = build.get("max_draft_len")
        if isinstance(draft_len, bool) or not isinstance(draft_len, int) or draft_len < 1:
            _fail(path, f"field 'build.max_draft_len': expected an integer >= 1 for a speculative engine, got {draft_len!r}")
        _check_policy_fields(path, build)
    return meta


def _check_policy_fields(path: Path, build: dict) -> None:
    """Each recorded draft-length flag parses as its flag would (a damaged one raised from deep inside)."""
    from runtime.draft_policy import POLICY_FLAGS, policy_from
    for flag in POLICY_FLAGS:
        if flag in build:
            try:
                policy_from(build["max_draft_len"], {flag: build[flag]})
            except Exception as e:   # each flag's parser raises its own kind
                _fail(path, f"field 'build.{flag}': {build[flag]!r} is not a value of --{flag} ({e})")


def check_tensorrt_match(path: Path, meta: dict, flavour: str, version: str) -> None:
    """A serialized engine runs only on the TensorRT that built it: an engine directory built by
    ``tensorrt_rtx`` on a CPU-only machine cannot load in full TensorRT (the Docker image), nor one
    of another version. Said before deserializing, naming both, rather than TensorRT's own error."""
    built = meta.get("tensorrt")
    if not isinstance(built, dict):
        _fail(path, "field 'tensorrt' missing or not an object (the TensorRT that built the engines)")
    if (built.get("flavour"), built.get("version")) != (flavour, version):
        raise NemospecError(f"{path}: engines built with {built.get('flavour')} {built.get('version')}; this process "
                            f"runs {flavour} {version}. Rebuild them here with `nemospec build` (a TensorRT "
                            "engine runs only on the TensorRT flavour and version that built it)")
