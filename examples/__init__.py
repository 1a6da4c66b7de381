"""Examples of using dapple's public API (models for the CLI, training scripts)."""
