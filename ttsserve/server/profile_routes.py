"""POST /start_profile and /stop_profile (vLLM's names): the engine cores' torch profiler, for operators
(engine/profiler.py). Registered only when $TTSSERVE_TORCH_PROFILER_DIR is set, so a server without it answers
404. With API keys configured only an admin key may use them (403 for a plain one)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from ttsserve.engine.profiler import profiler_dir
from ttsserve.server.errors import ApiError, engine_error
from ttsserve.server.serving import ServerState


def register_profile_routes(app: FastAPI, st: ServerState, errors: dict) -> None:
    if profiler_dir() is None:
        return

    def admin_only(request: Request) -> None:
        ident = st.auth.check(request.headers.get("authorization"))
        if st.auth.enabled and not st.auth.is_admin(ident):
            raise ApiError(403, "profiling needs an admin key", code="forbidden")
        if st.engine.dead:
            raise ApiError(503, st.engine.dead_reason or "the engine is gone", code="engine_dead")

    @app.post("/start_profile", tags=["ops"], responses=errors)
    async def start_profile(request: Request):
        admin_only(request)
        try:
            await st.engine.start_profile()
        except Exception as e:
            raise engine_error(e) from e
        return {"status": "profiling", "dir": profiler_dir()}

    @app.post("/stop_profile", tags=["ops"], responses=errors)
    async def stop_profile(request: Request):
        admin_only(request)
        try:
            traces = await st.engine.stop_profile()
        except Exception as e:
            raise engine_error(e) from e
        return {"status": "stopped", "traces": traces}
