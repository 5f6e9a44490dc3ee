"""`python -m mstar.cluster` on a local Ray cluster of two nodes
(`ray.cluster_utils.Cluster`): two `tiny-llama` replicas and two
`orpheus-tiny` replicas, each pair behind its own front address. The
official `openai` client's completions, chat, speech and realtime work
through the front; requests spread over both replicas, on both nodes; a
replica whose server is killed mid-load fails only the requests it was
serving, the survivor serves every request sent after, and Ray brings the
replica back at a new address."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import ray
from openai import AsyncOpenAI, OpenAI
from ray.cluster_utils import Cluster

from mstar.cluster.ray_replicas import NAMESPACE, actor_name

STARTUP_S = 240
pytestmark = pytest.mark.timeout(900)   # the setup starts a cluster and four servers; a restart is waited for
SPEECH = {"model": "orpheus-tiny", "input": "Hello from the cluster.", "voice": "tara", "response_format": "pcm",
          "extra_body": {"max_tokens": 70, "seed": 5, "ignore_eos": True}}
LONG = {**SPEECH, "extra_body": {**SPEECH["extra_body"], "max_tokens": 210}}   # seconds on a CPU: killed mid-way


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Cluster]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


class Front:
    """A `python -m mstar.cluster` process joined to the test cluster; its replica actors' names are prefixed."""

    def __init__(self, cluster: Cluster, model: str, prefix: str, log: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.prefix = prefix
        self.log = open(log, "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mstar.cluster", "--address", cluster.address, "--gpus", "cpu",
             "--num-replicas", "2", "--name", prefix, "--port", str(self.port), "--", "--model", model,
             "--max-num-seqs", "8"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, count: int = 2, timeout: float = STARTUP_S) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self._tail()
            try:
                health = _get_json(f"{self.url}/health")
                if sum(r["healthy"] for r in health["replicas"]) == count:
                    return health
            except (urllib.error.URLError, ConnectionError, ValueError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"the front had no {count} healthy replicas in {timeout} s:\n{self._tail()}")

    def actor(self, index: int):
        return ray.get_actor(actor_name(index, self.prefix), namespace=NAMESPACE)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def gone(self, timeout: float = 30.0) -> bool:
        """Its replica actors are gone (the front stopped them)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.actor(0)
            except ValueError:
                return True
            time.sleep(0.5)
        return False

    def _tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]


@pytest.fixture(scope="module")
def fronts(ray_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Front, Front]]:
    logs = tmp_path_factory.mktemp("cluster")
    # one after the other: Ray's SPREAD is best effort, and the first pair placed on an empty cluster spreads
    text = Front(ray_cluster, "tiny-llama", "text", str(logs / "text.log"))
    speech = None
    try:
        text.wait_healthy()
        speech = Front(ray_cluster, "orpheus-tiny", "speech", str(logs / "speech.log"))
        speech.wait_healthy()
        yield text, speech
    finally:
        for front in (text, speech):
            if front is not None:
                front.stop()
    assert text.gone() and speech is not None and speech.gone(), "a stopped front leaves no replica behind"


def test_text_through_the_front_spreads_over_both_nodes(fronts: tuple[Front, Front]) -> None:
    text, _ = fronts
    client = OpenAI(base_url=f"{text.url}/v1", api_key="unused")
    done = client.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=6, seed=1)
    assert done.usage.completion_tokens == 6 and done.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, seed=2)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    pieces = list(client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, seed=2, stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == chat.choices[0].message.content
    health = _get_json(f"{text.url}/health")
    assert all(r["served"] >= 1 for r in health["replicas"]), health   # one at a time: the tie rotates
    nodes = {ray.get(text.actor(i).info.remote())["node_id"] for i in range(2)}
    assert len(nodes) == 2, "the replicas are spread over the cluster's nodes"
    with urllib.request.urlopen(f"{text.url}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert 'mstar_replica_up{replica="0"} 1' in metrics and 'mstar_replica_up{replica="1"} 1' in metrics


async def _speech(client: AsyncOpenAI, body: dict = SPEECH) -> bytes:
    async with client.audio.speech.with_streaming_response.create(**body) as r:
        return b"".join([chunk async for chunk in r.iter_bytes()])


async def test_speech_and_realtime_through_the_front(fronts: tuple[Front, Front]) -> None:
    _, speech = fronts
    client = AsyncOpenAI(base_url=f"{speech.url}/v1", api_key="unused")
    audio = await _speech(client)
    assert len(audio) > 0 and len(audio) % 2 == 0
    async with client.realtime.connect(model="orpheus-tiny") as conn:
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 35, "mstar": {"seed": 7}})
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Hello there."}]})
        await conn.response.create()
        heard = 0
        async for ev in conn:
            if ev.type == "response.output_audio.delta":
                heard += 1
            if ev.type == "response.done":
                break
        assert heard > 0


async def test_a_replica_killed_mid_load_fails_only_its_requests(fronts: tuple[Front, Front]) -> None:
    _, speech = fronts
    client = AsyncOpenAI(base_url=f"{speech.url}/v1", api_key="unused", max_retries=0)
    before = _get_json(f"{speech.url}/health")["replicas"]
    doomed = ray.get(speech.actor(0).info.remote())
    load = [asyncio.create_task(_speech(client, LONG)) for _ in range(6)]
    deadline = time.monotonic() + 60
    while (seen := [r["outstanding"] for r in _get_json(f"{speech.url}/health")["replicas"]]) != [3, 3]:
        assert time.monotonic() < deadline, f"the requests were never under way three on each replica: {seen}"
        assert not any(t.done() for t in load), f"a request ended before all six were under way: {seen}"
        await asyncio.sleep(0.05)
    os.kill(doomed["pid"], signal.SIGKILL)
    results = await asyncio.gather(*load, return_exceptions=True)
    # what is sent after the kill goes to the survivor while the replica restarts, and is whole
    after = await asyncio.gather(*(_speech(client, LONG) for _ in range(3)))
    whole = len(after[0])   # the same request and seed: the same audio
    assert whole > 0 and [len(a) for a in after] == [whole] * 3
    complete = [r for r in results if isinstance(r, bytes) and len(r) == whole]
    failed = [r for r in results if not isinstance(r, bytes)]
    assert len(complete) + len(failed) == len(results), "an answer cut short must not look complete"
    assert complete and failed, results
    assert all(isinstance(e, Exception) and not isinstance(e, AssertionError) for e in failed), failed
    health = await asyncio.to_thread(speech.wait_healthy, 2, STARTUP_S)
    assert health["replicas"][0]["url"] != before[0]["url"], "Ray restarted the replica, at a new address"
    assert ray.get(speech.actor(0).info.remote())["pid"] != doomed["pid"]


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_replica_whose_port_is_taken_before_its_server_binds_starts_on_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The actor chooses a free port and its server binds it a moment later;
    a port taken in between costs a restart on another, not the replica."""
    from mstar.cluster import replica
    host = ray.util.get_node_ip_address()
    taken = socket.socket()
    taken.bind((host, 0))
    taken.listen()
    chosen = [taken.getsockname()[1]]
    pick = replica._free_port
    monkeypatch.setattr(replica, "_free_port", lambda h: chosen.pop() if chosen else pick(h))
    server = replica.ReplicaServer(0, replica.ReplicaSpec(("--model", "tiny-llama"), startup_timeout_s=STARTUP_S))
    try:
        url = server.url()
        assert server.port != taken.getsockname()[1] and url == f"http://{host}:{server.port}"
        with replica._NO_PROXY.open(f"{url}/health", timeout=10) as r:   # the node's address: never a proxy
            assert r.status == 200
    finally:
        server.stop()
        taken.close()
