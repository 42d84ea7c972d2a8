# Reinforcement learning from verifiable rewards: GRPO's objective (grpo.py), the reward functions (rewards.py) and
# the rollouts that sample completions and score them (rollout.py).
