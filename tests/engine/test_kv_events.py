"""KV events (``--kv-events-port``): the radix cache's stores, evictions and clears reach a ZMQ
subscriber as vLLM's msgpack batches, in order, and replay from the ROUTER socket.

The subscriber here is what llm-d's indexer does with them, in small: decode each batch, apply its
events to its own index (hash -> parent hash and tokens) and read the cached prefixes back from it.
After a mixed workload with evictions (and a reset), that index must hold exactly the blocks the
engine's radix tree holds, each with its whole prefix of tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from engine.cache.radix_cache import RadixCache
from engine.cli import build_parser, config_from_args
from engine.core.llm_engine import LLMEngine
from engine.serving.frames import generate_frames
from engine.serving.kv_publisher import END_SEQ, ZmqEventPublisher, attach_kv_events
from engine.serving.requests import engine_request as wire_to_engine
from engine.serving.server import create_app
from protocol.rpc import GenerateRequest, SamplingParams
from tests.engine.tiny_engine import make_byte_tokenizer, make_tiny_engine
from tests.gateway.live_server import ServerThread

TOPIC = "kv@pod-a@tiny"
Prefix = tuple[int, ...]


class BlockIndex:
    """A consumer's view of one engine's cache, built only from the events."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.block_sizes: set[int] = set()

    def apply(self, batch: list[Any]) -> None:
        ts, events, rank = batch
        assert isinstance(ts, float) and rank == 0
        for event in events:
            tag = event[0]
            if tag == "BlockStored":
                hashes, parent, token_ids, block_size, lora_id, medium, lora_name = event[1:]
                assert (lora_id, medium, lora_name) == (None, "GPU", None)
                assert len(token_ids) == len(hashes) * block_size
                assert parent is None or parent in self.blocks, "a parent is stored before its child"
                self.block_sizes.add(block_size)
                for i, block_hash in enumerate(hashes):
                    self.blocks[block_hash] = (
                        parent,
                        tuple(token_ids[i * block_size : (i + 1) * block_size]),
                    )
                    parent = block_hash
            elif tag == "BlockRemoved":
                hashes, medium = event[1:]
                assert medium == "GPU"
                for block_hash in hashes:
                    del self.blocks[block_hash]  # KeyError: removal of a block never stored
            else:
                assert event == ["AllBlocksCleared"]
                self.blocks.clear()

    def prefixes(self) -> set[Prefix]:
        """Every cached block as the whole token prefix up to its end."""
        found = set()
        for block_hash in self.blocks:
            parts: list[tuple[int, ...]] = []
            current: int | None = block_hash
            while current is not None:
                parent, page = self.blocks[current]
                parts.append(page)
                current = parent
            found.add(tuple(t for page in reversed(parts) for t in page))
        return found


def tree_prefixes(cache: RadixCache) -> dict[Hashable, set[Prefix]]:
    """The same view read from the radix tree itself, per namespace."""
    found: dict[Hashable, set[Prefix]] = {}
    stack = [(root, ()) for root in cache._roots.values()]
    while stack:
        node, above = stack.pop()
        bs = cache.block_size
        for page in range(len(node.blocks)):
            found.setdefault(node.namespace, set()).add(above + node.key[: (page + 1) * bs])
        stack.extend((child, above + node.key) for child in node.children.values())
    return found


@pytest.fixture
def llm() -> Iterator[tuple[LLMEngine, ZmqEventPublisher]]:
    engine = make_tiny_engine(make_byte_tokenizer(), num_kv_blocks=40, max_num_seqs=4)
    publisher = attach_kv_events(engine, port=0, replay_port=0, topic=TOPIC, host="127.0.0.1")
    yield engine, publisher
    publisher.close()


def request(rid: str, prompt: str, *, namespace: str | None = None) -> GenerateRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return GenerateRequest(request_id=rid, prompt=prompt, sampling=sampling, cache_namespace=namespace)


def replay(context: zmq.Context, port: int, start: int) -> list[tuple[int, bytes]]:
    """Ask the ROUTER socket for every buffered batch from ``start`` on."""
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    got = []
    try:
        while True:
            assert dealer.poll(30_000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def test_a_subscriber_rebuilds_the_radix_tree_from_the_events(
    llm: tuple[LLMEngine, ZmqEventPublisher],
) -> None:
    engine, publisher = llm
    cache = engine.prefix_cache()
    assert cache is not None
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(f"tcp://127.0.0.1:{publisher.port}")
    try:
        system = "You are a terse assistant. Answer in one line. "
        # Shared prefixes, two namespaces (isolated tenants), and far more distinct prompts than the
        # 40-block pool holds: the tree stores, splits, hits and evicts.
        workload = [request(f"a{i}", system + f"question {i}?") for i in range(6)]
        workload += [request(f"t{i}", system + f"tenant {i}", namespace="t1") for i in range(3)]
        workload += [request(f"b{i}", f"{i} unrelated prompt number {i} " * 2) for i in range(8)]
        generate_frames(engine, workload)
        assert cache.stats().evicted_blocks > 0
        assert engine.reset_prefix_cache()
        generate_frames(engine, [request(f"c{i}", system + f"again {i}") for i in range(3)])

        publisher.wait_sent()
        received: list[tuple[int, bytes]] = []
        while sub.poll(500):  # everything is sent: read what reached the subscriber
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC.encode()
            received.append((int.from_bytes(seq, "big"), payload))
        replayed = replay(context, publisher.replay_port or 0, 0)
    finally:
        sub.close(linger=0)

    # Replay serves every batch from 0 in order with no gaps; the live stream is its tail (a SUB
    # that joins misses what came before it, the reason for the replay socket).
    assert [seq for seq, _ in replayed] == list(range(len(replayed)))
    assert received and replayed[-len(received) :] == received
    index = BlockIndex()
    for _, payload in replayed:
        index.apply(msgpack.unpackb(payload))
    tags = [event[0] for _, payload in replayed for event in msgpack.unpackb(payload)[1]]
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= set(tags)
    assert index.block_sizes == {cache.block_size}

    in_tree = tree_prefixes(cache)
    assert set(in_tree) == {("tiny", None)}  # after the reset only the last three requests' blocks
    assert index.prefixes() == in_tree[("tiny", None)]
    assert len(index.blocks) == cache.stats().tree_blocks


def test_the_index_matches_across_namespaces_without_a_reset(
    llm: tuple[LLMEngine, ZmqEventPublisher],
) -> None:
    """Namespaces share no hash, so one index over both holds the union of the tree's blocks."""
    engine, publisher = llm
    cache = engine.prefix_cache()
    assert cache is not None
    same = "The same prompt in two namespaces, long enough for pages. "
    generate_frames(engine, [request("x", same), request("y", same, namespace="t2")])
    generate_frames(engine, [request(f"e{i}", f"{i} filler that evicts {i} " * 3) for i in range(6)])
    publisher.wait_sent()
    index = BlockIndex()
    for _, payload in replay(zmq.Context.instance(), publisher.replay_port or 0, 0):
        index.apply(msgpack.unpackb(payload))
    in_tree = tree_prefixes(cache)
    assert len(index.blocks) == cache.stats().tree_blocks
    assert index.prefixes() == set().union(*in_tree.values())


def test_replay_from_a_later_sequence_number(llm: tuple[LLMEngine, ZmqEventPublisher]) -> None:
    engine, publisher = llm
    generate_frames(engine, [request(f"r{i}", f"replay {i} " * 4) for i in range(3)])
    publisher.wait_sent()
    everything = replay(zmq.Context.instance(), publisher.replay_port or 0, 0)
    assert len(everything) >= 3
    assert replay(zmq.Context.instance(), publisher.replay_port or 0, 2) == everything[2:]
    assert replay(zmq.Context.instance(), publisher.replay_port or 0, len(everything)) == []


def test_a_reset_is_refused_while_requests_run(llm: tuple[LLMEngine, ZmqEventPublisher]) -> None:
    engine, publisher = llm
    generate_frames(engine, [request("warm", "a prompt that fills a few pages")])
    busy = request("busy", "still running")
    engine.add_request(wire_to_engine(busy, engine.tokenizer, model_name="tiny", grammars=engine.grammars))
    engine.step()
    assert not engine.reset_prefix_cache()  # its blocks would be freed under it
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache()
    publisher.wait_sent()
    batches = replay(zmq.Context.instance(), publisher.replay_port or 0, 0)
    tags = [event[0] for _, payload in batches for event in msgpack.unpackb(payload)[1]]
    assert tags.count("AllBlocksCleared") == 1 and tags[-1] == "AllBlocksCleared"
    assert engine.prefix_cache().stats().tree_blocks == 0  # type: ignore[union-attr]


def test_the_server_publishes_when_the_flag_is_on() -> None:
    """``--kv-events-port`` through the app's lifespan: the publisher starts with the server, a
    request's prompt pages arrive as BlockStored, and it stops with the server."""
    engine = make_tiny_engine(make_byte_tokenizer(), kv_events_port=0, kv_events_topic=TOPIC)
    app = create_app(engine)
    server = ServerThread(app).start()
    try:
        publisher = app.state.kv_publisher
        assert publisher is not None and publisher.replay_port not in (None, publisher.port)
        body = {"model": "tiny", "prompt": "served through the app " * 2, "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        publisher.wait_sent()
        index = BlockIndex()
        for _, payload in replay(zmq.Context.instance(), publisher.replay_port, 0):
            index.apply(msgpack.unpackb(payload))
        assert index.prefixes() == tree_prefixes(engine.prefix_cache())[("tiny", None)]  # type: ignore[arg-type]
    finally:
        server.stop()


def test_the_flag_defaults_to_vllms_port() -> None:
    parser = build_parser()
    assert parser.parse_args([]).kv_events_port is None
    assert parser.parse_args(["--kv-events-port"]).kv_events_port == 5557
    config = config_from_args(parser.parse_args(["--kv-events-port", "6000", "--no-vllm-metrics"]))
    assert (config.kv_events_port, config.kv_events_replay_port, config.vllm_metrics) == (6000, None, False)


def test_events_need_the_prefix_cache_and_real_ports() -> None:
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="prefix cache"):
        EngineConfig(kv_events_port=5557, enable_prefix_cache=False)
    with pytest.raises(ValueError, match=r"0\.\.65534"):
        EngineConfig(kv_events_port=70000)
