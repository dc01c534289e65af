"""Fully asynchronous training (loop.streaming): groups generated continuously into a buffer.

    stream = GroupStream(sampler, cfg.loop, position=0, version=0, pending=[])
    batch = stream.take(it, level)        # waits for tasks_per_iteration groups with signal
    ... train ...
    stream.sync(weight_sync, version=it)  # copied now, pushed on the sync thread (in flight)
    state = stream.trained_state(batch)   # {"data_position": ..., "stream_pending": [...]}

A dispatcher thread keeps up to `capacity` = tasks_per_iteration x max_staleness problems in flight
or buffered: it draws the next data position (positions a checkpoint recorded as pending first),
and a worker thread generates, scores and computes the advantages of that one problem's group
(Sampler.one_group, seeded by its position), then puts it into the buffer. The trainer takes groups
in the order they finished: a group without signal is counted (its rewards in the metrics) and not
trained; a group whose oldest token is more than max_staleness optimizer steps behind the trainer is
dropped and counted (rollout/stale_dropped), never trained; the rest are trained,
tasks_per_iteration of them per step.

Versions: a group carries the engine's policy version when it began (Group.version); an engine
that takes weight updates in flight (the transformers engine) records the version of every token
(Completion.token_versions), so a sample continued across a sync counts as partial
(rollout/partial_frac) and its age is its oldest token's. The engine's version moves on only once the
weights have been sent (WeightSync.snapshot(version), before the check), so a token is never
labelled newer than the weights that sampled it (a few sampled just after the swap keep the older
label: conservative). The update
needs no new correction: the truncated importance weight already reweights each token from the
engine's logprob (the behaviour policy, whatever version sampled it) to the trainer's.

Syncs run on their own thread in order, each followed by the weight-sync check (WeightSync.check);
evaluations run on that thread too, so one never spans a sync. An error on any thread is raised by
the trainer's next take or sync.

Nothing lost, nothing twice: each drawn position is in exactly one of trained, skipped (no signal or
stale: counted), buffered or in flight. A checkpoint after step i records the next undrawn position
and the buffered and in-flight ones (`stream_pending`); a resumed run generates those again first.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sleuth.config import LoopConfig
from sleuth.loop.batch import Batch, Sampler, episode_metrics
from sleuth.records import Group
from sleuth.rollout.sync import SyncStats, WeightSync

T = TypeVar("T")


def oldest_version(group: Group) -> int:
    """The policy version of a group's oldest token (its version when none is recorded per token)."""
    began = group.version or 0
    return min([began, *(min(c.token_versions) for c in group.completions if c.token_versions)])


def is_partial(group: Group) -> list[bool]:
    """Per completion: were its tokens sampled by more than one policy version (a sync in flight)?"""
    return [bool(c.token_versions) and min(c.token_versions) != max(c.token_versions)  # type: ignore[arg-type]
            for c in group.completions]


@dataclass
class Entry:
    """A finished group in the buffer."""

    position: int
    group: Group
    signal: bool
    times: dict[str, float]
    metrics: dict[str, Any] = field(default_factory=dict)
    outcomes: list[Any] | None = None
    """An episode task's: the group's episodes (EpisodeOutcome), for episode_metrics."""


def _new_times() -> dict[str, float]:
    return {"rollout": 0.0, "score": 0.0, "errors": 0.0, "timeouts": 0.0, "refused": 0.0}


class GroupStream:
    """The streaming counterpart of RolloutQueue (the same calls from loop/train.py)."""

    def __init__(self, sampler: Sampler, loop: LoopConfig, position: int, version: int,
                 pending: list[int] | None = None) -> None:
        self.sampler = sampler
        self.per_step = loop.tasks_per_iteration
        self.max_staleness = loop.max_staleness
        self.capacity = loop.tasks_per_iteration * loop.max_staleness
        self.position = position
        """The next data position never drawn."""
        self.engine_version = version
        self.level = 0
        self._todo = list(pending or [])
        self._buffer: list[Entry] = []
        self._in_flight: set[int] = set()
        self._cond = threading.Condition()
        self._errors: list[BaseException] = []
        self._sync_errors: list[BaseException] = []
        """Errors of syncs (and their checks) not raised yet: close() raises them, so the last
        sync's failed check still stops the run."""
        self._stopped = False
        self._idle = {"generator": 0.0, "trainer": 0.0, "since_take": time.perf_counter()}
        self._idle_since: float | None = None
        self._sync_metrics: list[dict[str, float]] = []
        engine = sampler.engine
        self.in_flight_updates = bool(engine.supports_in_flight_updates)
        engine.in_flight_updates = self.in_flight_updates
        engine.policy_version = version
        if sampler.episodes is not None:  # episode tasks: every group's episodes on one held session
            sampler.episodes.open_shared()
        self._workers = cf.ThreadPoolExecutor(max_workers=self.capacity, thread_name_prefix="stream")
        self._syncs = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stream-sync")
        self._dispatcher: threading.Thread | None = None

    # ------------------------------------------------------------------ the generator side

    def _dispatch(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and len(self._buffer) + len(self._in_flight) >= self.capacity:
                    self._cond.wait()
                if self._stopped:
                    return
                position = self._todo.pop(0) if self._todo else self._next_position()
                if self._idle_since is not None:
                    self._idle["generator"] += time.perf_counter() - self._idle_since
                    self._idle_since = None
                self._in_flight.add(position)
                level, version = self.level, self.engine_version
            try:
                self._workers.submit(self._generate, position, level, version)
            except RuntimeError:  # shut down while dispatching
                return

    def _next_position(self) -> int:
        self.position += 1
        return self.position - 1

    def _generate(self, position: int, level: int, version: int) -> None:
        times, metrics = _new_times(), {}
        try:
            group, signal, outcomes = self.sampler.one_group(position, level, version, times, metrics)
            entry: Entry | None = Entry(position, group, signal, times, metrics, outcomes)
        except BaseException as e:  # the trainer's next take raises it
            entry = None
            with self._cond:
                self._errors.append(e)
        with self._cond:
            self._in_flight.discard(position)
            if entry is not None:
                self._buffer.append(entry)
            if not self._in_flight:
                self._idle_since = time.perf_counter()
            self._cond.notify_all()

    # ------------------------------------------------------------------ the trainer side

    def prefetch(self, iteration: int, level: int) -> None:
        """Nothing to do: generation runs continuously (RolloutQueue's call, kept for the loop)."""

    def take(self, iteration: int, level: int) -> Batch:
        """The next tasks_per_iteration fresh groups with signal, waiting for them."""
        self.level = level
        if self._dispatcher is None:
            self._dispatcher = threading.Thread(target=self._dispatch, name="stream-dispatch", daemon=True)
            self._dispatcher.start()
        trainer_version = iteration - 1
        taken: list[Entry] = []
        skipped: list[Entry] = []
        stale = 0
        waited = time.perf_counter()
        algo = self.sampler.cfg.algorithm
        draws = self.per_step * (algo.max_sampling_rounds if algo.dynamic_sampling else 1)
        with self._cond:  # as a batch: at most `draws` fresh groups looked at (dynamic sampling's rounds)
            while len(taken) < self.per_step and len(taken) + len(skipped) - stale < draws:
                self._raise_errors()
                for e in list(self._buffer):
                    if len(taken) >= self.per_step or len(taken) + len(skipped) - stale >= draws:
                        break
                    self._buffer.remove(e)
                    if trainer_version - oldest_version(e.group) > self.max_staleness:
                        stale += 1
                        skipped.append(e)
                    elif not e.signal:
                        skipped.append(e)
                    else:
                        taken.append(e)
                if len(taken) < self.per_step and len(taken) + len(skipped) - stale < draws:
                    # Groups skipped above made room: wake the dispatcher before waiting for more,
                    # or a pass that only skipped (stale, no signal) leaves both sides asleep.
                    self._cond.notify_all()
                    self._cond.wait(timeout=1.0)
            self._cond.notify_all()  # room in the buffer again
            buffered = len(self._buffer)
        now = time.perf_counter()
        trainer_idle = now - waited
        batch = self._batch(iteration, level, trainer_version, taken, skipped, stale)
        batch.metrics.update({
            "rollout/buffer_groups": float(buffered), "rollout/stale_dropped": float(stale),
            "time/trainer_idle_s": trainer_idle, "time/generator_idle_s": self._take_idle(now),
            "rollout/skipped_positions": [e.position for e in skipped],
        })
        for m in self._sync_metrics:
            batch.metrics.update(m)
        self._sync_metrics.clear()
        return batch

    def _take_idle(self, now: float) -> float:
        """Seconds the generator had nothing in flight since the last take."""
        with self._cond:
            idle = self._idle["generator"]
            if self._idle_since is not None:
                idle += now - self._idle_since
                self._idle_since = now
            self._idle["generator"] = 0.0
        return idle

    def _batch(self, iteration: int, level: int, trainer_version: int, taken: list[Entry], skipped: list[Entry],
               stale: int) -> Batch:
        groups = [e.group for e in taken]
        ages = [trainer_version - oldest_version(g) for g in groups]
        partial = [p for g in groups for p in is_partial(g)]
        oldest = min((oldest_version(g) for g in groups), default=trainer_version)
        batch = Batch(iteration, start=min((e.position for e in taken), default=self.position), end=self.position,
                      version=oldest, groups=groups, positions=[e.position for e in taken])
        times = _new_times()
        for e in taken + skipped:
            for k, v in e.times.items():
                times[k] += v
            for k, v in e.metrics.items():
                if isinstance(v, float):
                    batch.metrics[k] = batch.metrics.get(k, 0.0) + v / len(taken + skipped)
        wall = time.perf_counter() - self._idle["since_take"]
        self._idle["since_take"] = time.perf_counter()
        batch.reward_mean = self.sampler._reward_metrics(groups + [e.group for e in skipped], times, batch.metrics)
        outcomes = [e.outcomes for e in taken + skipped if e.outcomes is not None]
        if outcomes:  # an episode task: rollout/* over episodes, as Sampler.collect reports them
            batch.metrics.update(episode_metrics(outcomes, groups + [e.group for e in skipped]))
            batch.reward_mean = batch.metrics["rollout/reward_mean"]
        tokens = batch.metrics.get("rollout/tokens", 0.0)
        batch.metrics.update({
            "time/rollout_s": wall, "rollout/tokens_per_s": tokens / max(wall, 1e-9),
            "time/score_s": times["score"], "rollout/staleness_mean": sum(ages) / max(len(ages), 1),
            "rollout/staleness_max": float(max(ages, default=0)),
            "rollout/partial_frac": sum(partial) / max(len(partial), 1),
            "train/groups": float(len(taken) + len(skipped)), "train/groups_dropped": float(len(skipped)),
            "rollout/policy_version": float(oldest), "rollout/difficulty": float(level),
        })
        return batch

    def _raise_errors(self) -> None:
        if self._errors:
            error = self._errors.pop(0)
            if error in self._sync_errors:
                self._sync_errors.remove(error)
            raise error

    def sync(self, weights: WeightSync, version: int, changed: bool = True) -> dict[str, float]:
        """Copy the weights now; push them (in flight where the engine allows) on the sync thread,
        then the check; the engine's version moves on when the push is done."""
        with self._cond:
            self._raise_errors()
        start = time.perf_counter()
        push = weights.snapshot(version) if changed else None
        self._syncs.submit(self._push, push, version)
        return {"time/sync_s": time.perf_counter() - start, "sync/adapter": float(weights.mode == "adapter")}

    def _push(self, push: Callable[[], SyncStats] | None, version: int) -> None:
        try:
            stats = push() if push is not None else None
        except BaseException as e:
            with self._cond:
                self._errors.append(e)
                self._sync_errors.append(e)
                self._cond.notify_all()
            return
        self.sampler.engine.policy_version = version
        with self._cond:
            self.engine_version = version
            if stats is not None:
                self._sync_metrics.append({"time/sync_push_s": stats.seconds}
                                          | {k: v for k, v in stats.metrics().items() if k != "time/sync_s"})

    def trained_state(self, batch: Batch) -> dict[str, Any]:
        """What a checkpoint after this batch's step records: the next undrawn position and the
        positions drawn but neither trained nor skipped (buffered, in flight, or still to redo)."""
        with self._cond:
            pending = sorted({e.position for e in self._buffer} | self._in_flight | set(self._todo))
            return {"data_position": self.position, "stream_pending": pending}

    def release_engine_memory(self) -> int:
        """Nothing: the engine keeps generating while the trainer steps."""
        return 0

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` (an evaluation) on the sync thread, between two syncs; wait for it."""
        return self._syncs.submit(fn, *args).result()

    def close(self) -> None:
        """Stop drawing, wait for the groups in flight and the syncs queued; raise a sync's error
        that no take raised yet."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._dispatcher is not None:
            self._dispatcher.join()
        self._workers.shutdown(wait=True, cancel_futures=True)
        self._syncs.shutdown(wait=True, cancel_futures=True)
        if self.sampler.episodes is not None:
            self.sampler.episodes.close_shared()
        self.sampler.engine.in_flight_updates = False
        if self._sync_errors:
            raise self._sync_errors.pop(0)
