"""Chat-template rendering and tokenizing, off the event loop and within a budget.

A container's chat template is code from whoever made the container: one whose loops
nest `range(99999)` (each under jinja's sandbox limit) ran for hours on the event loop,
so `/health`, `/metrics` and every other request stopped and SIGTERM went unanswered;
tokenizing a 1 MB prompt held the loop for 0.4 s. Here each runs in a worker thread
(the loop keeps serving), at most `MAX_AT_ONCE` at a time (a storm of such requests
cannot pile up threads), for at most `BUDGET_S`: past it the request gets a 400 and the
thread is interrupted with an exception raised into it (`PyThreadState_SetAsyncExc`,
which lands at the next bytecode boundary: jinja templates are Python code, so their
loops stop). A rendered template is also capped (`MAX_PROMPT_CHARS`, `check_size`).
On shutdown a call still running is answered 503 at once and stopped the same way.

Not covered: one C-level operation that allocates a lot at once (`'x' * 10**10` in a
template) is not interrupted before it returns.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import TypeVar

import structlog
import trio

from pipeline.server import schema as s
from pipeline.server.drain import Drain, shutting_down

log = structlog.get_logger("moestream.server")

T = TypeVar("T")

# Per template render or tokenizing call (server.prompt_budget_s): a 1 MB prompt tokenizes
# in 0.4 s on an idle 2-core VM and 1.9 s on a loaded one; an endless template runs forever.
BUDGET_S = 10.0
MAX_PROMPT_CHARS = 8 << 20  # what a template may render (the body is at most 1 MiB by default)
MAX_AT_ONCE = 2


class BudgetExceeded(Exception):
    """Raised into a worker thread that ran past its budget."""


class _Call:
    """`fn()` in a worker thread, interruptible while (and only while) it runs."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.lock = threading.Lock()
        self.ident: int | None = None  # set while fn runs

    def __call__(self) -> object:
        try:
            with self.lock:
                self.ident = threading.get_ident()
            try:
                return self.fn()
            finally:
                with self.lock:
                    self.ident = None
        except BudgetExceeded:  # the caller has already answered; nobody reads this
            return None

    def interrupt(self) -> bool:
        with self.lock:  # under the lock: never raised into a thread that moved on
            if self.ident is None:
                return False
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident),
                                                       ctypes.py_object(BudgetExceeded))
            return True


class Offload:
    """One server's budgeted calls (its own limiter: at most MAX_AT_ONCE threads)."""

    def __init__(self, drain: Drain, budget_s: float = BUDGET_S) -> None:
        self.drain = drain
        self.budget_s = budget_s
        self.limiter = trio.CapacityLimiter(MAX_AT_ONCE)

    async def __call__(self, fn: Callable[[], T], what: str, param: str) -> T:
        """`fn()` off the event loop within the budget; over it, a 400 naming `what` and
        `param`; on shutdown, a 503 at once (no token is due to anyone yet, so the drain
        does not wait for it). APIErrors `fn` raises (a template refusing the messages)
        pass through."""
        call = _Call(fn)
        try:
            with trio.CancelScope() as stopped:
                self.drain.watch(stopped, producing=False)
                try:
                    with trio.move_on_after(self.budget_s) as over:
                        result = await trio.to_thread.run_sync(call, abandon_on_cancel=True,
                                                               limiter=self.limiter)
                finally:
                    self.drain.unwatch(stopped)
        except BaseException:  # the client went away: stop the render too
            call.interrupt()
            raise
        if stopped.cancelled_caught:
            call.interrupt()
            raise shutting_down()
        if over.cancelled_caught:
            interrupted = call.interrupt()
            log.warning("server.prompt_budget_exceeded", what=what, budget_s=self.budget_s,
                        interrupted=interrupted)
            raise s.APIError(400, f"{what} took longer than {self.budget_s:g} s, this "
                             "server's budget for it (server.prompt_budget_s)", param=param)
        # `fn`'s own value: a call returns None instead only when interrupted, raised above.
        return result  # type: ignore[return-value]


def check_size(text: str, what: str, param: str) -> str:
    if len(text) > MAX_PROMPT_CHARS:
        raise s.APIError(400, f"{what} is {len(text)} characters, over this server's limit of "
                         f"{MAX_PROMPT_CHARS}", param=param)
    return text
