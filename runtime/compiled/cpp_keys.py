"""Inductor's C++ builds keyed by what they compile, not by where torch is installed.

Inductor names each C++ library by a digest of its source and of the compiler's command line, and
that line holds the absolute include and library paths of the torch it runs: a step saved by one
venv (a clone's, a CI checkout's) and loaded by another found none of its libraries and ran gcc
again for each, 2-11 s a step (a load otherwise takes well under a second). Here torch's directory
in that digest is replaced by the build it holds (version, commit, build configuration, Python ABI),
so every venv of the same torch on a machine shares the libraries; the command gcc runs is
unchanged. The libraries name torch's by library name only (no RPATH), which the loading process
has already loaded.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig

import torch


def _torch_dirs() -> list[str]:
    """Where this torch is installed, as imported and resolved (longest first)."""
    here = os.path.dirname(torch.__file__)
    return sorted({here, os.path.realpath(here)}, key=len, reverse=True)


def _torch_build() -> str:
    """What the libraries were built against: the torch build (version, commit and its build
    configuration: a CUDA and a CPU build of one commit differ) and the Python ABI."""
    config = hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:16]
    return (f" [torch {torch.__version__} {getattr(torch.version, 'git_version', '')} {config} "
            f"{sysconfig.get_config_var('SOABI')}]")


def install() -> None:
    """Wraps ``torch._inductor.codecache.write`` (once per process; a torch without it is left as is)."""
    from torch._inductor import codecache
    write = getattr(codecache, "write", None)
    if write is None or getattr(write, "nemospec_portable", False):
        return
    dirs, build = _torch_dirs(), _torch_build()

    def portable_write(content, extension, extra="", *args, **kwargs):
        if extra and any(d in extra for d in dirs):   # a compile command's line: names this torch's build
            for d in dirs:
                extra = extra.replace(d, "<torch>")
            extra += build
        return write(content, extension, extra, *args, **kwargs)

    portable_write.nemospec_portable = True
    codecache.write = portable_write
