"""Training stage: TF-IDF vocabulary + DTensor MLP on a mesh, sharded checkpoints (`python -m train`)."""
