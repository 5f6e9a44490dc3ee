"""`python -m mstar.cluster`: mstar replicas on a Ray cluster behind one address.

    python -m mstar.cluster --num-replicas 2 --gpus-per-replica 1 --port 8000 -- --model orpheus-3b
    python -m mstar.cluster --address ray://head:10001 --num-replicas 4 --port 8000 -- --model /models/orpheus
    python -m mstar.cluster --gpus cpu --num-replicas 2 --port 8000 -- --model tiny-llama

Flags after `--` (and any this command does not know) go to every
replica's `python -m mstar.http`; the replicas' --host, --port and --gpus
are set by the cluster (--gpus cpu here gives CPU replicas). --body-timeout
is the front's and the replicas' both.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mstar.cluster import serving
from mstar.cluster.front import BACKLOG, EXIT_S, GRACE_S, SHUTDOWN_TIMEOUT_S, Front
from mstar.cluster.front_cli import add_deadline_flags, check_deadline_flags
from mstar.cluster.ray_replicas import RayReplicas
from mstar.cluster.replica import STARTUP_TIMEOUT_S, ReplicaSpec

OWN_FLAGS = ("--host", "--port")   # of the front: a replica's are the cluster's to choose


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    # no abbreviations: a flag not spelled out is a replica's (`--body-time` is the replicas' own abbreviation)
    p = argparse.ArgumentParser(prog="python -m mstar.cluster", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=None,
                   help="the Ray cluster to join (auto, host:port, ray://host:10001); none: start a local one")
    p.add_argument("--num-replicas", type=int, default=1)
    p.add_argument("--gpus-per-replica", type=int, default=1, help="GPUs each replica's server gets")
    p.add_argument("--gpus", default=None, help="cpu: CPU replicas (no GPUs asked of Ray)")
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves for each replica")
    p.add_argument("--max-restarts", type=int, default=-1, help="restarts of a replica that dies (-1: no limit)")
    p.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S,
                   help="seconds a replica may take to serve")
    p.add_argument("--name", default="mstar", help="the replica actors' name prefix (one per front on a Ray cluster)")
    p.add_argument("--host", default="127.0.0.1", help="the front's address (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="the front's port")
    add_deadline_flags(p)
    head, tail = list(argv), []
    if "--" in head:   # after `--`: the replicas' flags, whatever they are
        cut = head.index("--")
        head, tail = head[:cut], head[cut + 1:]
    a, rest = p.parse_known_args(head)
    if any(f.split("=")[0] == "--body-timeout" for f in head):   # the front's and, as before, the replicas'
        rest += [f"--body-timeout={a.body_timeout!r}"]
    rest += tail
    check_deadline_flags(p, a)
    if a.gpus not in (None, "cpu"):
        p.error("--gpus takes only 'cpu' here; a replica's GPUs are --gpus-per-replica, placed by Ray")
    clash = [f for f in rest if f.split("=")[0] in (*OWN_FLAGS, "--gpus")]
    if clash:
        p.error(f"{', '.join(clash)}: the cluster sets each replica's; --host/--port here are the front's")
    return a, rest


def main(argv: Sequence[str] | None = None) -> int:
    a, server_args = parse(sys.argv[1:] if argv is None else argv)
    gpus = 0 if a.gpus == "cpu" else a.gpus_per_replica
    spec = ReplicaSpec(tuple(server_args), gpus=gpus, startup_timeout_s=a.startup_timeout)
    replicas = RayReplicas(spec, a.num_replicas, num_cpus=a.cpus_per_replica, max_restarts=a.max_restarts,
                           name=a.name)
    try:
        urls = replicas.start(a.address)
        print(f"mstar cluster: {len(urls)} replicas ({', '.join(urls)}) behind http://{a.host}:{a.port}",
              flush=True)
        front = Front(urls, replica_timeout=a.replica_timeout, body_timeout=a.body_timeout)
        serving.run(replicas.serve(front), host=a.host, port=a.port, backlog=BACKLOG,
                    shutdown_timeout=SHUTDOWN_TIMEOUT_S, stop_within_s=GRACE_S - EXIT_S,
                    header_timeout=a.header_timeout)
    finally:
        replicas.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
