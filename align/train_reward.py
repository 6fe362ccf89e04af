"""The reward-model training command: `python align/train_reward.py --config configs/testbed_reward.yaml`.

The code lives in `align/train/reward_model.py`; this file keeps the command's path (and `-m align.train_reward`) as users know it.
"""

from align.train import reward_model

if __name__ == "__main__":
    reward_model.main()
