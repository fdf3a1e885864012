"""Precise mode through `extproc serve` behind Envoy: a KV-event publisher that stays
connected but goes quiet while the picker keeps placing requests on its endpoint is flagged
(`extproc_kv_events_silent{endpoint}`, a silent period counted, a WARNING line), and the
flag clears with a line when its events resume (index/silence.py).

The publishers are the test's own ZMQ PUB sockets, one per endpoint, connected to the
picker's bound socket with vLLM's topic (`kv@<ip:port>@<model>`): after every response each
sends one batch for the endpoint that served it, as an engine publishes what a request
stored; one of them stops. Echo upstreams serve the requests."""

from __future__ import annotations

import time

import httpx
import msgpack
import yaml
import zmq

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import SIM_TOKENIZER_DIR, Stack, StackOptions
from tests.redis_servers import free_port

MODEL = "tiny"


def sample(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


class Publishers:
    """One PUB socket per endpoint, each with its own sequence (an engine's publisher)."""

    def __init__(self, ctx: zmq.Context, url: str, endpoints: list[str]) -> None:
        self.socks: dict[str, zmq.Socket] = {}
        self.seq = dict.fromkeys(endpoints, 0)
        for e in endpoints:
            s = ctx.socket(zmq.PUB)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(url)
            self.socks[e] = s

    def send(self, endpoint: str) -> None:
        # One empty batch: [timestamp, events, data-parallel rank].
        payload = msgpack.packb([time.time(), [], 0])
        seq = self.seq[endpoint]
        self.seq[endpoint] = seq + 1
        frames = [f"kv@{endpoint}@{MODEL}".encode(), seq.to_bytes(8, "big"), payload]
        self.socks[endpoint].send_multipart(frames)

    def close(self) -> None:
        for s in self.socks.values():
            s.close(linger=0)


def chat(http: httpx.Client, i: int) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}]}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.headers[SERVED_BY_HEADER]


def test_a_publisher_silent_while_requests_are_placed_is_flagged_then_clears(tmp_path):
    bind = f"tcp://127.0.0.1:{free_port()}"
    cfg = {
        "parse": {
            "precise": {"tokenizer_dir": str(SIM_TOKENIZER_DIR), "model": MODEL, "block_size": 16}
        },
        "index": {"kv_events": {"bind": bind}},
    }
    path = tmp_path / "picker.yaml"
    path.write_text(yaml.safe_dump(cfg))
    opts = StackOptions(upstreams=2, log_dir=tmp_path, extproc_args=("--config", str(path)))
    ctx = zmq.Context()
    with Stack(opts) as stack, httpx.Client(base_url=stack.url, timeout=10) as http:
        quiet, talking = stack.upstream_addresses
        pubs = Publishers(ctx, bind, [quiet, talking])
        admin = f"http://127.0.0.1:{stack.picker_admin_port}/metrics"
        silent = f'extproc_kv_events_silent{{endpoint="{quiet}"}}'
        try:
            time.sleep(0.3)  # the PUB sockets' subscription handshakes
            # Both publishers answer their placements: the picker learns their rate.
            for i in range(16):
                pubs.send(chat(http, i))
            deadline = time.monotonic() + 3.0
            while (sample(httpx.get(admin).text, "extproc_kv_events_messages_total") or 0) < 16:
                assert time.monotonic() < deadline, "the publishers' batches did not arrive"
                time.sleep(0.05)
            # `quiet`'s publisher stops; requests keep being placed on it.
            deadline = time.monotonic() + 6.0
            i, text = 16, ""
            while sample(text, silent) != 1.0:
                assert time.monotonic() < deadline, text
                for _ in range(4):
                    served = chat(http, i)
                    i += 1
                    if served == talking:
                        pubs.send(talking)
                time.sleep(0.2)
                text = httpx.get(admin).text
            assert sample(text, f'extproc_kv_events_silent{{endpoint="{talking}"}}') == 0.0
            periods = "extproc_kv_events_silent_periods_total"
            assert sample(text, f'{periods}{{endpoint="{quiet}"}}') == 1.0
            assert f"no message from {quiet}" in stack.logs("extproc")
            # Its events resume: the flag clears at once, with a line.
            pubs.send(quiet)
            deadline = time.monotonic() + 3.0
            while sample(text := httpx.get(admin).text, silent) != 0.0:
                assert time.monotonic() < deadline, text
                time.sleep(0.05)
            assert f"{quiet} heard again" in stack.logs("extproc")
        finally:
            pubs.close()
            ctx.destroy(linger=0)
