"""Flow control: admission in front of scheduling, so overload degrades gracefully.

A request that would overload the pool is held in a queue inside the picker (its ext_proc
stream simply waits) and released when capacity frees, ordered by priority band, then by a
fairness policy between flows (fairness ID x band), then by an ordering policy inside a
flow. Queues are bounded in count, bytes and time; what cannot wait is answered 429 (or 503)
with `x-llm-d-request-dropped-reason` and `retry-after`.

Modules: `detectors` (is the pool saturated?), `admitters` (may it queue at all?),
`policies` (which flow, which request next), `controller` (the queue and its lifecycle),
`tickets` (requests, tickets, reasons, counters),
`objectives` (priority from InferenceObjective names), `eviction` (cutting running
lower-band requests for a blocked higher band), `shared` (queue and usage state shared by
replicas through Redis), `config` (llm-d's `flowControl` / `saturationDetector`
sections), `admission` (the router's hook).
Off unless configured: without a `flowControl` section nothing here runs.
"""

from extproc.flowcontrol.controller import FlowController, FlowRequest, Ticket

__all__ = ["FlowController", "FlowRequest", "Ticket"]
