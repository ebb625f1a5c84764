"""The lab's janitor: a tiny process started with each Lab (tsukimi/lab/lab.py) that deletes
the lab's namespaces, and kills whatever runs inside them, once the runner is gone.

    python -m tsukimi.lab.janitor FD PREFIX

FD is the read end of the runner's lifeline pipe (tsukimi/lifeline.py): it reads EOF when the
runner closes the lab or dies, even by SIGKILL (the kernel closes the write end). It runs in a
session of its own, so the terminal's Ctrl-C, meant for the runner, does not stop it first.
"""

from __future__ import annotations

import logging
import os
import sys

from tsukimi.lab import netns

logger = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    """Wait for EOF on descriptor argv[0], then reap every namespace whose name starts with
    argv[1]; 0, or 2 on bad arguments."""
    if len(argv) != 2 or not argv[0].isdigit() or not argv[1].startswith("tsk"):
        print("usage: python -m tsukimi.lab.janitor FD PREFIX", file=sys.stderr)
        return 2
    fd, prefix = int(argv[0]), argv[1]
    try:
        while os.read(fd, 64):  # NOTE: nobody writes; EOF = the runner closed the lab or died
            pass
    except OSError as exc:
        logger.warning("lifeline read failed (%r): treating the runner as gone", exc)
    left = [name for name in netns.lab_namespaces() if name.startswith(prefix)]
    if left:
        logger.warning("the lab's runner is gone: deleting %s", ", ".join(left))
        netns.delete_namespaces(left)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
