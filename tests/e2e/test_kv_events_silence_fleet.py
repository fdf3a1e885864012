"""Precise mode with two `extproc serve` replicas sharing a Redis index behind one Envoy, each
binding the KV-event socket that publishers connect to (`index.kv_events.bind`): silence is
judged fleet-wide (server/shared_silence.py). The publisher of `talking` reaches replica 0
only (as a load balancer in front of one bound address would send it); `quiet`'s publisher
never says anything. Both replicas flag `quiet` (judged alone, neither did: nobody ever heard
it), and neither flags `talking`, though replica 1 never hears it itself.

Each replica binds a port of its own here (two processes cannot bind one port on one host);
to a replica that is the same as one address behind a load balancer: it hears the publishers
that reached it. Echo upstreams serve the requests."""

from __future__ import annotations

import time

import httpx
import yaml
import zmq

from extproc.stack import SIM_TOKENIZER_DIR, Stack, StackOptions
from tests.e2e.test_kv_events_silence import MODEL, Publishers, chat, sample
from tests.redis_servers import RedisServer, free_port


def test_replicas_flag_a_publisher_silent_from_its_start_but_not_one_a_peer_hears(
    tmp_path, redis_server: RedisServer
):
    binds = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    configs = []
    for i, bind in enumerate(binds):
        cfg = {
            "parse": {
                "precise": {
                    "tokenizer_dir": str(SIM_TOKENIZER_DIR),
                    "model": MODEL,
                    "block_size": 16,
                }
            },
            "index": {"kv_events": {"bind": bind}},
        }
        path = tmp_path / f"picker-{i}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        configs.append(("--config", str(path)))
    opts = StackOptions(
        upstreams=2,
        log_dir=tmp_path,
        replicas=2,
        redis_url=redis_server.url,
        replica_args=configs,
    )
    ctx = zmq.Context()
    with Stack(opts) as stack, httpx.Client(base_url=stack.url, timeout=10) as http:
        quiet, talking = stack.upstream_addresses
        pubs = Publishers(ctx, binds[0], [talking])
        admins = [stack.picker_admin_port, stack.replica_ports[0][2]]

        def flags(endpoint: str) -> list[float | None]:
            texts = [httpx.get(f"http://127.0.0.1:{a}/metrics").text for a in admins]
            return [sample(t, f'extproc_kv_events_silent{{endpoint="{endpoint}"}}') for t in texts]

        try:
            time.sleep(0.3)  # the PUB socket's subscription handshake
            # Requests go to both replicas; every one `talking` serves is answered by its
            # publisher, heard by replica 0 alone. `quiet` never answers.
            deadline = time.monotonic() + 8.0
            i = 0
            while flags(quiet) != [1.0, 1.0]:
                assert time.monotonic() < deadline, (flags(quiet), flags(talking))
                for _ in range(4):
                    if chat(http, i) == talking:
                        pubs.send(talking)
                    i += 1
                time.sleep(0.1)
            # Fleet-wide judging: replica 1 hears talking's answers through replica 0.
            assert flags(talking) == [0.0, 0.0]
            texts = [httpx.get(f"http://127.0.0.1:{a}/metrics").text for a in admins]
            heard = [sample(t, "extproc_kv_events_silence_fleet_heard_total") for t in texts]
            assert heard[0] == 0.0 and (heard[1] or 0.0) > 0.0, heard
            assert [sample(t, "extproc_kv_events_silence_fleet_degraded") for t in texts] == [
                0.0,
                0.0,
            ]
            logs = [stack.logs("extproc"), stack.logs("extproc-1")]
            assert all(f"no message from {quiet} for" in log for log in logs)
            assert not any(f"no message from {talking}" in log for log in logs)
        finally:
            pubs.close()
            ctx.destroy(linger=0)
