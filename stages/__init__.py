"""Pure ML stages: no Prefect, no MLflow. Each module has a pydantic config and a `run` function."""
