"""Errors of data work that the command line shows as one line (nothing heavy imported here, so
that `fastllm --help` stays instant)."""

from __future__ import annotations

from fastllm.config.section import MachineError


class DataWriteError(MachineError):
    """`prepare` could not write its output (disk full, permissions, any OS error there): a
    failure of the machine, not of the input (exit 1). Nothing was left at the output."""


class BuildStopped(Exception):
    """A stop was asked for while the sampling indices were built; nothing was cached."""
