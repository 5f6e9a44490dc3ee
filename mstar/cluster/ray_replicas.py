"""mstar replicas on a Ray cluster, kept behind a `Front`: the cluster's
address and the replicas' spec in, a front whose replica URLs follow the
replicas as Ray restarts them.

`RayReplicas.start` connects to the cluster (or starts a local one), places
one `ReplicaServer` actor per replica, spread over the nodes, and waits for
every server to answer. `watch` (a task of the front's app) asks each actor
for its URL every few seconds: a call to an actor that Ray is restarting
waits for the restart, so a replica that died comes back in the front at
its new address, and the front's health checks keep it out meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import structlog
from aiohttp import web

from mstar.cluster.front import HEALTH_EVERY_S, Front
from mstar.cluster.replica import ReplicaSpec, actor_class

log = structlog.get_logger("mstar.cluster")

NAMESPACE = "mstar"


def actor_name(index: int, name: str = "mstar") -> str:
    """A replica actor's name in the `mstar` namespace (`ray.get_actor` finds
    it); `name` tells apart the clusters of several fronts on one Ray cluster."""
    return f"{name}-replica-{index}"


class RayReplicas:
    def __init__(self, spec: ReplicaSpec, num_replicas: int, num_cpus: float = 1.0, max_restarts: int = -1,
                 name: str = "mstar") -> None:
        if num_replicas < 1:
            raise ValueError("--num-replicas must be at least 1")
        self.spec = spec
        self.num_replicas = num_replicas
        self.num_cpus = num_cpus
        self.max_restarts = max_restarts
        self.name = name
        self.actors: list[Any] = []
        self._started_ray = False

    def start(self, address: str | None) -> list[str]:
        """Join the cluster at `address` (None: start a local one), start the
        replicas, and return their URLs once every one answers."""
        import ray

        if not ray.is_initialized():
            # "local": a new instance, not one that RAY_ADDRESS or an earlier `ray start` names
            ray.init(address=address or "local", namespace=NAMESPACE, log_to_driver=True)
            self._started_ray = True
        have = ray.cluster_resources()
        for resource, need in (("GPU", self.spec.gpus), ("CPU", self.num_cpus)):
            if need and have.get(resource, 0) < need:
                raise RuntimeError(f"a replica needs {need} {resource}s; the Ray cluster has {have.get(resource, 0)}"
                                   + (" (--gpus cpu serves on CPUs)" if resource == "GPU" else ""))
        cls = actor_class(self.spec.gpus, self.num_cpus, self.max_restarts)
        try:
            for i in range(self.num_replicas):   # one by one: a refused one leaves those before it to stop
                self.actors.append(cls.options(name=actor_name(i, self.name), namespace=NAMESPACE,
                                               scheduling_strategy="SPREAD").remote(i, self.spec))
            urls = [a.url.remote() for a in self.actors]
            ready, _ = ray.wait(urls, num_returns=len(urls), timeout=self.spec.startup_timeout_s + 120)
            if len(ready) < len(urls):   # Ray could not place them all (no node has what one asks for)
                raise RuntimeError(f"{len(urls) - len(ready)} of {len(urls)} replicas did not start in "
                                   f"{self.spec.startup_timeout_s + 120:.0f} s; `ray status` shows what is free")
            return ray.get(urls)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every replica's server and actor (and the local cluster this started)."""
        import ray

        if self.actors:
            # no retry: a stop sent to an actor that just died must not restart it
            stops = [a.stop.options(max_task_retries=0).remote() for a in self.actors]
            ray.wait(stops, num_returns=len(stops), timeout=40)
            for a in self.actors:
                ray.kill(a, no_restart=True)
            self.actors = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def serve(self, front: Front) -> web.Application:
        """The front's app, with `watch` running beside it."""
        app = front.app()

        async def watching(_app: web.Application) -> AsyncIterator[None]:
            task = asyncio.create_task(self.watch(front))
            yield
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        app.cleanup_ctx.append(watching)
        return app

    async def watch(self, front: Front) -> None:
        """Keep the front's replica URLs those of the actors, through restarts."""
        async def one(index: int, actor: Any) -> None:
            while True:
                try:
                    front.relocate(index, await actor.url.remote())
                except Exception as e:   # a restart that failed to start its server: keep asking
                    log.warning("replica not serving", replica=index, error=(str(e) or repr(e)).splitlines()[0][:200])
                await asyncio.sleep(HEALTH_EVERY_S)

        await asyncio.gather(*(one(i, a) for i, a in enumerate(self.actors)))
