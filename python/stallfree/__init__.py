"""stallfree: stall-free offloaded training.

`stallfree.torch.ZenFlowAdamW` is a drop-in `torch.optim` optimizer over stallfree's ZenFlow
engine and the node's `stallfreed` daemon. This module holds what does not need torch:

- `Error`: raised for every failure of the engine, the daemon or a parameter it cannot take.
- `Daemon`: starts a private `stallfreed` (the optimizer does so by itself when no daemon
  answers on the node's socket).
- `default_corpus_text()`: the project's generated English-like training text.
"""

from ._stallfree import Error, default_corpus_text, cuda_enabled  # noqa: F401
from ._daemon import Daemon, default_socket, stallfreed_path  # noqa: F401

__all__ = ["Error", "Daemon", "default_corpus_text", "default_socket", "stallfreed_path",
           "cuda_enabled"]
