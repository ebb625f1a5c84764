"""Resources named after the process that made them (shm files, emulated-device files, lab
namespaces): whether that process still lives, and unlinking the files of the dead ones.

A name carries its creator's pid (e.g. `tsukimi-<pid>-<hex>`); once the pid is gone nothing can
release the resource, so the next process that looks reaps it. A pid that exists but belongs to
another user counts as alive (`kill(pid, 0)` answers EPERM): never reap what may be someone's.
"""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger(__name__)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (ours or another user's); False for pid <= 0."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_dead_owners(directory: str, name_re: re.Pattern[str]) -> int:
    """Unlink the files in `directory` whose name matches `name_re` (group 1: the creator's
    pid), whose creator is gone and which this user owns; how many were unlinked. A directory
    that cannot be read, or a file that vanishes meanwhile, is skipped."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    reaped = 0
    for name in names:
        match = name_re.match(name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                reaped += 1
        except OSError:
            continue
    if reaped:
        logger.info("reaped %d files of dead processes in %s", reaped, directory)
    return reaped
