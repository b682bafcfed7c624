"""The compiled CPU decode step against the eager one, as served (real-size dummy, packed linears).

Runs B seeded requests through one engine with TTSSERVE_CPU_COMPILE=1; at every decode step the eager forward
runs first on a copy of the KV caches, then the compiled graph, and the two hidden states and their code
logits are compared (the audio follows the graph's). Prints the worst relative hidden-state error, the worst
logit difference and the top-1 agreement of the code logits.

    OMP_WAIT_POLICY=ACTIVE python3 benchmarks/cpu_graph_parity.py --dtype bfloat16 [--quantization int8]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["TTSSERVE_CPU_COMPILE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from ttsserve.config import EngineConfig  # noqa: E402
from ttsserve.engine.engine import Engine  # noqa: E402
from ttsserve.params import SamplingParams, SynthesisRequest  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--frames", type=int, default=48)
    a = ap.parse_args()
    engine = Engine(
        EngineConfig(
            load_format="dummy",
            dummy_size="real",
            device="cpu",
            dtype=a.dtype,
            quantization=a.quantization,
            swap_space=0,
            kv_cache_memory=1 << 29,
        )
    )
    engine.wait_warm()
    runner, graph = engine.runner, engine.runner.cpu_graph
    assert graph is not None and graph.ready, "the compiled step is not ready"
    real_run, stats = graph.run, {"rel": 0.0, "logit": 0.0, "agree": 0, "total": 0, "steps": 0}

    def run_both(x, positions, md):
        saved = [c.clone() for c in runner.kv.layers]
        eager = runner._forward(x, md, positions).float()
        for c, s in zip(runner.kv.layers, saved):
            c.copy_(s)
        compiled = real_run(x, positions, md)
        got = compiled.float()
        le, lc = runner.model.embed.code_logits(eager), runner.model.embed.code_logits(got)
        stats["rel"] = max(stats["rel"], float((got - eager).norm() / eager.norm()))
        stats["logit"] = max(stats["logit"], float((lc - le).abs().max()))
        stats["agree"] += int((lc.argmax(-1) == le.argmax(-1)).sum())
        stats["total"] += le.shape[0] * le.shape[1]
        stats["steps"] += 1
        return compiled

    graph.run = run_both
    for i in range(a.batch):
        p = SamplingParams(min_new_tokens=a.frames, max_new_tokens=a.frames, seed=i)
        engine.add_synthesis(SynthesisRequest(TEXT, code_params=p, split=False))
    while engine.has_unfinished():
        engine.step()
    print(
        f"{a.dtype} quantization={a.quantization} batch={a.batch}: {stats['steps']} decode steps compared; "
        f"worst hidden rel. L2 {stats['rel']:.2e}, worst code-logit diff {stats['logit']:.3f}, "
        f"top-1 agreement {stats['agree'] / max(1, stats['total']):.4f} ({stats['total']} codebook positions)"
    )


if __name__ == "__main__":
    main()
