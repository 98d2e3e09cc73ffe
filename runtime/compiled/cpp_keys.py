"""Inductor's C++ builds keyed by what they compile, not by where torch is installed.

Inductor names each C++ library by a digest of its source and of the compiler's command line, and
that line holds the absolute include and library paths of the torch it runs: a step saved by one
venv (a clone's, a CI checkout's) and loaded by another found none of its libraries and ran gcc
again for each, 2-11 s a step (a load otherwise takes well under a second). Here the installation
prefixes in that digest are replaced by the torch build they hold (version and commit), so every
venv of the same torch on a machine shares the libraries; the command gcc runs is unchanged. The
libraries link torch by library name, which the loading process has already loaded.
"""
from __future__ import annotations

import os
import site
import sysconfig

import torch


def _prefixes() -> list[str]:
    """Where this interpreter's packages live (longest first: a nested prefix is replaced whole)."""
    found = {os.path.dirname(os.path.dirname(torch.__file__)), sysconfig.get_paths()["purelib"],
             sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    found |= {os.path.realpath(p) for p in found}
    return sorted((p for p in found if len(p) > 1), key=len, reverse=True)


def install() -> None:
    """Wraps ``torch._inductor.codecache.write`` (once per process; a torch without it is left as is)."""
    from torch._inductor import codecache
    write = getattr(codecache, "write", None)
    if write is None or getattr(write, "nemospec_portable", False):
        return
    prefixes = _prefixes()
    build = f" [torch {torch.__version__} {getattr(torch.version, 'git_version', '')}]"

    def portable_write(content, extension, extra="", *args, **kwargs):
        if extra and any(p in extra for p in prefixes):   # a compile command's line: names this torch
            for p in prefixes:
                extra = extra.replace(p, "<site-packages>")
            extra += build
        return write(content, extension, extra, *args, **kwargs)

    portable_write.nemospec_portable = True
    codecache.write = portable_write
