"""The servers :mod:`benchmarks.service_peers` compares lapguard with: the floor runs in the
product's environment, MLServer and Ray Serve in the peers' one (``--peers-venv``)."""
