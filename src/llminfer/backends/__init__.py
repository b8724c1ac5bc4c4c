"""Backends that run the model step."""
