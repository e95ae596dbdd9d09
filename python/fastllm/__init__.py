"""fastllm: train large language models as fast as the hardware allows.

`import fastllm` stays light (no torch) so that the command line answers at once; the heavy
parts are imported by the modules that need them.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fastllm")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
