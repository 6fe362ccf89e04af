"""The evaluation command: `python -m align.evaluate --models base,runs/a/final`.

The code lives in `align/eval/evaluate.py`; this file keeps the command's path (and `-m align.evaluate`) as users know it.
"""

from align.eval import evaluate

if __name__ == "__main__":
    evaluate.main()
