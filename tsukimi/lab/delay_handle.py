"""The lab's handle on one delay line (the process of tsukimi/lab/delay_line.py, which carries a
link that has delay or jitter): start it, retime it at run time, close it; and `Timing`, what it
is told. Kept apart from the process's module so that `python -m tsukimi.lab.delay_line` does
not import itself through the package (tsukimi/lab/__init__.py imports the Lab, which imports this).

    lab                                          delay line (python -m tsukimi.lab.delay_line)
    DelayLine(...): Popen, stdin/stdout piped    makes both TAPs -> "ready" (or "error: ...")
    retime(Timing(50, 5)): "50.0 5.0\\n"         new frames use it -> "ok"
    close(): closes stdin                        EOF -> exits; its TAPs vanish with it
"""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys
from dataclasses import dataclass

from tsukimi.errors import ConfigError

_ANSWER_TIMEOUT_S = 20.0
_EXIT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Timing:
    """A delay line's delay and jitter, each way, in milliseconds."""

    delay_ms: float
    jitter_ms: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.jitter_ms <= self.delay_ms:
            raise ConfigError(f"a delay line needs 0 <= jitter <= delay, got {self}")


class DelayLine:
    """One running delay line between `host_dev` in `host_ns` and `hub_dev` in `hub_ns` (see the
    module). Not thread-safe; `close` is idempotent.

    Raises (constructor): ConfigError: the TAPs could not be made (no /dev/net/tun, i.e. no
    CONFIG_TUN, or a name taken), quoting the process's reason.
    """

    def __init__(self, host_ns: str, host_dev: str, hub_ns: str, hub_dev: str, timing: Timing) -> None:
        argv = [sys.executable, "-m", "tsukimi.lab.delay_line", host_ns, host_dev, hub_ns, hub_dev]
        argv += [str(timing.delay_ms), str(timing.jitter_ms)]
        self.timing = timing
        self._where = f"{host_ns}/{host_dev}"
        # NOTE: a session of its own: the terminal's Ctrl-C, meant for the runner, does not cut the link first
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        try:
            self._expect("ready")
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def retime(self, timing: Timing) -> None:
        """Give the link a new delay and jitter; frames already queued keep theirs (mutates).

        Raises:
            ConfigError: the line is gone or did not answer in time.
        """
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(f"{timing.delay_ms} {timing.jitter_ms}\n".encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise ConfigError(f"the delay line of {self._where} is gone") from None
        self._expect("ok")
        self.timing = timing

    def _expect(self, word: str) -> None:
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], _ANSWER_TIMEOUT_S)
        line = self._proc.stdout.readline().decode(errors="replace").strip() if ready else "no answer"
        if line != word:
            raise ConfigError(f"the delay line of {self._where} failed: {line or 'it exited'}")

    def close(self) -> None:
        """Close its control pipe (it exits, its TAPs with it); SIGKILL it if it lingers."""
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
