"""Score image files with any judge from the command line.

    python -m rewards.score --judge pickscore --prompt "a red circle" a.png b.png
    python -m rewards.score --judge "clip[variant=clip-s]" --model ./my-clip --device cpu --prompt "..." *.png

Prints one line per image: the score, a tab, the file name. Bad input (unknown judge,
unreadable image) is reported before any weights load; every error is one line on stderr
and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

import rewards
from rewards.images import UnreadableImageError, load_image
from rewards.mllm import JudgeAnswerError, JudgeNotReadyError
from rewards.secrets import install_log_scrubber, scrub_text
from rewards.weights import MissingWeightsError


class OneLineErrors(argparse.ArgumentParser):
    def error(self, message):
        """A bad or missing flag: one line and exit 2 (argparse would print the whole usage first)."""
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(
        prog="python -m rewards.score",
        description="Score images against a prompt with a judge (higher is better): one line per image, the "
                    "score, a tab, the file name. Judges: python -c 'import rewards; print(rewards.available())'.",
    )
    parser.add_argument("--judge", required=True, help="judge name or spec, e.g. clip, hps, 'clip[variant=clip-s]' "
                        "(required)")
    parser.add_argument("--prompt", required=True, help="the prompt every image is scored against (required)")
    parser.add_argument("images", nargs="+", help="image files (PNG, JPEG, ...)")
    parser.add_argument("--model", help="weights to use instead of the judge's default (hub id, folder or file; "
                        "default: the judge's own)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    parser.add_argument("--dtype", help="float32, float16 or bfloat16 (default: float16 on GPU, float32 on CPU)")
    parser.add_argument("--batch-size", type=int, help="images per forward pass (default: the judge's own)")
    return parser


def judge_options(args: argparse.Namespace) -> dict:
    """Only the options the user gave, so judges without weights (rules) still accept them."""
    options = {"model": args.model, "device": args.device, "dtype": args.dtype, "batch_size": args.batch_size}
    return {k: v for k, v in options.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    install_log_scrubber()
    args = build_parser().parse_args(argv)
    try:
        rewards.check_name(args.judge)
        if args.batch_size is not None and args.batch_size < 1:
            raise ValueError(f"--batch-size must be a positive integer, got {args.batch_size}")
        images = [load_image(path) for path in args.images]
        judge = rewards.load(args.judge, **judge_options(args))
        scores = judge.score([args.prompt] * len(images), images)
    except (rewards.UnknownJudgeError, UnreadableImageError, MissingWeightsError, JudgeNotReadyError, JudgeAnswerError,
            ValueError, TypeError) as err:
        print(f"error: {scrub_text(str(err))}", file=sys.stderr)
        return 2
    for path, value in zip(args.images, scores.tolist()):
        print(f"{value:.6f}\t{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
