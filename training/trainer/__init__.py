"""Training a residual network: LAP, vanilla and RCE losses, the loop, its checkpoints and monitors."""
