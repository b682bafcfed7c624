"""`ttsserve serve | say | bench | quantize`."""

from __future__ import annotations

import argparse
import logging
import sys

from ttsserve.constants import SAMPLE_RATE
from ttsserve.engine.args import add_model_args, engine_kwargs


def _add_say_parser(sub) -> None:
    p = sub.add_parser("say", help="synthesize text to an audio file")
    p.add_argument("text", help="text to speak ('-' reads standard input)")
    p.add_argument("-o", "--output", default="out.wav", help="audio file to write (its suffix picks the format)")
    add_model_args(p)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (also the speaker seed)")
    p.add_argument("--speaker", default=None, help="a ChatTTS speaker string, or 'seed:N' for a random speaker")
    p.add_argument("--temperature", type=float, default=0.3, help="sampling temperature of the audio codes")
    p.add_argument("--top-p", type=float, default=0.7, help="nucleus sampling: keep the codes of this probability mass")
    p.add_argument("--top-k", type=int, default=20, help="sample among the k most likely codes")
    p.add_argument("--min-new-tokens", type=int, default=0, help="frames per segment before EOS is allowed")
    p.add_argument(
        "--max-new-tokens", type=int, default=2048, help="cap on frames per text segment (21.3 ms each; 2048 = 43.7 s)"
    )
    p.add_argument("--skip-refine", action="store_true", help="skip the refine-text stage")
    p.add_argument("--no-normalize", action="store_true", help="reference normalization only")
    p.add_argument("--format", default=None, help="wav|flac|mp3|opus|aac|pcm (default: from the file name)")


def _say(a: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from ttsserve.audio.encode import encode_audio
    from ttsserve.entrypoints.tts import TTS
    from ttsserve.params import SamplingParams, Voice
    from ttsserve.text.split import split_text

    text = sys.stdin.read() if a.text == "-" else a.text
    kwargs = engine_kwargs(a)
    # One request: KV room for its segments at once (the engine's CPU pool is max_num_seqs full sequences at
    # most, not the server's 1 GiB), and no host swap pool (nothing to swap for).
    kwargs.setdefault("max_num_seqs", max(1, len(split_text(text))))
    kwargs.setdefault("swap_space", 0.0)
    tts = TTS(**kwargs)
    voice = Voice()
    if a.speaker:
        from ttsserve.text.speaker import decode_speaker

        spk = tts.speaker(int(a.speaker[5:])) if a.speaker.startswith("seed:") else decode_speaker(a.speaker)
        voice = Voice(spk_emb=spk)
    params = SamplingParams(
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        min_new_tokens=a.min_new_tokens,
        max_new_tokens=a.max_new_tokens,
    )
    with tqdm(unit="frame", desc="synthesizing") as bar:  # total: the expected frames (the end sets it exact)

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        (wav,) = tts.generate(
            text, params, voice=voice, refine_text=not a.skip_refine, normalize=not a.no_normalize, progress=progress
        )
    res = next(iter(tts.last_results.values()))
    if wav.size == 0:  # as the server's 500: an empty file would look like success
        print(
            f"error: the model produced no audio (EOS at the first step); {a.output} not written: try another "
            f"--seed, or --min-new-tokens 1",
            file=sys.stderr,
        )
        return 1
    fmt = a.format or Path(a.output).suffix.lstrip(".") or "wav"
    Path(a.output).write_bytes(encode_audio(wav, fmt, SAMPLE_RATE))
    print(
        f"wrote {a.output}: {wav.size / SAMPLE_RATE:.2f} s of audio, {res.num_frames} frames, "
        f"finish={res.finish_reason}"
        + (f", truncated segments {res.truncated_segments}" if res.truncated_segments else "")
    )
    if res.dropped_chars:
        print(f"note: could not speak and dropped: {' '.join(res.dropped_chars)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """`ttsserve` and its sub-commands (serve, say, bench with the offline tools' `quality`, quantize)."""
    from ttsserve.bench.cli_bench import add_bench_parser
    from ttsserve.constants import VERSION
    from ttsserve.entrypoints.serve import add_serve_parser
    from ttsserve.tools.quant.cli import add_quantize_parser
    from ttsserve.tools.quant.quality import add_quality_parser

    ap = argparse.ArgumentParser(prog="ttsserve", description="A vLLM-style serving engine for ChatTTS")
    ap.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")
    sub = ap.add_subparsers(dest="command", required=True)
    _add_say_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub, extra=(add_quality_parser,))
    add_quantize_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from ttsserve.runner.cpu_threads import openmp_env_defaults

    openmp_env_defaults()  # before torch loads: how idle OpenMP threads wait (runner/cpu_threads.py)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = build_parser().parse_args(argv)
    if a.command == "say":
        try:
            return _say(a)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
