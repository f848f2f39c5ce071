"""lapguard runtime core: observable residual networks, trajectory features, detectors, bundles.

Nothing here imports the training stack or the HTTP service.
"""

__version__ = "0.1.0"
