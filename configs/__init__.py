"""Experiment configs (ml_collections); one file per model and scale, shared pieces in common.py."""
