"""The package version, in one place (the package, checkpoints and the CLI read it)."""

VERSION = "0.1.0"
