"""stallfree: stall-free offloaded training.

`stallfree.torch.ZenFlowAdamW` is a drop-in `torch.optim` optimizer over stallfree's ZenFlow
engine and the node's `stallfreed` daemon. This module holds what does not need torch:

- `Error`: raised for every failure of the engine, the daemon or a parameter it cannot take.
- `Daemon`: starts a private `stallfreed` (the optimizer does so by itself when no daemon
  answers on the node's socket).
- `stallfreed_path()` / `stallfreectl_path()`: the daemon and admin CLI shipped in this package
  (`python -m stallfree.daemon` and the `stallfreed` / `stallfreectl` console scripts run them).
- `default_corpus_text()`: the project's generated English-like training text.
"""

# The one place the version is written: the wheel (python/build_wheel.py reads it) and the
# daemon, which reports "stallfreed <version>" (server/session_manager.cc; the wheel's build
# fails when the shipped stallfreed says otherwise).
__version__ = "0.1.0"

try:
    from ._stallfree import Error, default_corpus_text, cuda_enabled  # noqa: F401
except ImportError as _e:
    # A Debian library missing on this machine: name the package to install.
    from ._syslibs import missing_library_error as _missing_library_error
    _err = _missing_library_error(_e)
    if _err is None:
        raise
    raise _err from _e
from ._daemon import Daemon, default_socket, stallfreectl_path, stallfreed_path  # noqa: F401,E402

__all__ = ["Error", "Daemon", "default_corpus_text", "default_socket", "stallfreed_path",
           "stallfreectl_path", "cuda_enabled", "__version__"]
