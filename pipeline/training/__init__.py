"""The learner: advantages, losses, tree attention, GRPO/PPO and SFT steps."""
