"""What a benchmark report records about where it ran: machine, device, versions, git commit, and peak memory."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit(root: Path = REPO_ROOT) -> str | None:
    """HEAD's hash, with '-dirty' when tracked files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def machine_info(device: str | None = None) -> dict:
    """Host facts plus, for a CUDA device, its name and memory. Safe on machines without CUDA."""
    import torch

    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": device or "cpu",
        "git_commit": git_commit(),
        "command": " ".join([_program(), *sys.argv[1:]]),
        # other processes competing for the CPU distort CPU figures: record how busy the host was
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if device and device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        info.update(gpu_name=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def _program() -> str:
    """`ttsserve` for the console script and `python -m ttsserve.entrypoints.cli`, else the script's name."""
    p = Path(sys.argv[0])
    return "ttsserve" if p.stem == "ttsserve" or p.parts[-2:] == ("ttsserve", "cli.py") else p.name


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; falls back to the lifetime peak elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return lifetime_peak_rss_bytes()


def lifetime_peak_rss_bytes() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * (1 if sys.platform == "darwin" else 1024)


class PeakMemory:
    """Peak device memory of one measured run.

    On CUDA: torch.cuda.max_memory_allocated after a reset at start() ("cuda_max_allocated").
    On CPU: the largest RSS seen by sample() calls (the caller samples once per engine step), since the
    process-lifetime ru_maxrss cannot be reset between runs ("rss_peak_sampled").
    """

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.kind = "cuda_max_allocated" if self.cuda else "rss_peak_sampled"
        self._peak = 0

    def start(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._peak = 0
        self.sample()

    def sample(self) -> None:
        if not self.cuda:
            self._peak = max(self._peak, current_rss_bytes())

    def peak(self) -> int:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated())
        self.sample()
        return self._peak
