"""fastllm: train large language models as fast as the hardware allows.

Packages, from the configuration up to the loop: `config` (the typed config tree; no torch),
`data` (prepared datasets, the sample stream, `fastllm prepare`), `parallel` (the mesh and
the collectives the model calls), `model` (the one transformer), `checkpoint` (checkpoints
on disk, Hugging Face conversion), `engine` (flat buffers, sharding, the step's schedule, the
optimizer), `training` (the `Trainer` and its loop). On top: `cli` (the `fastllm` command),
`cli_reference` (the command-line reference page), `api` (`load_model`), `hf` (fastllm
models as `transformers` models), `generation` (`fastllm generate`), `demo` (`make demo`).
`_native` is the Rust extension (typed in `_native.pyi`); the Triton kernels are the
`fastllm_kernels` package.

`import fastllm` stays light (no torch) so that the command line answers at once; the heavy
parts are imported by the modules that need them (`fastllm.load_model` imports them lazily).
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any


def _version() -> str:
    """The installed distribution's version; from a source tree that was never installed (only
    PYTHONPATH set), the Rust extension's, which is the same string: both come from the
    workspace Cargo.toml (maturin reads it into the wheel's metadata); "0+unknown" if neither."""
    try:
        return version("fastllm")
    except PackageNotFoundError:
        pass
    try:
        from fastllm._native import version as native_version
    except ImportError:
        return "0+unknown"
    return native_version()


__version__ = _version()


def load_model(*args: Any, **kwargs: Any) -> Any:
    """See `fastllm.api.load_model`."""
    from fastllm.api import load_model as load

    return load(*args, **kwargs)
