"""The gRPC port: TF Serving's PredictionService and ModelService, V2's GRPCInferenceService and
grpc.health.v1, on the server's own HTTP/2 transport (`http2.py`)."""
