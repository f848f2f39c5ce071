"""Adaptive attacks: attackers that know the deployed detector, and the targets they attack."""
