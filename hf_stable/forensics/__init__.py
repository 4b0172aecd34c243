"""Spike forensics: per-sample loss, attribution of bad steps to training records, and the quarantine."""

from hf_stable.forensics.sample_loss import per_sample_loss

__all__ = ["per_sample_loss"]
