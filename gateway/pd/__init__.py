"""Prefill/decode disaggregation, decided per request (see decision.py)."""
