"""Plot the decode-step figures of benchmarks/gpu_bench.py runs: python3 benchmarks/gpu_plot.py RUN.json... OUT.png"""

from __future__ import annotations

import json
import sys


def main(paths: list[str], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for path in paths:
        step = json.load(open(path))["step"]
        tag = path.rsplit("/", 1)[-1].removesuffix(".json")
        for kind in ("graph", "graph_uncompiled", "eager"):
            pts = sorted(
                (int(k.rsplit("_b", 1)[1]), v)
                for k, v in step.items()
                if isinstance(v, dict) and k.rsplit("_b", 1)[0] == kind
            )
            if not pts:
                continue
            bs = [b for b, _ in pts]
            ax1.plot(bs, [v["engine_step_ms"] for _, v in pts], marker="o", label=f"{tag}: {kind} (engine step)")
            if "graph_gpu_ms" in pts[0][1]:
                ax1.plot(bs, [v["graph_gpu_ms"] for _, v in pts], ls="--", marker="x", label=f"{tag}: {kind} (GPU)")
            ax2.plot(bs, [v["frames_per_s"] / 46.875 for _, v in pts], marker="o", label=f"{tag}: {kind}")
    ax1.set(
        xscale="log", yscale="log", xlabel="batch size", ylabel="ms per decode step", title="decode step, H200 bf16"
    )
    ax2.set(
        xscale="log",
        xlabel="batch size",
        ylabel="audio-s per s (engine steps, vocoder incl.)",
        title="decode throughput",
    )
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1:-1], sys.argv[-1])
