"""The streaming vocoder's ISTFT head on CUDA (`IncrementalVocos._overlap_add`): the torch path against the Triton
kernels (audio/triton_istft.py), us a call (triton.testing.do_bench medians, launched eagerly) and kernels a call
(torch.profiler), on the real model's head (Vocos dim 512 -> n_fft 1024 + 2, hop 256) in fp16 with fp32 tails.

    python3 benchmarks/istft_micro.py [--shapes 1x16 128x16 512x16 512x24] [--json PATH]

Shapes are rows x mel frames a row (two mel frames a code frame).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "audio"))

import torch  # noqa: E402
import triton.testing  # noqa: E402
from audio_stage_testutil import random_nets  # noqa: E402

from ttsserve.audio import incremental  # noqa: E402
from ttsserve.audio.incremental import NOT_FINISHED, IncrementalVocos, Rows  # noqa: E402


def _kernels(call) -> int:
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_time_total > 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x16", "128x16", "512x16", "512x24"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    _, _, voc = random_nets(5, hidden=64, dec_dim=32, dec_layers=1, voc_dim=512, voc_layers=1)
    vocos = IncrementalVocos(voc.cuda().half().eval())
    out = []
    with torch.no_grad():
        for shape in args.shapes:
            rows, width = (int(v) for v in shape.split("x"))
            vocos.resize(rows)
            t = lambda v: torch.tensor(v, dtype=torch.int64, device="cuda")  # noqa: E731
            r = Rows(t(range(rows)), t([200 + i for i in range(rows)]), t([width] * rows), t([NOT_FINISHED] * rows),
                     width, vocos.reach)  # fmt: skip
            feats = torch.randn(rows, width, 512, device="cuda", dtype=torch.float16)
            row = {"rows": rows, "width": width}
            for fused in (False, True):
                incremental.USE_TRITON = incremental.TRITON_ISTFT = fused
                tag = "triton" if fused else "torch"
                call = lambda: vocos._overlap_add(feats, r)  # noqa: E731
                row[f"{tag}_us"] = 1e3 * triton.testing.do_bench(call)
                row[f"{tag}_kernels"] = _kernels(call)
            out.append(row)
            print(json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    incremental.USE_TRITON, incremental.TRITON_ISTFT = True, False
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
