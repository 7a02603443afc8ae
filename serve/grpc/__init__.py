"""The gRPC port: TF Serving's PredictionService and ModelService, V2's GRPCInferenceService and
grpc.health.v1 (`tf_serving`, `v2`, `health`), on the server's own HTTP/2 transport: `connection` drives the
sans-IO machine of `serve.http2` and speaks gRPC over it (`calls`)."""
