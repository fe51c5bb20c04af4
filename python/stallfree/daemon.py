"""Runs the binaries shipped in this package.

    python -m stallfree.daemon [stallfreed flags...]     # the daemon (--help lists the flags)
    stallfreed [flags...]                                # the same, as a console script
    stallfreectl [flags...] COMMAND                      # the admin CLI, as a console script

Each replaces this Python process with the binary (exec): the daemon gets the process id,
the signals (SIGTERM stops it in order) and the exit status, as if started directly.
$STALLFREE_STALLFREED / $STALLFREE_STALLFREECTL choose other binaries.
"""

import os
import signal
import sys

from ._daemon import stallfreectl_path, stallfreed_path
from ._stallfree import Error


def _exec(find, argv):
    try:
        path = find()
    except Error as e:
        sys.exit("stallfree: %s" % e)
    argv = sys.argv[1:] if argv is None else list(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # Python ignores SIGPIPE and SIGXFSZ, and ignored signals survive exec: give the binary the
    # defaults (`stallfreectl stats | head -1` then ends quietly, as when run directly).
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    os.execv(path, [path] + argv)


def stallfreed_main(argv=None):
    """The `stallfreed` console script: exec the shipped daemon with `argv` (default: ours)."""
    _exec(stallfreed_path, argv)


def stallfreectl_main(argv=None):
    """The `stallfreectl` console script: exec the shipped admin CLI."""
    _exec(stallfreectl_path, argv)


if __name__ == "__main__":
    stallfreed_main()
