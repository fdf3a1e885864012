"""Where requests can go and how loaded each place is: the endpoint pool, in-flight load."""

from extproc.endpoints.inflight import InFlight
from extproc.endpoints.pool import EndpointPool, parse_endpoints

__all__ = ["EndpointPool", "InFlight", "parse_endpoints"]
