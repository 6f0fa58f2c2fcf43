"""Rewards: the score stage, built-in reward functions, reward worker processes and Ray actors that run them,
the pools that keep them between rounds, group-relative advantages, the collapse metrics of a round's
completions, and the replay buffer of groups with signal."""
