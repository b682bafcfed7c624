"""The code sampler's device time per call (CUDA): sample/triton_sampler.py at several launch widths against
sampler.sample op by op and torch.compile'd, on B requests x 4 codebooks x 626 logits with ChatTTS's default
processors (top-p 0.7, top-k 20, repetition penalty 1.05 over a 16-frame window, temperature 0.3).

    python3 benchmarks/sampler_micro.py [--batch-sizes 1 256 512] [--json PATH]

The kernel runs twice per warp count: with its full sort of the keys forced ("sort", top_window 0) and with the
window of the TOP_WINDOW largest keys that top-k 20 takes by default ("top32"). Each figure is
triton.testing.do_bench's median in microseconds (the kernel launched eagerly; the engine replays
it inside a CUDA graph, which removes the launch but not the kernel).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from ttsserve.params import SamplingParams  # noqa: E402
from ttsserve.sample import sampler, triton_sampler  # noqa: E402

R, V, EOS = 4, 626, 625


def _inputs(b: int):
    g = torch.Generator().manual_seed(b)
    params = [SamplingParams(top_p=0.7, top_k=20, temperature=0.3, repetition_penalty=1.05) for _ in range(b)]
    hist = [torch.randint(0, V, (16, R), generator=g) for _ in range(b)]
    batch = sampler.make_sampling_batch(params, list(range(b)), [20] * b, hist, R, EOS, device="cuda")
    return (torch.randn(b, R, V, generator=g) * 2.5).cuda().to(torch.bfloat16), batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 256, 512])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    compiled = torch.compile(sampler.sample, dynamic=True)
    rows = []
    for b in args.batch_sizes:
        logits, batch = _inputs(b)
        row = {"batch": b}
        row["eager_us"] = 1e3 * triton.testing.do_bench(lambda: sampler.sample(logits, batch))
        row["compiled_us"] = 1e3 * triton.testing.do_bench(lambda: compiled(logits, batch))
        want = compiled(logits, batch)
        for window, tag in ((0, "sort"), (triton_sampler.TOP_WINDOW, f"top{triton_sampler.TOP_WINDOW}")):
            for w in (1, 2, 4, 8, 16):
                run = lambda w=w, window=window: triton_sampler.sample(logits, batch, w, window)  # noqa: E731
                got = run()
                row[f"triton_{tag}_w{w}_us"] = 1e3 * triton.testing.do_bench(run)
                row[f"triton_{tag}_w{w}_agree"] = float((got == want).float().mean())
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
