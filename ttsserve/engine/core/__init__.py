"""The engine core in its own process: proc.py (the step loop behind a ZMQ ROUTER), client.py (the
AsyncEngine contract for API-server processes), messages.py (the typed msgpack wire format)."""
