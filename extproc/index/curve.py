"""ZMQ CURVE for the bound KV-event socket: the picker is the CURVE server (its secret key in
config), publishers are clients, and only publisher public keys on the allow-list may connect
(checked by a ZAP handler). Keys are Z85 strings, as `zmq.curve_keypair()` makes them.

vLLM's own publisher has no CURVE option; this is for publishers that do (a sidecar or
relay). Dialed sockets connect to pool addresses only and do not use it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from extproc.throttle import Throttle

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """`secret_key`: this picker's CURVE secret key; `publisher_keys`: public keys of the
    publishers allowed to connect."""

    secret_key: str
    publisher_keys: frozenset[str]
    # A refused publisher reconnects every 100 ms: one log line per 10 s, not one per try.
    _throttle: Throttle = field(default_factory=lambda: Throttle(every_s=10.0), compare=False)

    @classmethod
    def from_config(cls, secret_key: str, publisher_keys: Sequence[str]) -> CurveKeys:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq was built without CURVE")
        for k in (secret_key, *publisher_keys):
            if len(k) != 40:
                raise ValueError("CURVE keys are 40-character Z85 strings")
        return cls(secret_key, frozenset(publisher_keys))

    @classmethod
    def from_settings(cls, kv_events: Any) -> CurveKeys | None:
        """From `index.kv_events` settings; None when CURVE is not configured."""
        if kv_events is None or kv_events.curve_secret_key is None:
            return None
        return cls.from_config(kv_events.curve_secret_key, kv_events.curve_publisher_keys)

    @property
    def public_key(self) -> str:
        """What publishers set as their `curve_serverkey`."""
        return zmq.curve_public(self.secret_key.encode()).decode()

    def serve(self, ctx: zmq.Context, sock: zmq.Socket) -> Any:
        """Make `sock` (not yet bound) a CURVE server that admits only listed publishers;
        returns the authenticator to `stop()` when done."""
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx, log=log)
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=self)
        sock.curve_secretkey = self.secret_key.encode()
        sock.curve_publickey = self.public_key.encode()
        sock.curve_server = True
        return auth

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: is this client public key (Z85) allowed?"""
        ok = key.decode() in self.publisher_keys
        if not ok and self._throttle.allow("curve") is not None:
            log.warning("kv events: CURVE publisher key refused (further ones for 10 s unlogged)")
        return ok
