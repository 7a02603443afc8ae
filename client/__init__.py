"""Python client of the sentiment model behind TF Serving's REST or gRPC API, or the Open
Inference Protocol (KServe V2) over gRPC.

    from client import SentimentClient

    client = SentimentClient("http://localhost:8501", model="sentiment")
    client.predict(["great movie"])  # [Prediction(text='great movie', label='positive', score=0.97, ...)]
    client.explain(["great movie"])[0].top(3)  # [('great', 1.9), ('great movie', 0.4), ('movie', -0.1)]

The REST transport (the default) needs only `requests`; `transport="grpc"` (TF Serving) and
`transport="grpc-v2"` need grpcio and protobuf (`pip install "sentiment-client[grpc]"`), never TensorFlow.
"""

import logging

from client.client import SentimentClient
from client.exceptions import (ClientError, DeadlineExceeded, InvalidInput, InvalidURL, ModelNotFound, NotAuthorized,
                               ServerUnavailable, TlsError)
from client.results import Explanation, ModelVersionStatus, Prediction

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "SentimentClient",
    "Prediction",
    "Explanation",
    "ModelVersionStatus",
    "ClientError",
    "InvalidURL",
    "TlsError",
    "NotAuthorized",
    "ModelNotFound",
    "InvalidInput",
    "ServerUnavailable",
    "DeadlineExceeded",
]
