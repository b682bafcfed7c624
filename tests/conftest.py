"""Suite-wide settings. Servers the tests start compile nothing on the CPU (ttsserve serve's default
compiles the decode attention in a background thread, ~5 s of CPU per process); the compiled path has its own tests
(runner/test_cpu_fast_path.py), which ask for it explicitly."""

import os

os.environ.setdefault("TTSSERVE_CPU_COMPILE", "0")
