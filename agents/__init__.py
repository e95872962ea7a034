"""Routers for burstgym: heuristic baselines, Stable-Baselines3 learners and the SB3 VecEnv adapter."""
