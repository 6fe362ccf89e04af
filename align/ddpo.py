"""The online-RL command (DDPO, Flow-GRPO, DiffusionNFT, AWM): `accelerate launch align/ddpo.py --config configs/testbed_ddpo.yaml`.

The code lives in `align/train/ddpo.py`; this file keeps the command's path (and `-m align.ddpo`) as users know it.
"""

from align.train import ddpo

if __name__ == "__main__":
    ddpo.main()
