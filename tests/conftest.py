"""Suite-wide settings. Servers the tests start compile nothing on the CPU (ttsserve serve's default
compiles the decode attention, 2-5 s per process); the compiled path has its own tests
(test_cpu_fast_path.py), which ask for it explicitly."""

import os

os.environ.setdefault("TTSSERVE_CPU_COMPILE", "0")
