"""The engine core: engine_core.py (EngineCore, the transport-free loop body), proc.py (its process, behind a ZMQ
ROUTER), client.py (CoreClient, the EngineClient of API-server processes), messages.py (the typed msgpack wire
format)."""
