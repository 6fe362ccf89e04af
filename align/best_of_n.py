"""The best-of-N command: `python -m align.best_of_n --reward hps --n 16`.

The code lives in `align/eval/best_of_n.py`; this file keeps the command's path (and `-m align.best_of_n`) as users know it.
"""

from align.eval import best_of_n

if __name__ == "__main__":
    best_of_n.main()
