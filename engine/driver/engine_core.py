"""The replicas, and the one thread that steps them.

Requests from any thread (or asyncio task) go into an inbox; the step loop admits them, runs one
step on every replica with work, and resolves each request's future when it ends. Only the loop
touches the schedulers and the ranks, so concurrent callers share steps instead of taking turns,
and `restart()`/`shutdown()` from any thread end every in-flight request within one step.

A replica whose rank group breaks fails alone: its requests fail (or resume once elsewhere with
retry_on_rank_failure, while it is rebuilt on a thread of its own) and the others keep stepping.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import Callable, TypeVar

from engine.driver.replica import Replica
from engine.driver.router import Router
from engine.driver.sequence import FinishReason, Sequence
from engine.errors import (EngineError, InvalidRequestError, KVPinnedError, NumericalError,
                           RankFailure)

log = logging.getLogger("engine")
T = TypeVar("T")
SHUT_DOWN = "this LLM was shut down; call restart() or create a new one"


class EngineCore:
    def __init__(self, start_replicas: Callable[[], list[Replica]], retry_on_rank_failure: bool,
                 routing: str, block_size: int = 16):
        self._start_replicas = start_replicas
        self._retry = retry_on_rank_failure
        self._router = Router(routing == "prefix_affinity", block_size)
        self._wake = threading.Condition()
        self._control = threading.RLock()  # one restart or shutdown at a time
        self._inbox: deque[Sequence] = deque()
        self._calls: deque[tuple[Callable, Future]] = deque()
        self._cancelled: deque[Sequence] = deque()
        self._parked: list[Sequence] = []  # retried requests waiting for a replica to come back
        self._restarting: set[int] = set()  # replicas being rebuilt on a thread of their own
        self._rebuilders: list[threading.Thread] = []
        self._epoch = 0  # a rebuilt replica joins only the loop that asked for it
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.replicas: list[Replica] = []
        self._start_loop()

    # ---- from any thread ---------------------------------------------------------------------

    def submit(self, seqs: list[Sequence]) -> None:
        with self._wake:
            if self._stopping or self._thread is None:
                raise InvalidRequestError(SHUT_DOWN)
            down = self._all_down()
            if down is not None and not self._restarting:  # else they wait for the rebuild
                raise RankFailure(f"{down}; call restart() or create a new LLM")
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
        self._stopping, self._parked, self._restarting = False, [], set()
        self._epoch += 1
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
        pending = (list(self._inbox) + self._parked
                   + [s for r in self.replicas for s in r.abort_all()])
        self._inbox.clear()
        self._parked = []
        for fn, done in self._calls:
            done.set_exception(error)
        self._calls.clear()
        for seq in pending:
            _fail(seq, error)
        for r in self.replicas:
            r.shutdown()
        self.replicas = []
        # a replica being rebuilt finds the loop gone and shuts its new ranks down; wait for
        # that, or the next start could find the cluster's CPUs still held by them
        for rebuilder in self._rebuilders:
            rebuilder.join()
        self._rebuilders = []

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
        while self.step():
            pass

    def step(self) -> bool:
        """One turn of the loop thread (only it may call this): take in what arrived, then one
        step on every replica with work. The replicas run concurrently (each launched before
        any is waited on), and one that fails fails alone; requests it resumes are routed once
        every replica's step is in, so none goes to a replica whose failure this step has yet
        to show. False once stopping."""
        if not self._take_in():
            return False
        launched, resumed = [], []
        for index, replica in enumerate(self.replicas):
            if replica.down is not None:  # emptied when it broke; nothing may reach it since
                continue
            try:
                step = replica.launch()
            except Exception as e:  # noqa: BLE001  sorted out by _replica_failed
                resumed += self._replica_failed(index, e)
                continue
            if step is not None:
                launched.append((index, replica, step))
        for index, replica, step in launched:
            try:
                finished = replica.finish(step)
            except Exception as e:  # noqa: BLE001
                resumed += self._replica_failed(index, e)
                continue
            for seq in finished:
                _resolve(seq)
        for seq in resumed:
            self._route(seq)
        return True

    def _take_in(self) -> bool:
        """Wait for an event, then run the calls, cancellations and new requests that came in;
        False once stopping. What it took in (a call's result: a KVHandle holding object
        references, say) is dropped when it returns, not kept alive while the loop waits."""
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
        return True

    def _route(self, seq: Sequence) -> None:
        """Hand the request to the replica the router picks; with none alive, it waits for one
        being rebuilt, or fails."""
        index = self._router.pick(seq.token_ids, self.replicas)
        if index is not None:
            seq.replica = self.replicas[index]
            self.replicas[index].scheduler.add(seq)
        elif self._restarting:
            self._parked.append(seq)
        else:
            _fail(seq, RankFailure(f"{self._all_down()}; call restart() or create a new LLM"))

    def _all_down(self) -> str | None:
        """Why no replica can serve, or None while one can."""
        if self.replicas and all(r.down for r in self.replicas):
            return "; ".join(r.down for r in self.replicas)
        return None

    def live_replicas(self) -> list[Replica]:
        """On the loop thread: the replicas that take requests (every one but a broken one)."""
        down = self._all_down()
        if down is not None:
            raise RankFailure(f"{down}; call restart() or create a new LLM")
        return [r for r in self.replicas if r.down is None]

    def serves(self, replica: Replica) -> bool:
        """On the loop thread: whether `replica` is still one of this engine's (a restart or a
        rebuild replaces the object, and the blocks and K/V it held go with the old one)."""
        return any(r is replica for r in self.replicas)

    def _has_work(self) -> bool:
        return any(r.scheduler.has_work() for r in self.replicas)

    def _replica_failed(self, index: int, error: Exception) -> list[Sequence]:
        """A step of one replica raised. A bug fails its requests and it keeps serving; a broken
        rank group takes that replica alone out of service: its requests fail, or with
        retry_on_rank_failure resume once elsewhere (or on its replacement), which is built
        on a thread of its own while the other replicas keep stepping. Returns the requests
        to route again."""
        replica = self.replicas[index]
        seqs = replica.abort_all()
        if not isinstance(error, RankFailure):
            log.error("engine step failed on replica %d", index, exc_info=error)
            for seq in seqs:
                _fail(seq, error)
            return []
        replica.down = f"replica {index}: {error}"
        replica.shutdown()
        if self._retry:
            log.warning("rebuilding %s", replica.down)
            self._restarting.add(index)
            rebuilder = threading.Thread(target=self._rebuild, args=(index, replica, self._epoch),
                                         name=f"engine-rebuild-replica-{index}", daemon=True)
            self._rebuilders = [t for t in self._rebuilders if t.is_alive()] + [rebuilder]
            rebuilder.start()
        others = any(r.down is None for r in self.replicas)
        advice = ("; the other replicas keep serving, restart() brings it back" if others
                  else "; call restart() or create a new LLM")
        resumed = []
        for seq in seqs:
            if self._retry and not seq.retried:
                seq.retried = True
                seq.resume()
                resumed.append(seq)
            else:
                _fail(seq, RankFailure(f"{replica.down}{advice}"))
        return resumed

    def _rebuild(self, index: int, old: Replica, epoch: int) -> None:
        """On its own thread: fresh ranks in place of replica `index`, then handed to the loop."""
        try:
            new = old.restarted()
        except Exception as e:  # noqa: BLE001  the replica stays down, and says why
            new, why = None, f"{old.down}; rebuilding it failed too: {e}"

        def install() -> None:
            if epoch != self._epoch:  # restart() or shutdown() came first: the loop is another
                if new is not None:
                    new.shutdown()
                return
            self._restarting.discard(index)
            if new is None:
                old.down = why
            else:
                self.replicas[index] = new
                log.warning("replica %d serves again", index)
            parked, self._parked = self._parked, []
            for seq in parked:
                self._route(seq)
        try:
            self.call(install)
        except EngineError:  # the engine stopped meanwhile
            if new is not None:
                new.shutdown()

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
