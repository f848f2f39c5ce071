"""The run context, the detection protocols, the deployable detector and results.json."""
