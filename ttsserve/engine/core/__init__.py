"""The engine core in its own process: proc.py (the step loop behind a ZMQ ROUTER), client.py (the
EngineClient of API-server processes), engine_core.py (the transport-free EngineCore), messages.py (the typed msgpack wire format)."""
