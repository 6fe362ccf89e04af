"""Score image files with any judge from the command line.

    python -m rewards.score --judge pickscore --prompt "a red circle" a.png b.png
    python -m rewards.score --judge "clip[variant=clip-s]" --model ./my-clip --device cpu --prompt "..." *.png

Prints one line per image: the score, a tab, the file name. Bad input (unknown judge,
unreadable image) is reported before any weights load; every error is one line on stderr
and exit status 2.
"""

from __future__ import annotations

import argparse
import re
import sys

import rewards
from rewards.images import UnreadableImageError, load_image
from rewards.inputs import escaped, shown, text_problem
from rewards.mllm import JudgeAnswerError, JudgeNotReadyError
from rewards.secrets import install_log_scrubber, scrub_text
from rewards.weights import MissingWeightsError


class OneLineErrors(argparse.ArgumentParser):
    def error(self, message):
        """A bad or missing flag: one line and exit 2 (argparse would print the whole usage first); a value echoed
        in it is escaped and a key in it masked."""
        print(f"error: {escaped(scrub_text(message))} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


# Each flag's values as align's options declare theirs (align/declared.py): the type functions below check them when
# the command line is parsed, and carry their declaration for the fuzzer (tests/test_fuzz.py).
def declared(**declaration):
    def mark(check):
        check.declared = declaration
        return check
    return mark


@declared(kind="text")
def text(value: str) -> str:
    """Text without control characters, bidirectional overrides or bytes that were not UTF-8."""
    if problem := text_problem(value):
        raise argparse.ArgumentTypeError(f"{shown(value)} {problem}")
    return value


@declared(kind="file")
def image_file(value: str) -> str:
    """An image file's path (its content is read and checked by rewards.images.load_image)."""
    return text(value)


@declared(pattern=r"cpu|mps|cuda(:\d+)?")
def device(value: str) -> str:
    """A torch device (a typo such as "gpu" would end in torch's traceback once the judge loads)."""
    if not re.fullmatch(device.declared["pattern"], text(value)):
        raise argparse.ArgumentTypeError(f"must be cpu, mps, cuda or cuda:<n>, got {shown(value)}")
    return value


BATCH = (1, 65536)


@declared(within=f"[{BATCH[0]}, {BATCH[1]}]")
def batch_size(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {shown(value)}") from None
    if not BATCH[0] <= number <= BATCH[1]:
        raise argparse.ArgumentTypeError(f"must be in [{BATCH[0]}, {BATCH[1]}], got {number}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(
        prog="python -m rewards.score",
        description="Score images against a prompt with a judge (higher is better): one line per image, the "
                    "score, a tab, the file name. Judges: python -c 'import rewards; print(rewards.available())'.",
    )
    parser.add_argument("--judge", required=True, type=text, help="judge name or spec, e.g. clip, hps, "
                        "'clip[variant=clip-s]' (required)")
    parser.add_argument("--prompt", required=True, type=text, help="the prompt every image is scored against (required)")
    parser.add_argument("images", nargs="+", type=image_file, help="image files (PNG, JPEG, ...)")
    parser.add_argument("--model", type=text, help="weights to use instead of the judge's default (hub id, folder or "
                        "file; default: the judge's own)")
    parser.add_argument("--device", type=device, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    parser.add_argument("--dtype", type=text, help="float32, float16 or bfloat16 (default: float16 on GPU, float32 on "
                        "CPU)")
    parser.add_argument("--batch-size", type=batch_size, help="images per forward pass (default: the judge's own)")
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
        images = [load_image(path) for path in args.images]
        judge = rewards.load(args.judge, **judge_options(args))
        scores = judge.score([args.prompt] * len(images), images)
    except (rewards.UnknownJudgeError, UnreadableImageError, MissingWeightsError, JudgeNotReadyError, JudgeAnswerError,
            ValueError, TypeError) as err:
        print(f"error: {escaped(scrub_text(str(err)))}", file=sys.stderr)
        return 2
    for path, value in zip(args.images, scores.tolist()):
        print(f"{value:.6f}\t{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
