"""The `tc` commands that shape one end of a lab link (pure: argv lists, nothing run here).

Each direction of a link is shaped on the egress of the interface it leaves by:

    root qdisc       tbf (rate)
    clsact egress    one classic-BPF filter, direct action:  loss (a random draw per packet)
                                                              + partitions (destination dropped)

Loss and partitions use a classic BPF program rather than netem's `loss` or a firewall:
cls_bpf is in every kernel that has tc filters, while netem, nftables and iptables binaries
are often missing (netem is, on the CI machines' kernel). Delay and jitter are not tc's at all:
a user-space delay line carries such a link (tsukimi/lab/delay_line.py). The program:

    ld rand ; jgt #KEEP -> drop            (loss_pct > 0: drop when the draw exceeds KEEP)
    ldh [12] ; jne #0x0800 -> pass         (blocked addresses: IPv4 only)
    ld [30] ; jeq #ADDR1 -> drop ; ...     (the destination, 14 + 16 bytes in)
    pass: ret #-1 (TC_ACT_UNSPEC)   drop: ret #2 (TC_ACT_SHOT)

A dropped packet vanishes silently, as on a cut cable: TCP retransmits until its own timeout.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from tsukimi.lab.topology import LinkShape

_TBF_LATENCY_MS = 50  # NOTE: the queue tbf keeps: enough for TCP to fill the link, bounded bloat
_MIN_BURST_BYTES = 96 * 1024  # NOTE: > one veth GSO packet (64 KiB), else tbf must split each
_BPF_LD_RAND = (0x20, 0xFFFFF038)  # ld [SKF_AD_OFF + SKF_AD_RANDOM]
_LDH_ABS, _LD_ABS, _JEQ_K, _JGT_K, _RET_K = 0x28, 0x20, 0x15, 0x25, 0x06
_TC_ACT_SHOT, _TC_ACT_UNSPEC = 2, 0xFFFFFFFF
_PASS, _DROP = "pass", "drop"

Insn = tuple[int, int | str, int | str, int]  # code, jt, jf, k: a jump target may be _PASS/_DROP


def root_commands(namespace: str, device: str, shape: LinkShape) -> list[list[str]]:
    """The commands that set `shape`'s rate on `device`'s egress, from any prior state (the
    first deletes what was there; it may fail harmlessly)."""
    tc = ["tc", "-n", namespace, "qdisc"]
    commands = [[*tc, "del", "dev", device, "root"]]
    tbf = ["tbf", "rate", f"{shape.rate_bps}bit", "burst", str(_burst_bytes(shape.rate_bps))]
    tbf += ["latency", f"{_TBF_LATENCY_MS}ms"]
    if shape.rate_bps:
        commands.append([*tc, "add", "dev", device, "root", "handle", "1:", *tbf])
    return commands


def _burst_bytes(rate_bps: int) -> int:
    return max(_MIN_BURST_BYTES, rate_bps // 8 * 4 // 1000)  # NOTE: 4 ms at the rate


def filter_commands(
    namespace: str, device: str, loss_pct: float, blocked: Sequence[str]
) -> tuple[list[list[str]], list[str] | None]:
    """The commands that drop `loss_pct` % of `device`'s egress packets and every one sent to
    an address in `blocked`: (the ones that reset the hook, whose failure is harmless; the one
    that installs the filter, or None when nothing is to be dropped)."""
    tc = ["tc", "-n", namespace]
    reset = [[*tc, "qdisc", "add", "dev", device, "clsact"], [*tc, "filter", "del", "dev", device, "egress"]]
    program = drop_program(loss_pct, blocked)
    if program is None:
        return reset, None
    install = [*tc, "filter", "add", "dev", device, "egress", "prio", "1", "bpf", "bytecode", program, "da"]
    return reset, install


def drop_program(loss_pct: float, blocked: Sequence[str]) -> str | None:
    """The classic BPF program of the module, in tc's "N,code jt jf k,..." form; None when it
    would drop nothing (pure)."""
    body: list[Insn] = []
    if loss_pct >= 100.0:
        body.append((_RET_K, 0, 0, _TC_ACT_SHOT))
    elif loss_pct > 0.0:
        keep = int((1.0 - loss_pct / 100.0) * 0xFFFFFFFF)
        body += [(_BPF_LD_RAND[0], 0, 0, _BPF_LD_RAND[1]), (_JGT_K, _DROP, 0, keep)]
    if blocked:
        body += [(_LDH_ABS, 0, 0, 12), (_JEQ_K, 0, _PASS, 0x0800), (_LD_ABS, 0, 0, 30)]
        body += [(_JEQ_K, _DROP, 0, int(ipaddress.IPv4Address(a))) for a in blocked]
    if not body:
        return None
    pass_at, drop_at = len(body), len(body) + 1
    program = [*body, (_RET_K, 0, 0, _TC_ACT_UNSPEC), (_RET_K, 0, 0, _TC_ACT_SHOT)]

    def offset(i: int, target: int | str) -> int:
        if isinstance(target, int):
            return target
        return (pass_at if target == _PASS else drop_at) - (i + 1)

    text = [f"{code} {offset(i, jt)} {offset(i, jf)} {k}" for i, (code, jt, jf, k) in enumerate(program)]
    return ",".join([str(len(program)), *text])
