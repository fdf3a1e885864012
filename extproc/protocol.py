"""The endpoint-picker contract with the proxy, in one place: header names, metadata
namespaces and keys (Gateway API Inference Extension v1.0.0 and llm-d conventions)."""

from __future__ import annotations

# Picker -> proxy: where to send the request (an ip:port, or an ordered comma list whose later
# entries are fallbacks). Set as a request header AND as dynamic metadata; the two must agree.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
DESTINATION_KEY = DESTINATION_HEADER

# Proxy -> picker: the subset of endpoints the picker may choose from.
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"

# Proxy -> picker (response path): the endpoint that really served.
SERVED_KEY = "x-gateway-destination-endpoint-served"

# Headers the client may not set: they would choose the upstream or spoof a hint.
PICKER_OWNED_HEADERS = frozenset({DESTINATION_HEADER, SUBSET_HINT_KEY})

REQUEST_ID_HEADER = "x-request-id"
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
MODEL_REWRITE_HEADER = "x-llm-d-model-name-rewrite"

# Operator-only explanation: a request whose `x-extproc-explain` carries one of
# `server.explain_tokens` gets its decision back as JSON in the `x-extproc-decision` response
# header (nobody by default; generated Envoy configs strip both at the edge).
EXPLAIN_HEADER = "x-extproc-explain"
DECISION_HEADER = "x-extproc-decision"

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
EXT_PROC_METHOD = f"/{EXT_PROC_SERVICE}/Process"

# Health service names the proxy and Kubernetes probe; GIE's and llm-d's Helm charts probe
# `inference-extension`.
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE, "inference-extension")

# Envoy applies body mutations in chunks; the reference picker uses 62,000 bytes to stay under
# the 64 KiB frame Envoy buffers per streamed body response.
BODY_CHUNK_BYTES = 62_000
