"""Transformer++ models."""
