"""Data shipped with the package: the demo model pair and prompt sets."""
