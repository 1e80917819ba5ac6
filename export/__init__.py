"""Export: the model card and the Hugging Face folder a run publishes."""
