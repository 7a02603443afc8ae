"""The gRPC port: TF Serving's PredictionService and ModelService, and grpc.health.v1, on grpc.aio."""
