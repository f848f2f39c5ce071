"""Data sets by name, the OOD sets, and the synthetic outliers made from a network's images."""
