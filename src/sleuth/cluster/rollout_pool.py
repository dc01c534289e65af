"""Rollout workers on Ray: each actor owns one engine; the pool is a RolloutEngine over them.

    pool = RolloutPool(cfg.rollout, cfg.cluster, model_path, dtype, seed, specs)
    async for result in pool.stream(requests): ...    # as each group finishes, on any worker
    pool.sync_weights(policy.sync_state())             # buckets through the object store
    pool.sync_lora(adapter)                            # or just the adapter

Scheduling: each call's groups go to the least-loaded worker (in-flight samples), a group's n
samples stay on one worker (its prefix cache), and each worker gets its share in one call, so it
batches them as the in-process engine would batch the same set. Every request carries its own
sampling seed, so with the transformers engine a group gives the same samples on whichever worker
runs it (up to float rounding of a different batch composition). vLLM seeds each request's sampler
too, but its logits depend on the batch it lands in, so it promises the same samples only for the
same batch.

Failures: Ray restarts a worker whose process dies (max_restarts). Every call carries the weights
version the pool last synced; a worker that is new (or missed a sync) refuses with StaleWeights, the
pool starts its engine, re-syncs it with the latest weights (kept in the object store) and re-issues
the worker's unfinished groups, counting `worker_restarts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, TypeVar

from sleuth.cluster.rollout_worker import RolloutWorker, StaleWeights
from sleuth.cluster.runtime import Assignment, ClusterError, WorkerSpec
from sleuth.cluster_config import ClusterConfig
from sleuth.config import Config, RolloutConfig
from sleuth.records import LoraAdapter
from sleuth.rollout.base import GenerationRequest, GenerationResult, RolloutEngine
from sleuth.rollout.sync import RayTransport

T = TypeVar("T")

MAX_RESTARTS = 4
"""Ray restarts a dead rollout worker this many times in a run before the run stops."""


class WeightSyncTimeoutError(RuntimeError):
    """A weight sync to the rollout workers did not finish within cluster.sync_timeout_s."""


class RolloutWorkerError(RuntimeError):
    """A rollout worker died for good (more restarts than MAX_RESTARTS) or did not start."""


class RolloutPool(RolloutEngine):
    """The RolloutEngine interface over Ray rollout workers (see the module docstring)."""

    def __init__(self, rollout_cfg: RolloutConfig, cluster_cfg: ClusterConfig, model_path: str, dtype: str,
                 seed: int, specs: Sequence[WorkerSpec], bucket_mb: float = 256) -> None:
        super().__init__()
        import ray

        self.model_path = model_path
        self.timeout_s = rollout_cfg.timeout_s
        self.sync_timeout_s = cluster_cfg.sync_timeout_s
        self.bucket_mb = bucket_mb
        actor = ray.remote(RolloutWorker)
        self.workers = [
            actor.options(num_cpus=s.cpus, num_gpus=s.gpus, max_restarts=MAX_RESTARTS, max_task_retries=0,
                          name=None).remote(rollout_cfg.model_dump(), model_path, dtype, seed,
                                            max(1, round(s.cpus)), int(s.gpus))
            for s in specs
        ]
        self._load = [0] * len(self.workers)
        self._locks = [threading.Lock() for _ in self.workers]
        self._syncing = threading.Lock()
        """Held for a whole sync: a group refused meanwhile (loop.streaming generates while syncs run)
        waits for the sync to end instead of sending the worker the weights it is loading again."""
        self._version = 0
        self._latest: tuple[str, Any] | None = None
        """("full", bucket refs), ("lora", adapter ref) or ("collective", a function giving one of those)."""
        self._counts = {"worker_restarts": 0, "syncs": 0, "broadcast_fallbacks": 0}
        infos = self._get([w.info.remote() for w in self.workers], cluster_cfg.connect_timeout_s,
                          "placing the rollout workers (cluster.connect_timeout_s)")
        self.placement = infos
        self._pids = [i["pid"] for i in infos]
        started = self._get([w.start.remote() for w in self.workers], rollout_cfg.timeout_s,
                            "starting the rollout workers' engines (rollout.timeout_s)")
        self.context_len = int(started[0]["context_len"])
        self._native_lora = bool(started[0]["native_lora"])
        self._in_flight_ok = all(info["in_flight"] for info in started)
        self._settings = {"in_flight": False, "policy_version": 0}
        """What every worker's engine is told (configure), a restarted worker's too."""

    @classmethod
    def from_config(cls, cfg: Config, placement: Sequence[Assignment], model_path: str, dtype: str) -> RolloutPool:
        """dtype: model.dtype resolved for this machine (auto -> float32 or bfloat16)."""
        specs = [a.spec for a in placement if a.spec.kind == "rollout"]
        return cls(cfg.rollout, cfg.cluster, model_path, dtype, cfg.loop.seed, specs)

    # ------------------------------------------------------------------ generation

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        async for result in self.stream([request]):
            return result
        raise RolloutWorkerError("no result")  # unreachable: stream yields one result per request

    def generate_all(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Every request in one stream call (so each worker batches its share together), in order."""

        async def run() -> list[GenerationResult]:
            out: dict[int, GenerationResult] = {}
            async for result in self.stream(list(requests)):
                out[_position(requests, result.request, out)] = result
            return [out[i] for i in range(len(requests))]

        return asyncio.run(run())

    async def stream(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        shares = self._assign(requests)
        queue: asyncio.Queue[GenerationResult | BaseException] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._run_share(i, share, queue)) for i, share in shares.items()]
        try:
            for _ in range(len(requests)):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for t in tasks:
                t.cancel()
            for i, share in shares.items():
                self._load[i] -= sum(r.n for r in share)

    def _assign(self, requests: Sequence[GenerationRequest]) -> dict[int, list[GenerationRequest]]:
        """Each group to the worker with the fewest samples in flight (ties: the lowest index)."""
        shares: dict[int, list[GenerationRequest]] = {}
        for r in requests:
            i = min(range(len(self.workers)), key=lambda k: (self._load[k], k))
            self._load[i] += r.n
            shares.setdefault(i, []).append(r)
        return shares

    async def _run_share(self, i: int, share: list[GenerationRequest],
                         queue: asyncio.Queue[GenerationResult | BaseException]) -> None:
        """Stream worker i's groups; after a worker failure, recover it and re-issue what is left."""
        import ray

        left = list(share)
        try:
            while left:
                gen = self.workers[i].stream.options(num_returns="streaming").remote(left, self._version)
                try:
                    while True:
                        try:
                            ref = await asyncio.wait_for(gen.__anext__(), self.timeout_s + 60)
                        except StopAsyncIteration:
                            break
                        result: GenerationResult = await ref
                        del left[_position(left, result.request, {})]
                        queue.put_nowait(result)
                except (ray.exceptions.RayActorError, StaleWeights) as e:
                    await asyncio.to_thread(self._recover, i, e, True)
                except ray.exceptions.RayTaskError as e:
                    if isinstance(e.cause, StaleWeights):
                        await asyncio.to_thread(self._recover, i, e.cause, True)
                        continue
                    raise e.cause from None
                except TimeoutError:
                    raise RolloutWorkerError(f"rollout worker {i} returned nothing for {self.timeout_s + 60:g} s "
                                             "(rollout.timeout_s + 60)") from None
        except BaseException as e:  # hand it to the consumer instead of losing it in a task
            queue.put_nowait(e)

    # ------------------------------------------------------------------ recovery

    def _recover(self, i: int, error: BaseException, after_sync: bool = False) -> None:
        """Wait for Ray to restart worker i, start its engine and give it the latest weights.
        after_sync: first wait for a sync under way (the refusal may only mean it is loading)."""
        import ray

        if after_sync:
            with self._syncing:
                pass
        with self._locks[i]:
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    info = ray.get(self.workers[i].info.remote(), timeout=max(1.0, deadline - time.monotonic()))
                    break
                except ray.exceptions.ActorDiedError:
                    raise RolloutWorkerError(f"rollout worker {i} died and was not restarted (more than "
                                             f"{MAX_RESTARTS} restarts): {error}") from None
                except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                    if time.monotonic() > deadline:
                        raise RolloutWorkerError(f"rollout worker {i} did not come back within "
                                                 f"{self.timeout_s:g} s after: {error}") from None
                    time.sleep(0.2)
            if info["pid"] != self._pids[i]:
                self._counts["worker_restarts"] += 1
                self._pids[i] = info["pid"]
            if info["version"] != self._version or self._latest is None:
                ray.get(self.workers[i].start.remote(self._settings), timeout=self.timeout_s)
                if self._latest is not None:
                    ray.get(self._send(i, self._latest, self._version), timeout=self.sync_timeout_s)

    # ------------------------------------------------------------------ weights

    @property
    def native_lora(self) -> bool:
        return self._native_lora

    # loop.streaming: the workers' engines take weight updates in flight and label each token with the
    # policy version the driver last set (after the push that brought it), as an engine in process does.

    @property
    def supports_in_flight_updates(self) -> bool:  # type: ignore[override]
        return self._in_flight_ok

    @property
    def in_flight_updates(self) -> bool:  # type: ignore[override]
        return bool(self._settings["in_flight"])

    @in_flight_updates.setter
    def in_flight_updates(self, on: bool) -> None:
        self._configure(in_flight=on and self._in_flight_ok)

    @property
    def policy_version(self) -> int:  # type: ignore[override]
        return int(self._settings["policy_version"])

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self._configure(policy_version=version)

    def _configure(self, **changes: Any) -> None:
        import ray

        self._settings = self._settings | changes
        with contextlib.suppress(ray.exceptions.RayError):  # a dead worker gets them when restarted
            ray.get([w.configure.remote(self._settings) for w in self.workers], timeout=self.timeout_s)

    def sync_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Full weights, through the object store (the RolloutEngine interface; the loop goes
        through sleuth.rollout.sync with the same RayTransport)."""
        RayTransport().send_full(self, named_tensors)

    def sync_lora(self, adapter: LoraAdapter | None) -> None:
        if adapter is None:
            raise ValueError("RolloutPool.sync_lora needs an adapter")
        RayTransport().send_adapter(self, adapter)

    def probe_replicas(self, request: GenerationRequest) -> list[GenerationResult]:
        """The request on every worker, in worker order (rollout/sync_check.py)."""
        return self._get([w.probe.remote(request) for w in self.workers], self.timeout_s,
                         "the weight-sync check's probe (rollout.timeout_s)")

    def load_buckets(self, refs: list[Any]) -> None:
        """Every worker loads these weight buckets (object refs); kept for workers that restart."""
        self._sync(("full", refs))

    def load_adapter(self, ref: Any) -> None:
        """Every worker applies this LoRA adapter (an object ref); kept for workers that restart."""
        self._sync(("lora", ref))

    @property
    def restarts(self) -> int:
        """Workers restarted so far (a restarted worker has left the weight broadcast group)."""
        return self._counts["worker_restarts"]

    def join_weight_group(self, address: tuple[str, int], world: int, backend: str, timeout_s: float,
                          join_sender: Callable[[], None]) -> None:
        """Every worker joins the broadcast group hosted at `address` (as ranks 1..N), while
        `join_sender` joins it as rank 0 in this thread."""
        refs = [w.join_weight_group.remote(address, i + 1, world, backend, timeout_s)
                for i, w in enumerate(self.workers)]
        join_sender()
        self._get(refs, timeout_s, "joining the weight-sync group (cluster.sync_timeout_s)")

    def broadcast_sync(self, broadcast: Callable[[], int], object_payload: Callable[[], tuple[str, Any]]) -> bool:
        """A sync through the broadcast group: every worker receives while `broadcast` sends. False
        when the broadcast failed and the workers got `object_payload()` through the object store."""
        return self._sync(("collective", _once(object_payload)), broadcast)

    def _send(self, i: int, payload: tuple[str, Any], version: int) -> Any:
        kind, data = payload
        if kind == "collective":  # outside the broadcast: the same weights through the object store
            kind, data = data()
        if kind == "full":
            return self.workers[i].load_weights.remote(data, version)
        return self.workers[i].load_lora.remote(data, version)

    def _sync(self, payload: tuple[str, Any], broadcast: Callable[[], int] | None = None) -> bool:
        """Send payload to every worker and wait, at most cluster.sync_timeout_s in all. With
        `broadcast`, the workers receive it from the collective group instead; if the broadcast
        fails they get the payload through the object store (returns False)."""
        with self._syncing:
            return self._sync_now(payload, broadcast)

    def _sync_now(self, payload: tuple[str, Any], broadcast: Callable[[], int] | None) -> bool:
        import ray

        from sleuth.cluster.collective import CollectiveError

        t0 = time.perf_counter()
        self._version += 1
        self._latest = payload  # kept (in the object store) for workers that restart later
        version = self._version
        workers = range(len(self.workers))
        collective_ok = broadcast is not None
        if broadcast is not None:
            pending = {self.workers[i].receive_weights.remote(version): i for i in workers}
            try:
                broadcast()
            except CollectiveError:  # a member is gone; the receives still waiting are left behind
                collective_ok = False
                self._counts["broadcast_fallbacks"] += 1
                pending = {self._send(i, payload, version): i for i in workers}
        else:
            pending = {self._send(i, payload, version): i for i in workers}
        deadline = t0 + self.sync_timeout_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.perf_counter()))
            if not ready:
                late = ", ".join(str(i) for i in sorted(pending.values()))
                raise WeightSyncTimeoutError(f"weight sync to rollout worker(s) {late} did not finish within "
                                             f"{self.sync_timeout_s:g} s (cluster.sync_timeout_s)")
            i = pending.pop(ready[0])
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as e:  # died while loading: restart + re-sync
                self._recover(i, e)
            except ray.exceptions.RayTaskError as e:
                if not isinstance(e.cause, StaleWeights):
                    raise e.cause from None
                self._recover(i, e.cause)  # not in the broadcast group (restarted): the object store
        self._counts["syncs"] += 1
        return collective_ok

    # ------------------------------------------------------------------ the rest

    def stats(self) -> dict[str, float]:
        """The workers' engine counters summed, plus the pool's restarts and sync totals."""
        import ray

        out: dict[str, float] = {}
        try:
            per_worker = ray.get([w.stats.remote() for w in self.workers], timeout=30)
        except ray.exceptions.RayError:
            per_worker = []
        for s in per_worker:
            for k, v in s.items():
                out[k] = out.get(k, 0.0) + float(v)
        out.update({k: float(v) for k, v in self._counts.items()})
        return out

    def worker_pids(self) -> list[int]:
        return list(self._pids)

    def placement_lines(self) -> list[str]:
        return [f"rollout worker {i}: pid {p['pid']} on {p['ip']}" + (f", GPUs {p['gpus']}" if p["gpus"] else "")
                for i, p in enumerate(self.placement)]

    def close(self) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayError):  # a dead worker has nothing left to close
            ray.get([w.close.remote() for w in self.workers], timeout=60)
        for w in self.workers:
            ray.kill(w, no_restart=True)
        super().close()

    def _get(self, refs: list[Any], timeout: float, what: str) -> list[Any]:
        import ray

        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"{what}: not done within {timeout:g} s") from None
        except ray.exceptions.RayTaskError as e:
            raise e.cause from None


def _once(fn: Callable[[], T]) -> Callable[[], T]:
    """fn, called at most once (its result kept): one object-store copy per sync, however many
    workers need it."""
    result: list[T] = []

    def call() -> T:
        if not result:
            result.append(fn())
        return result[0]

    return call


def _position(requests: Sequence[GenerationRequest], request: GenerationRequest, taken: dict[int, Any]) -> int:
    """Index of the first request equal to `request` not yet taken (results come back as copies)."""
    for k, r in enumerate(requests):
        if k not in taken and r == request:
            return k
    raise RolloutWorkerError(f"a worker returned a result for an unknown request {request.request_id!r}")

