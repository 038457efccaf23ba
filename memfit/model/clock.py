"""The clocks of the incremental memory model: the copy streams of one link (``CopyLink``) and
the compute stream as a plan's copies ask for it (``ComputeClock``).

Why a module of their own: ``BaseProfile.step_time_s`` replays a plan's copies on them and
``free_swaps`` plans copies that fit on ``CopyLink``; both follow ``simulate``'s clock addition
for addition, so the times are ``==`` the simulator's, not merely close.
"""

from __future__ import annotations

import bisect

import numpy as np

from memfit.data.hardware import Hardware


class CopyLink:
    """The two copy streams of one link, each a FIFO, as ``simulate`` runs them: a copy starts
    when it is ready and its stream is free; on a half-duplex link (``hardware.duplex`` false)
    both directions share one stream. The one queue model of copies: ``step_time_s`` replays a
    plan's copies on it, and ``free_swaps`` plans copies that fit on it."""

    def __init__(self, hardware: Hardware) -> None:
        self.hardware = hardware
        self.out_free_s = 0.0  # when the device-to-host stream is next free
        self.in_free_s = 0.0  # when the host-to-device stream is next free

    def out_landing_s(self, ready_s: float, size_bytes: int) -> float:
        """When a copy out ready at ``ready_s`` would land, were it queued now."""
        return max(ready_s, self.out_free_s) + self.hardware.d2h_time_s(size_bytes)

    def copy_out(self, ready_s: float, size_bytes: int) -> float:
        """Queue a copy out; returns when it lands."""
        self.out_free_s = self.out_landing_s(ready_s, size_bytes)
        if not self.hardware.duplex:
            self.in_free_s = self.out_free_s
        return self.out_free_s

    def copy_in(self, ready_s: float, size_bytes: int) -> float:
        """Queue a copy back (``ready_s``: its issue and its copy out both done); returns when
        it lands."""
        self.in_free_s = max(ready_s, self.in_free_s) + self.hardware.h2d_time_s(size_bytes)
        if not self.hardware.duplex:
            self.out_free_s = self.in_free_s
        return self.in_free_s


class ComputeClock:
    """The compute stream's clock, as the copies ask for it in program order.

    Until the first stall it is the Keep plan's (``np.cumsum`` adds left to right, as the
    simulator does). From a stall on it is a running sum restarted at the landing time, added
    up in Python as far as the next op a copy may stall (the next wait) when an end is asked
    for: each op's time once, as the simulator adds it. (Chunks average a few ops when many
    copies stall, so a numpy call per chunk costs more than the additions.)
    """

    def __init__(self, op_time_s: list[float], keep_end_s: np.ndarray, wait_ops: list[int]) -> None:
        self.op_time_s, self.keep_end_s, self.wait_ops = op_time_s, keep_end_s, wait_ops
        self.stalled = False
        self.ends: list[float] = []  # after the first stall: the ends of ops known - len .. known - 1
        self.known = 0  # after the first stall: ops 0..known-1 have their end
        self.free_s = 0.0  # after the first stall: when the stream is free after op known - 1
        self.first = 0  # the op whose end is ``ends[0]``

    def end_s(self, op: int) -> float:
        """When op ``op``'s compute ends."""
        if not self.stalled:
            return float(self.keep_end_s[op])
        self._advance(op + 1)
        return self.ends[op - self.first]

    def wait(self, op: int, landed_s: float) -> None:
        """The stream waits, before op ``op``, for a copy landing at ``landed_s``."""
        if not self.stalled:
            free_s = float(self.keep_end_s[op - 1]) if op else 0.0
            if landed_s > free_s:
                self.stalled, self.known, self.first, self.free_s = True, op, op, landed_s
            return
        self._advance(op)
        self.free_s = max(self.free_s, landed_s)

    def _advance(self, through: int) -> None:
        if through <= self.known:
            return
        next_wait = bisect.bisect_left(self.wait_ops, through)
        stop = self.wait_ops[next_wait] if next_wait < len(self.wait_ops) else len(self.op_time_s)
        free_s, ends, times = self.free_s, self.ends, self.op_time_s
        for op in range(self.known, max(stop, through)):
            free_s += times[op]
            ends.append(free_s)
        self.known, self.free_s = max(stop, through), free_s
