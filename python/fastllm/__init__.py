"""fastllm: train large language models as fast as the hardware allows.

`import fastllm` stays light (no torch) so that the command line answers at once; the heavy
parts are imported by the modules that need them (`fastllm.load_model` imports them lazily).
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("fastllm")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"


def load_model(*args: Any, **kwargs: Any) -> Any:
    """See `fastllm.api.load_model`."""
    from fastllm.api import load_model as load

    return load(*args, **kwargs)
