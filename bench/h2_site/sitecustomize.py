"""Put on PYTHONPATH (with the repository) by `bench/serve_bench.py --grpc-transports h2`: every
process of that `python -m serve`, its spawned workers included, runs the gRPC port on `h2`
(`bench/h2_machine.py`) instead of the server's own machine."""

from bench.h2_machine import H2Machine
from serve.grpc.connection import GrpcConnection

GrpcConnection.machine_class = H2Machine
