"""The Triton model repository for one engine directory: ``model_repo/`` templates filled with the
engine directory, backend, batch limits and the adaptive draft-length overrides."""
from __future__ import annotations

import os
import shutil
import string
import tempfile
from pathlib import Path
from types import SimpleNamespace

from builder.errors import NemospecError
from runtime.draft_policy import POLICY_FLAGS, policy_from
from runtime.engine_meta import read_engine_meta as checked_engine_meta
from runtime.sampling import LOGPROBS_MODES
from serving.tensors import template_fields
from serving.limits import encode_limits

ROOT = Path(__file__).resolve().parent.parent          # the directory holding serving/ and model_repo/
TEMPLATES = ROOT / "model_repo"
MODELS = ("ensemble", "preprocessing", "speculative", "postprocessing")
BACKENDS = ("auto", "torch", "compiled", "tensorrt")
# the names of runtime.compiled.runner.SERVING_WARM_UPS (tested equal; importing that loads the compiled path)
WARM_UPS = ("all", "greedy", "single")


def read_engine_meta(engine_dir) -> dict:
    engine_dir = Path(engine_dir)
    path = engine_dir / "config.json"
    if not path.is_file():
        raise NemospecError(f"--engine_dir: {path} missing; build one with `nemospec build`")
    meta = checked_engine_meta(path)
    if not meta.get("tokenizer") or not (engine_dir / meta["tokenizer"]).is_file():
        raise NemospecError(f"--engine_dir: {engine_dir} has no tokenizer.json; the server takes and returns text, "
                            "so build from a checkpoint that has one")
    return meta


def encode_policy(overrides: dict) -> str:
    """Adaptive draft-length flags as one model-config string parameter: 'flag=value;...'."""
    return ";".join(f"{k}={v}" for k, v in overrides.items())


def decode_policy(text: str) -> SimpleNamespace:
    pairs = [item.split("=", 1) for item in text.split(";") if item]
    return SimpleNamespace(**{k: POLICY_FLAGS[k][0](v) for k, v in pairs})


def default_torch_threads() -> int:
    """CPU threads of the speculative model's steps: a quarter of the cores, at least one. The rest
    stay with Triton, the pre/postprocessing stubs and the clients; on a 2-core machine two threads
    made every served step slower (compiled eagle3 through Triton: 245 vs 450 tokens/s with one)."""
    return max(1, (os.cpu_count() or 1) // 4)


def fill_model_repo(engine_dir, repo_dir, *, backend: str = "auto", torch_threads: int = 0, warm_up: str = "all",
                    max_batch_size: int | None = None,
                    max_queue: int = 64, cancel_dir=None, draft_policy: dict | None = None,
                    limits: dict | None = None, logprobs_mode: str = "processed_logprobs") -> Path:
    """Writes the four models of ``model_repo/`` for ``engine_dir`` into ``repo_dir`` (replacing them).

    ``cancel_dir`` is where the speculative model listens for cancellations the postprocessing model
    sees (default: a per-user directory under the system temp dir). ``limits``: request limits
    (``serving.limits``; defaults for those not given)."""
    if not (TEMPLATES / "ensemble" / "config.pbtxt").is_file():
        raise NemospecError(f"model_repo templates missing at {TEMPLATES}: install nemospec from a source checkout "
                            "(`pip install -e .`)")
    engine_dir = Path(engine_dir).resolve()
    meta = read_engine_meta(engine_dir)
    if backend not in BACKENDS:
        raise NemospecError(f"--backend: expected one of {', '.join(BACKENDS)}, got {backend}")
    if backend == "auto":
        # resolved here: without a GPU the server runs eagerly for now. The compiled path
        # (--backend compiled) compiles its steps inside the first requests, tens of seconds per step
        # on a cold cache, which would stall them (and readiness checks) behind it.
        from runtime.loading import tensorrt_available
        backend = "tensorrt" if tensorrt_available() else "torch"   # a GPU without TensorRT runs the torch path
    if backend == "tensorrt":   # said here, exit 2, rather than as a model that fails to load inside Triton
        from builder.backends.trt_import import FLAVOUR, VERSION
        from runtime.engine_meta import check_tensorrt_match
        check_tensorrt_match(engine_dir / "config.json", meta, FLAVOUR, VERSION)
    engine_batch = int(meta["build"]["max_batch_size"])
    if max_batch_size is not None and not 1 <= max_batch_size <= engine_batch:
        raise NemospecError(f"--max_batch_size: expected 1..{engine_batch} (the engine's max_batch_size), got {max_batch_size}")
    if warm_up not in WARM_UPS:
        raise NemospecError(f"--warm_up: expected one of {', '.join(WARM_UPS)}, got {warm_up}")
    if max_queue < 0:
        raise NemospecError(f"--max_queue: expected >= 0, got {max_queue}")
    if logprobs_mode not in LOGPROBS_MODES:
        raise NemospecError(f"--logprobs_mode: expected one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode}")
    if torch_threads < 0:
        raise NemospecError(f"--torch_threads: expected >= 0 (0: a quarter of the cores), got {torch_threads}")
    cancel_dir = Path(cancel_dir) if cancel_dir else Path(tempfile.gettempdir()) / f"nemospec-cancel-{os.getuid()}"
    cancel_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    overrides = {k: v for k, v in (draft_policy or {}).items() if v is not None}
    if meta.get("speculative"):  # a bad flag exits 2 here, not inside the model
        policy_from(int(meta["build"]["max_draft_len"]), meta["build"], SimpleNamespace(**overrides))
    values = dict(engine_dir=str(engine_dir), backend=backend, torch_threads=str(torch_threads or default_torch_threads()),
                  warm_up=warm_up,
                  nemospec_root=str(ROOT), cancel_dir=str(cancel_dir.resolve()),
                  max_batch_size=str(max_batch_size or engine_batch), max_queue=str(max_queue),
                  logprobs_mode=logprobs_mode,
                  draft_policy=encode_policy(overrides), limits=encode_limits(limits or {}), **template_fields())
    repo_dir = Path(repo_dir)
    if repo_dir.resolve() == TEMPLATES.resolve():   # filling replaces each model folder: the templates themselves
        raise NemospecError(f"--model_repo_dir: {repo_dir} is nemospec's own template folder ({TEMPLATES}), which "
                            "filling would replace; name another directory")
    if any(c.isspace() for c in str(repo_dir.resolve())):   # the stub got its path split: "stol", never ready
        raise NemospecError(f"--model_repo_dir: {str(repo_dir.resolve())!r} holds whitespace, which Triton 2.51's "
                            "Python backend cannot load models from; name a directory without it")
    repo_dir.mkdir(parents=True, exist_ok=True)
    for name in MODELS:
        src, dst = TEMPLATES / name, repo_dir / name
        if dst.exists():
            shutil.rmtree(dst)
        (dst / "1").mkdir(parents=True)
        text = (src / "config.pbtxt").read_text()
        (dst / "config.pbtxt").write_text(string.Template(text).substitute(values))
        if (src / "1" / "model.py").is_file():
            shutil.copy2(src / "1" / "model.py", dst / "1" / "model.py")
    return repo_dir
