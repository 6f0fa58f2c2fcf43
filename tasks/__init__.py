"""Prefect tasks over the stages, the artifact store and MLflow lineage helpers."""
