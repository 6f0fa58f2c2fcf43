"""What goes in: the demo task, dataset sources and their formats, the transform to prompts, preference pairs,
the base model (hub id, folder or GGUF) and the Parquet schemas every stage hands over."""
