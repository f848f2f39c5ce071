"""lapguard offline pipeline: data, LAP/vanilla/RCE training, attacks, experiments, reports, CLI."""
