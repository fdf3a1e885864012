"""The floor processor as an ASGI app for pyvoy, which imports it by name:
`floor_processor.py PORT DEST --transport=pyvoy` starts it (destination from the environment)."""

import os

from floor_transports import pyvoy_app

app = pyvoy_app(os.environ["FLOOR_DESTINATION"])
