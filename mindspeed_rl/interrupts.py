"""Ctrl-C and SIGTERM in the driver, turned into `RunInterrupted` at a safe point.

A Python exception raised by a signal handler inside one of Ray's Cython calls (`ray.wait`,
`ray.get`, `ray.init`) corrupts that call ("returned a result with an exception set"). So the
handler raises at once only in plain Python code; inside `shielded()` it records the signal and the
shield raises on its way out (the driver waits on Ray in short slices, so within a second). Inside
`deferred()` (the teardown) signals are recorded only: a second Ctrl-C must not cut the cleanup
short and leave workers running.
"""
from __future__ import annotations

import contextlib
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How long one shielded wait on Ray may block: a stop signal is acted on within this.
RAY_WAIT_SLICE_SECONDS = 0.5


class RunInterrupted(BaseException):
    """SIGINT or SIGTERM reached the driver (a BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _State:
    installed = False
    shield_depth = 0
    deferring = False
    requested: int | None = None   # the first stop signal received
    raised = False                 # RunInterrupted already raised once: later signals only wait


def _handle(signum: int, frame) -> None:
    if _State.requested is None:
        _State.requested = signum
    if _State.shield_depth or _State.deferring or _State.raised:
        return
    _State.raised = True
    raise RunInterrupted(signum)


def install() -> None:
    """Take SIGINT/SIGTERM (again: ray.init sets its own SIGTERM handler, which exits without cleanup)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _handle)
    _State.installed = True


def is_installed() -> bool:
    return _State.installed


def raise_if_requested() -> None:
    if _State.requested is not None and not _State.raised and not _State.deferring:
        _State.raised = True
        raise RunInterrupted(_State.requested)


@contextlib.contextmanager
def shielded():
    """Around a call into Ray: a stop signal raises after it returns, not inside it."""
    _State.shield_depth += 1
    try:
        yield
    finally:
        _State.shield_depth -= 1
    if not _State.shield_depth:
        raise_if_requested()


@contextlib.contextmanager
def deferred():
    """Teardown: stop signals are only recorded."""
    previous, _State.deferring = _State.deferring, True
    try:
        yield
    finally:
        _State.deferring = previous


@contextlib.contextmanager
def stop_signals():
    """The driver's whole life: SIGINT/SIGTERM become RunInterrupted; the old handlers come back after."""
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    _State.requested, _State.raised, _State.shield_depth, _State.deferring = None, False, 0, False
    install()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _State.installed = False
