"""Adversarial attacks: the registry, the batched torch attacks, the set store and its Ray engine."""
