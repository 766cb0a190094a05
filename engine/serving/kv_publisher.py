"""KV events on the wire, as vLLM's ``ZmqEventPublisher`` sends them (``--kv-events-port``).

A ZMQ PUB socket sends each batch as the multipart message ``[topic, seq, payload]``: the topic
``kv@<pod>@<model>`` (llm-d reads the pod and the model from it), ``seq`` an 8-byte big-endian
counter from 0 with no gaps, ``payload`` the msgpack-encoded batch (engine/cache/kv_events.py). PUB
drops what a subscriber misses (a late join, a full queue), so a ROUTER socket replays the recent
batches: a client (a DEALER or REQ) sends ``[b"", start_seq]`` (8 bytes, big-endian) and gets
``[b"", seq, payload]`` for every buffered batch from ``start_seq`` on, then ``[b"", -1, b""]``.

One thread owns both sockets (ZMQ sockets are not thread-safe): the step thread only queues batches,
so a slow network never holds up a step.

pyzmq and msgpack are the engine's optional ``kv-events`` extra (docs/operations.md says why): they
are imported only when the flag is on.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from engine.cache.kv_events import EventBatch, KVEventLog

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05


def default_topic(model_name: str, pod: str | None = None) -> str:
    return f"kv@{pod or socket.gethostname()}@{model_name}"


class ZmqEventPublisher:
    """Publishes event batches in order on PUB and serves the last ``buffer_batches`` on ROUTER.

    ``port`` (or ``replay_port``) 0 binds a free port; :attr:`port` says which."""

    def __init__(
        self,
        *,
        topic: str,
        port: int,
        replay_port: int | None = None,
        host: str = "*",
        buffer_batches: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        import msgpack
        import zmq

        self._packer = msgpack.Packer()
        self._topic = topic.encode()
        context: zmq.Context[Any] = zmq.Context.instance()  # shared: never terminated here
        self._pub = context.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self.port = _bind(self._pub, host, port)
        self._replay: Any = None
        self.replay_port: int | None = None
        if replay_port is not None:
            self._replay = context.socket(zmq.ROUTER)
            self.replay_port = _bind(self._replay, host, replay_port)
        self._queue: queue.Queue[EventBatch | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._next_seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        """(Any thread.) Queue a batch; it gets the next sequence number when it is sent."""
        self._queue.put(batch)

    def wait_sent(self) -> None:
        """Block until every batch queued so far is on the wire (and in the replay buffer)."""
        self._queue.join()

    def close(self) -> None:
        """Send what is queued, then close both sockets."""
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # a bad request must not stop the live stream
                    log.exception("KV event replay failed")
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                self._queue.task_done()
                return
            try:
                payload = self._packer.pack(batch)
                seq = self._next_seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq, payload))
                self._buffer.append((self._next_seq, payload))
                self._next_seq += 1
            except Exception:  # keep the thread: later batches still go out (a consumer resyncs by replay)
                log.exception("publishing a KV event batch failed")
            finally:
                self._queue.task_done()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignored a KV event replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def _bind(sock: Any, host: str, port: int) -> int:
    import zmq

    sock.bind(f"tcp://{host}:{port or '*'}")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    return int(endpoint.rsplit(":", 1)[1])


def attach_kv_events(
    engine: LLMEngine, *, port: int, replay_port: int | None, topic: str | None = None, host: str = "*"
) -> ZmqEventPublisher:
    """Publish ``engine``'s prefix-cache changes; call before its step thread starts."""
    cache = engine.prefix_cache()
    if cache is None:
        raise ValueError("KV events need the prefix cache (--kv-events-port with --no-prefix-cache)")
    topic = topic or default_topic(engine.model_name)
    publisher = ZmqEventPublisher(topic=topic, port=port, replay_port=replay_port, host=host)
    events = KVEventLog(cache.block_size, publisher.publish)
    cache.listener = events
    engine.kv_events = events
    log.info("KV events on tcp port %d (replay %s), topic %s", publisher.port, publisher.replay_port, topic)
    return publisher


def start_kv_events(engine: LLMEngine) -> ZmqEventPublisher | None:
    """The publisher ``engine``'s config asks for (``--kv-events-port``), or None."""
    config = engine.config
    port = config.kv_events_port
    if port is None:
        return None
    replay = config.kv_events_replay_port
    if replay is None:
        replay = port + 1 if port else 0
    return attach_kv_events(engine, port=port, replay_port=replay, topic=config.kv_events_topic)
