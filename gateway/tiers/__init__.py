"""Tiered models: a public name served by a ladder of models, small first (docs/tiers.md)."""
