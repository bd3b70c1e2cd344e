"""The replicas, and the one thread that steps them.

Requests from any thread (or asyncio task) go into an inbox; the step loop admits them, runs one
step on every replica with work, and resolves each request's future when it ends. Only the loop
touches the schedulers and the ranks, so concurrent callers share steps instead of taking turns,
and `restart()`/`shutdown()` from any thread end every in-flight request within one step.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import Callable, TypeVar

from engine.driver.replica import Replica
from engine.driver.sequence import FinishReason, Sequence
from engine.errors import (EngineError, InvalidRequestError, KVPinnedError, NumericalError,
                           RankFailure)

log = logging.getLogger("engine")
T = TypeVar("T")
SHUT_DOWN = "this LLM was shut down; call restart() or create a new one"


class EngineCore:
    def __init__(self, start_replicas: Callable[[], list[Replica]], retry_on_rank_failure: bool,
                 routing: str):
        self._start_replicas = start_replicas
        self._retry = retry_on_rank_failure
        self._prefix_affinity = routing == "prefix_affinity"  # else least loaded only
        self._wake = threading.Condition()
        self._control = threading.RLock()  # one restart or shutdown at a time
        self._inbox: deque[Sequence] = deque()
        self._calls: deque[tuple[Callable, Future]] = deque()
        self._cancelled: deque[Sequence] = deque()
        self._retried: set[int] = set()
        self._failure: str | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.replicas: list[Replica] = []
        self._start_loop()

    # ---- from any thread ---------------------------------------------------------------------

    def submit(self, seqs: list[Sequence]) -> None:
        with self._wake:
            if self._stopping or self._thread is None:
                raise InvalidRequestError(SHUT_DOWN)
            if self._failure is not None:
                raise RankFailure(f"{self._failure}; call restart() or create a new LLM")
            self._inbox.extend(seqs)
            self._wake.notify()

    def cancel(self, seq: Sequence) -> None:
        """Drop a request and free its blocks (does not wait)."""
        with self._wake:
            self._cancelled.append(seq)
            self._wake.notify()

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the loop thread between two steps, where it may read or change any state."""
        if threading.current_thread() is self._thread:
            return fn()
        done: Future = Future()
        with self._wake:
            if self._thread is None:
                raise InvalidRequestError(SHUT_DOWN)
            self._calls.append((fn, done))
            self._wake.notify()
        return done.result()

    def restart(self) -> None:
        if threading.current_thread() is self._thread:  # the loop would start its own twin
            raise InvalidRequestError("restart() was called from the engine's step loop (a "
                                      "request's callback); call it from another thread")
        with self._control:
            self._stop(RankFailure("the engine was restarted while this request ran; submit it again"))
            self._start_loop()

    def shutdown(self) -> None:
        with self._control:
            self._stop(InvalidRequestError("the engine was shut down while this request ran"))

    # ---- the loop ----------------------------------------------------------------------------

    def _start_loop(self) -> None:
        """Start the loop thread, which builds the replicas before its first turn; returns once
        they are up (or raises what building them raised)."""
        self._failure, self._stopping = None, False
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(built,), name="engine-step-loop",
                                        daemon=True)
        self._thread.start()
        try:
            built.result()
        except BaseException:
            self._thread.join()
            self._thread = None
            raise

    def _stop(self, error: EngineError) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()  # bounded: the loop stops after the step in flight (step_timeout_s)
        pending = list(self._inbox) + [s for r in self.replicas for s in r.abort_all()]
        self._inbox.clear()
        for fn, done in self._calls:
            done.set_exception(error)
        self._calls.clear()
        for seq in pending:
            _fail(seq, error)
        for r in self.replicas:
            r.executor.shutdown()
        self.replicas = []

    def _run(self, built: Future) -> None:
        # The ranks are built on the thread that steps them. An in-process CPU rank's OpenMP
        # team then lives on this one thread: a second team in the process (say, the caller's,
        # left over from loading the weights) makes libgomp stop spinning between parallel
        # regions, and a decode step ran ~45 % slower (BENCHMARKS.md).
        try:
            self.replicas = self._start_replicas()
        except BaseException as e:  # noqa: BLE001  raised again in the thread that asked
            built.set_exception(e)
            return
        built.set_result(None)
        while self._run_once():
            pass

    def _run_once(self) -> bool:
        """One turn of the loop; False once stopping. What a turn took in (a call's result: a
        KVHandle holding object references, say) is dropped when it returns, not kept alive
        while the loop waits for the next event."""
        with self._wake:
            while not (self._stopping or self._inbox or self._calls or self._cancelled
                       or self._has_work()):
                self._wake.wait()
            if self._stopping:
                return False
            new, calls, cancelled = list(self._inbox), list(self._calls), list(self._cancelled)
            self._inbox.clear(), self._calls.clear(), self._cancelled.clear()
        for fn, done in calls:
            _run_call(fn, done)
        for seq in cancelled:
            self._abort(seq)
        for seq in new:
            self._route(seq)
        if self._has_work():
            self._step()
        return True

    def _route(self, seq: Sequence) -> None:
        """Prefix affinity: the replica already holding the longest cached prefix of the prompt
        (its K/V need not be computed again); ties, and no hit anywhere, go to the least loaded
        (the lowest index among equals). Least loaded: that alone."""
        def cost(i: int) -> tuple[int, int]:
            r = self.replicas[i]
            if not self._prefix_affinity:
                return 0, r.load
            return -r.block_manager.cached_prefix_tokens(seq.token_ids), r.load

        index = min(range(len(self.replicas)), key=cost) if len(self.replicas) > 1 else 0
        seq.replica = index
        self.replicas[index].scheduler.add(seq)

    def _has_work(self) -> bool:
        return any(r.scheduler.has_work() for r in self.replicas)

    def _step(self) -> None:
        """One step on every replica with work; the replicas run concurrently."""
        try:
            launched = [(r, r.launch()) for r in self.replicas]
            for replica, step in launched:
                if step is not None:
                    for seq in replica.finish(step):
                        _resolve(seq)
        except RankFailure as e:
            self._on_rank_failure(e)
        except Exception as e:  # noqa: BLE001  a bug: fail what is in flight, keep serving
            log.exception("engine step failed")
            for seq in [s for r in self.replicas for s in r.abort_all()]:
                _fail(seq, e)

    def _on_rank_failure(self, error: RankFailure) -> None:
        """Every request in flight shares the broken group. With retry_on_rank_failure, the
        groups restart once and those requests run again from their prompts."""
        seqs = [s for r in self.replicas for s in r.abort_all()]
        if self._retry and not any(s.seq_id in self._retried for s in seqs):
            log.warning("restarting the rank groups after: %s", error)
            try:
                for r in self.replicas:
                    r.executor.shutdown()
                self.replicas = self._start_replicas()
                for seq in seqs:
                    seq.reset()
                    self._retried.add(seq.seq_id)
                    self._route(seq)
                return
            except EngineError as again:
                error = RankFailure(f"{error}; the restart failed too: {again}")
        self._failure = str(error)
        for seq in seqs:
            _fail(seq, RankFailure(f"{error}; call restart() or create a new LLM"))

    def _abort(self, seq: Sequence) -> None:
        for r in self.replicas:
            r.scheduler.abort([seq])
        if not seq.future.done():
            seq.future.cancel()


def _run_call(fn: Callable, done: Future) -> None:
    try:
        done.set_result(fn())
    except BaseException as e:  # noqa: BLE001  handed to the caller
        done.set_exception(e)


def _fail(seq: Sequence, error: BaseException) -> None:
    if not seq.future.done():
        seq.future.set_exception(error)


def _resolve(seq: Sequence) -> None:
    if seq.finish_reason is FinishReason.NONFINITE:
        _fail(seq, NumericalError(
            f"the model gave NaN/Inf logits for this request (prompt of {seq.num_prompt_tokens} "
            f"tokens): the weights or dtype overflow; try dtype='float32'. Other requests are "
            f"unaffected"))
    elif seq.finish_reason is FinishReason.EXPORT_REFUSED:
        _fail(seq, KVPinnedError(seq.error))
    elif seq.finish_reason is FinishReason.ERROR:
        _fail(seq, InvalidRequestError(f"sampling failed for this request: {seq.error}; check "
                                       f"its SamplingParams. Other requests are unaffected"))
    elif not seq.future.done():
        seq.future.set_result(seq)
