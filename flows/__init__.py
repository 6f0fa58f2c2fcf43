"""Prefect flows, the CLI and the composed pipeline config."""
