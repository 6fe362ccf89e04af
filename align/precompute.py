"""The the latent store's precompute command: `python -m align.precompute --model MODEL --dataset pairs.parquet ...`.

The code lives in `align/data/precompute.py`; this file keeps the command's path (and `-m align.precompute`) as users know it.
"""

from align.data import precompute

if __name__ == "__main__":
    precompute.main()
