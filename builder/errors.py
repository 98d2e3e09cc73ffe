"""Errors the builder raises for bad user input (checkpoints, configs, build options).

Every message is one line (no newlines) that names the file, tensor or field at fault and what was
expected. The CLI maps :class:`NemospecError` to exit code 2.
"""
from __future__ import annotations

import argparse


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


class NemospecError(Exception):
    """Base class of every error nemospec reports to its user (exit code 2 in the CLI)."""

    def __init__(self, message: object = "") -> None:
        super().__init__(_one_line(message))


class CheckpointError(NemospecError):
    """A checkpoint directory, its config.json or its tensors are missing or malformed."""


class BuildError(NemospecError):
    """An engine could not be built from a valid checkpoint with the requested options."""


class DraftError(NemospecError):
    """A draft checkpoint (EAGLE, EAGLE-3, ...) is malformed or does not fit its target model."""


class UnavailableError(NemospecError, RuntimeError):
    """What this machine cannot run (the TensorRT backend without a CUDA GPU)."""


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help names each option's default, as trtllm-build's and vLLM's do, where its help does not
    already say it (nor for a switch: ``--no_verify`` storing False printed "(default: True)", which
    read as the check skipped by default)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default in (None, False, argparse.SUPPRESS)
                or action.default == [] or not text or action.nargs == 0):   # a switch: its absence is its default
            return text
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with its errors on one line (exit 2), pointing at --help instead of printing
    the whole usage block first, and no abbreviated flags: ``--max_draft 8`` is an error naming it, not
    ``--max_draft_len 8`` by a guess that a later flag (``--max_draft_tokens``) would make ambiguous.
    Its --help names the defaults (``DefaultsHelpFormatter``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")
