"""The serving core: models and their versions, validation, the batcher, metrics. No HTTP or gRPC here."""
