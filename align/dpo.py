"""The Diffusion-DPO command: `accelerate launch align/dpo.py --config configs/testbed_dpo.yaml`.

The code lives in `align/train/dpo.py`; this file keeps the command's path (and `-m align.dpo`) as users know it.
"""

from align.train import dpo

if __name__ == "__main__":
    dpo.main()
